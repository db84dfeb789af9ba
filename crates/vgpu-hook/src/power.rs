//! Device power readings for the SM limiter's power share (docs/sm-limit.md).
//!
//! NVML queries take long enough on a real GPU to cost a limited process a visible part of
//! its share if made on the launch path (H200 run 13: a 75% spin loop lost 4 points, two
//! containers at 30/70 lost 8–9), so a background thread (`vgpu-power`) reads the devices
//! whose limiter asked, every 100 ms, and publishes each device's latest reading in a few
//! atomics. The launch path only loads them. The thread exists only in processes with an SM
//! limit and the power share on; it stops at exit before NVML is torn down, and a forked
//! child starts its own when its limiter first asks.
//!
//! The thread also measures the device's idle power directly: NVML's power reading is a
//! one-second average on Ampere and newer, so a reading taken after a second in which no
//! kernel ran on the device (utilization 0 all along), or at the first look before this
//! process ran anything, is the idle power.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use vgpu_alloc_core::MAX_DEVICES;
use vgpu_cuda_abi::{CUdevice, c_int, nvmlDevice_t, nvmlReturn_t};
use vgpu_limiter::{Nanos, PowerSample};

use crate::log::{DEBUG, INFO, vlog};
use crate::worker::Worker;

/// How often the thread reads.
const PERIOD: Duration = Duration::from_millis(100);
/// How long the device must have run no kernel for a power reading to be its idle power.
const IDLE_FOR: Nanos = 1_000_000_000;
/// "No value" in the published atomics.
const NONE: u64 = u64::MAX;

/// A 64-bit atomic word: `std`'s in the library, loom's in the model of [`ReadingSeqlock`].
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
    fn fetch_add(&self, value: u64, order: Ordering) -> u64;
}

impl Word for AtomicU64 {
    #[inline]
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }
    #[inline]
    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order)
    }
    #[inline]
    fn fetch_add(&self, value: u64, order: Ordering) -> u64 {
        AtomicU64::fetch_add(self, value, order)
    }
}

/// One device's latest reading. The thread is its only writer and brackets each update
/// with two increments of `seq` (odd while writing); a reader that sees `seq` change or odd
/// gets nothing and asks again later. A reader that loaded any field of a newer update
/// synchronizes with that update's release stores, which follow the first increment, so
/// its second load of `seq` cannot return the old value: a torn reading is never returned
/// (loom model `loom_tests::a_reading_is_never_torn`). Atomics only, so a fork at any
/// instant leaves nothing locked.
pub(crate) struct ReadingSeqlock<W = AtomicU64> {
    seq: W,
    at: W,
    energy_mj: W,
    limit_mw: W,
    busy_pct: W,
    idle_mw: W,
}

impl ReadingSeqlock<AtomicU64> {
    const fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            at: AtomicU64::new(0),
            energy_mj: AtomicU64::new(0),
            limit_mw: AtomicU64::new(0),
            busy_pct: AtomicU64::new(NONE),
            idle_mw: AtomicU64::new(NONE),
        }
    }
}

impl<W: Word> ReadingSeqlock<W> {
    /// Publishes `s` (one writer at a time).
    pub(crate) fn store(&self, s: &PowerSample) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        self.at.store(s.at, Ordering::Release);
        self.energy_mj.store(s.energy_mj, Ordering::Release);
        self.limit_mw.store(s.limit_mw, Ordering::Release);
        let busy = s.device_busy.map_or(NONE, |b| (b * 100.0).round() as u64);
        self.busy_pct.store(busy, Ordering::Release);
        self.idle_mw
            .store(s.idle_mw.unwrap_or(NONE), Ordering::Release);
        self.seq.fetch_add(1, Ordering::AcqRel);
    }

    /// The latest complete reading, if one is published and none is being written.
    pub(crate) fn load(&self) -> Option<PowerSample> {
        let seq = self.seq.load(Ordering::Acquire);
        if seq == 0 || seq % 2 == 1 {
            return None;
        }
        let sample = PowerSample {
            at: self.at.load(Ordering::Acquire),
            energy_mj: self.energy_mj.load(Ordering::Acquire),
            limit_mw: self.limit_mw.load(Ordering::Acquire),
            device_busy: match self.busy_pct.load(Ordering::Acquire) {
                NONE => None,
                pct => Some(pct.min(100) as f64 / 100.0),
            },
            idle_mw: match self.idle_mw.load(Ordering::Acquire) {
                NONE => None,
                mw => Some(mw),
            },
        };
        (self.seq.load(Ordering::Acquire) == seq).then_some(sample)
    }
}

// `PowerReader::wanted` has a bit per device.
const _: () = assert!(MAX_DEVICES <= 64);

/// The reader's process state (one, in the SM limiter's state): each device's latest
/// reading and the thread's controls. Atomics only, so a fork at any instant leaves
/// nothing locked.
pub(crate) struct PowerReader {
    latest: [ReadingSeqlock<AtomicU64>; MAX_DEVICES],
    /// Devices whose limiter asked for readings (bit per device).
    wanted: AtomicU64,
    /// The thread's controls: a step is one device's NVML reading.
    worker: Worker,
    /// Bumped by every [`PowerReader::latest`] (once per publish period of a launching
    /// limiter): while it stands still, nobody launches, and the thread reads once a second
    /// instead of ten times.
    asked: AtomicU64,
}

/// Reads per [`PERIOD`]s while nobody asks: one a second.
const QUIET_EVERY: u32 = 10;
/// The longest an exiting process waits for the thread's NVML call to return (the H200's
/// slowest, the energy counter, took up to 15 ms).
const STOP_WAIT: Duration = Duration::from_millis(100);

impl PowerReader {
    pub(crate) const fn new() -> Self {
        Self {
            latest: [const { ReadingSeqlock::new() }; MAX_DEVICES],
            wanted: AtomicU64::new(0),
            worker: Worker::new(),
            asked: AtomicU64::new(0),
        }
    }

    /// The latest reading of `device`, after asking for readings of it (starts the thread
    /// on first use). `None` until the thread has read it, or when it cannot.
    pub(crate) fn latest(&'static self, device: usize) -> Option<PowerSample> {
        let p = self.latest.get(device)?;
        self.want(device);
        self.asked.fetch_add(1, Ordering::Relaxed);
        p.load()
    }

    /// Asks the thread to read `device` too, starting it if needed.
    pub(crate) fn want(&'static self, device: usize) {
        if device >= MAX_DEVICES {
            return;
        }
        let bit = 1u64 << device;
        if self.wanted.load(Ordering::Relaxed) & bit == 0 {
            self.wanted.fetch_or(bit, Ordering::AcqRel);
        }
        if self.worker.claim() {
            self.start();
        }
    }

    #[cold]
    fn start(&'static self) {
        // exit() runs the atexit list in reverse order of registration, and library
        // destructors (_dl_fini, registered at start-up) last. So NVML is loaded and
        // initialized first (its own handlers, if it registers any, come earlier in the
        // list), then the process root's handler stops the thread before any of them runs;
        // its .fini_array entry stops it again.
        if let Ok(nvml) = crate::real::nvml()
            && let Some(init) = nvml.u.nvmlInit_v2
        {
            // SAFETY: nvmlInit_v2 takes no arguments; repeated calls bump a reference count.
            unsafe { init() };
        }
        crate::state::stop_before_nvml_exits();
        if let Err(e) = self.worker.spawn("vgpu-power", move |_| self.run()) {
            // Without readings the power share stays off: the limit bounds time only.
            vlog!(
                INFO,
                "cannot start the power reader thread ({e}): the SM limit bounds GPU time only"
            );
        }
    }

    /// At exit (before NVML's own teardown can run): no more NVML calls from the thread,
    /// and the one in progress, if any, has returned (waiting at most [`STOP_WAIT`]: exit
    /// never hangs on it).
    pub(crate) fn stop(&self) {
        self.worker.stop(STOP_WAIT);
    }

    /// In the child after `fork`: the thread was not copied; the child's limiters ask again.
    pub(crate) fn reset_in_child(&self) {
        self.worker.reset_in_child();
        self.wanted.store(0, Ordering::Relaxed);
        for p in &self.latest {
            // Not mid-write: the writer thread does not exist in the child. Old readings are
            // the parent's device's, still true, but start clean.
            p.seq.store(0, Ordering::Relaxed);
        }
    }

    fn run(&self) {
        let mut devices: Vec<DeviceReader> =
            (0..MAX_DEVICES).map(|_| DeviceReader::default()).collect();
        let (mut asked, mut quiet) = (u64::MAX, 0u32);
        while !self.worker.stopped() {
            let now_asked = self.asked.load(Ordering::Relaxed);
            if now_asked == asked {
                // Nobody launched since the last round: a reading a second is enough (it
                // still sees the device go idle, for the idle power).
                quiet += 1;
                if quiet % QUIET_EVERY != 0 {
                    std::thread::sleep(PERIOD);
                    continue;
                }
            } else {
                quiet = 0;
            }
            asked = now_asked;
            let wanted = self.wanted.load(Ordering::Acquire);
            for (d, state) in devices.iter_mut().enumerate() {
                if wanted & (1 << d) == 0 || state.unavailable {
                    continue;
                }
                // A panic in NVML's wrapper leaves the device unread this round.
                let Ok(sample) = self.worker.step(|| read_device(d, state)) else {
                    return;
                };
                if let Some(sample) = sample.flatten() {
                    self.latest[d].store(&sample);
                }
            }
            std::thread::sleep(PERIOD);
        }
    }
}

/// What the thread keeps per device.
#[derive(Default)]
struct DeviceReader {
    reader: Option<Reader>,
    unavailable: bool,
    /// Whether a reading was taken already.
    looked: bool,
    /// Since when utilization has read 0 without a break.
    idle_since: Option<Nanos>,
    /// The latest idle power measured.
    idle_mw: Option<u64>,
}

fn read_device(d: usize, state: &mut DeviceReader) -> Option<PowerSample> {
    if state.reader.is_none() {
        state.reader = Reader::open(d);
        if state.reader.is_none() {
            vlog!(
                INFO,
                "device {d}: no NVML handle: the SM limit bounds GPU time only"
            );
            state.unavailable = true;
            return None;
        }
    }
    let reader = state.reader?;
    let first = !state.looked;
    match reader.read(vgpu_shm::monotonic_ns()) {
        Ok(Reading {
            mut sample,
            quiet_draw_mw,
        }) => {
            state.looked = true;
            let now = sample.at;
            if let Some(mw) = quiet_draw_mw {
                let since = *state.idle_since.get_or_insert(now);
                // At the first look (before this process ran anything, or its limiter would
                // have asked before) or after a second of no kernel: the draw is idle.
                if first || now.saturating_sub(since) >= IDLE_FOR {
                    if state.idle_mw.is_none() {
                        vlog!(DEBUG, "device {d}: idle power {mw} mW");
                    }
                    state.idle_mw = Some(mw);
                }
            } else {
                state.idle_since = None;
            }
            sample.idle_mw = state.idle_mw;
            Some(sample)
        }
        // Answers that will not change: stop asking.
        Err(
            code @ (nvmlReturn_t::NOT_SUPPORTED
            | nvmlReturn_t::FUNCTION_NOT_FOUND
            | nvmlReturn_t::NO_PERMISSION),
        ) => {
            vlog!(
                INFO,
                "device {d}: NVML cannot read its power ({code:?}): the SM limit bounds GPU \
                 time only"
            );
            state.unavailable = true;
            None
        }
        Err(code) => {
            vlog!(DEBUG, "device {d}: power not read: NVML says {code:?}");
            None
        }
    }
}

/// Reads one device's power from NVML.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reader {
    /// The `nvmlDevice_t` (an address, so the reader is `Send`).
    handle: usize,
}

impl Reader {
    #[cold]
    pub(crate) fn open(device: usize) -> Option<Self> {
        let cuda = crate::real::cuda().ok()?;
        let handle = crate::driver::nvml_device(cuda, CUdevice(device as c_int))?;
        Some(Self {
            handle: handle as usize,
        })
    }

    /// The device's power now, stamped `at` (`idle_mw` left to the caller), and its draw
    /// if no kernel ran in the device's last sample period: the energy counter and the
    /// enforced limit are needed, the busy fraction and the draw are optional.
    pub(crate) fn read(&self, at: Nanos) -> Result<Reading, nvmlReturn_t> {
        let handle = self.handle as nvmlDevice_t;
        let energy_mj = crate::driver::nvml_energy_mj(handle)?;
        let limit_mw = crate::driver::nvml_power_limit_mw(handle)?;
        let busy_pct = crate::driver::nvml_gpu_busy_pct(handle).ok();
        let draw_mw = crate::driver::nvml_power_usage_mw(handle).ok();
        Ok(Reading {
            sample: PowerSample {
                at,
                energy_mj,
                limit_mw: u64::from(limit_mw),
                device_busy: busy_pct.map(|pct| f64::from(pct.min(100)) / 100.0),
                idle_mw: None,
            },
            quiet_draw_mw: draw_mw.filter(|_| busy_pct == Some(0)).map(u64::from),
        })
    }
}

/// One [`Reader::read`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reading {
    pub(crate) sample: PowerSample,
    /// NVML's draw (`nvmlDeviceGetPowerUsage`, a one-second average on Ampere and newer)
    /// when the device ran no kernel in its last sample period: at a first look, before this
    /// process ran anything, or after a second of such readings, the idle power.
    pub(crate) quiet_draw_mw: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_forked_during_a_reading_does_not_wait_for_it_at_exit() {
        let r = PowerReader::new();
        // The parent's thread was in an NVML call when the process forked.
        r.worker.enter_step_for_test();
        r.reset_in_child();
        assert!(
            !r.worker.in_step(),
            "exit would wait for a call no thread makes"
        );
    }

    #[test]
    fn published_readings_round_trip_and_an_unwritten_slot_reads_none() {
        let p = ReadingSeqlock::new();
        assert_eq!(p.load(), None);
        let s = PowerSample {
            at: 42,
            energy_mj: 7,
            limit_mw: 700_000,
            device_busy: Some(0.37),
            idle_mw: Some(125_000),
        };
        p.store(&s);
        assert_eq!(p.load(), Some(s));
        let s2 = PowerSample {
            device_busy: None,
            idle_mw: None,
            ..s
        };
        p.store(&s2);
        assert_eq!(p.load(), Some(s2));
        // Mid-write (odd sequence): nothing.
        p.seq.fetch_add(1, Ordering::AcqRel);
        assert_eq!(p.load(), None);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    impl Word for loom::sync::atomic::AtomicU64 {
        fn load(&self, order: Ordering) -> u64 {
            loom::sync::atomic::AtomicU64::load(self, order)
        }
        fn store(&self, value: u64, order: Ordering) {
            loom::sync::atomic::AtomicU64::store(self, value, order)
        }
        fn fetch_add(&self, value: u64, order: Ordering) -> u64 {
            loom::sync::atomic::AtomicU64::fetch_add(self, value, order)
        }
    }

    fn word(v: u64) -> loom::sync::atomic::AtomicU64 {
        loom::sync::atomic::AtomicU64::new(v)
    }

    /// Reading `n`: every field says `n` (so a mix of two readings is visible).
    fn reading(n: u64) -> PowerSample {
        PowerSample {
            at: n,
            energy_mj: n,
            limit_mw: n,
            device_busy: Some(n as f64 / 100.0),
            idle_mw: Some(n),
        }
    }

    #[test]
    fn a_reading_is_never_torn() {
        loom::model(|| {
            let p = loom::sync::Arc::new(ReadingSeqlock {
                seq: word(0),
                at: word(0),
                energy_mj: word(0),
                limit_mw: word(0),
                busy_pct: word(NONE),
                idle_mw: word(NONE),
            });
            p.store(&reading(1));
            let writer = {
                let p = p.clone();
                loom::thread::spawn(move || p.store(&reading(2)))
            };
            if let Some(r) = p.load() {
                assert!([reading(1), reading(2)].contains(&r), "torn reading {r:?}");
            }
            writer.join().unwrap();
            assert_eq!(p.load(), Some(reading(2)));
        });
    }
}
