//! The power share's hook side (docs/sm-limit.md): the device's power from NVML, read by
//! the `vgpu-power` thread (`crate::power`) and once before this process's first context on
//! the device (the baseline); the launch path only loads the thread's latest reading. Also
//! which of the power share's conclusions are worth a log line.

use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_alloc_core::MAX_DEVICES;
use vgpu_limiter::PowerSample;
use vgpu_limiter::power::PowerState;

use super::SmLimiter;
use crate::log::{DEBUG, vlog};
use crate::published::Published;

/// The baselines recorded before each device's first context, handed to its limiter once.
pub(super) struct Baselines {
    /// Set by the first context creation on a device that records a baseline (at most one
    /// per device and process).
    claimed: [AtomicBool; MAX_DEVICES],
    /// The baseline recorded before the device's first context.
    sample: [Published<PowerSample>; MAX_DEVICES],
    /// Set when the device's limiter took its baseline.
    taken: [AtomicBool; MAX_DEVICES],
}

impl Baselines {
    pub(super) const fn new() -> Self {
        Self {
            claimed: [const { AtomicBool::new(false) }; MAX_DEVICES],
            sample: [const { Published::new() }; MAX_DEVICES],
            taken: [const { AtomicBool::new(false) }; MAX_DEVICES],
        }
    }

    /// Hands the device's baseline over (once).
    pub(super) fn take(&self, device: usize) -> Option<PowerSample> {
        let sample = *self.sample.get(device)?.get()?;
        (!self.taken[device].swap(true, Ordering::AcqRel)).then_some(sample)
    }

    /// In a forked child: the child creates its own context and records its own baseline
    /// then; a baseline the parent had not handed over yet is leaked.
    pub(super) fn reset_in_child(&self) {
        for d in 0..MAX_DEVICES {
            self.claimed[d].store(false, Ordering::Relaxed);
            self.sample[d].forget();
            self.taken[d].store(false, Ordering::Relaxed);
        }
    }
}

impl SmLimiter {
    /// Just before the hook creates a context on `device`: records the device's power, so
    /// that the span from here to the first launch (the device idle, as far as this process
    /// goes) measures its idle power. Only the first creation per device counts, and only
    /// when the device has an SM limit and the power share is on.
    pub(super) fn context_creating(&'static self, device: usize) {
        if !self.enabled.load(Ordering::Acquire)
            || device >= MAX_DEVICES
            || self.tuning().power_exponent_pct == 0
        {
            return;
        }
        if self.limit_pct(device) == 0
            || self.baselines.claimed[device].swap(true, Ordering::AcqRel)
        {
            return;
        }
        // Start the reader thread now: its first look, before any work of ours, may already
        // measure the idle power.
        self.power.want(device);
        let Some(reader) = crate::power::Reader::open(device) else {
            vlog!(
                DEBUG,
                "device {device}: no power baseline: NVML has no handle for it"
            );
            return;
        };
        match reader.read(vgpu_shm::monotonic_ns()) {
            Ok(reading) => {
                // Before this process's first context: a quiet draw is the idle power.
                let sample = PowerSample {
                    idle_mw: reading.quiet_draw_mw,
                    ..reading.sample
                };
                vlog!(
                    DEBUG,
                    "device {device}: power baseline before its first context: {} mJ, limit {} mW",
                    sample.energy_mj,
                    sample.limit_mw
                );
                self.baselines.sample[device].publish(sample);
            }
            Err(code) => vlog!(
                DEBUG,
                "device {device}: no power baseline: NVML says {code:?}"
            ),
        }
    }
}

/// Decides which of the power share's conclusions are worth an INFO line: the first one
/// that knows the idle power, then any whose scale moved by more than [`SCALE_NEWS`] since
/// the last INFO line (the DEBUG level shows every one).
#[derive(Debug)]
pub(super) struct PowerLog {
    idle_known: bool,
    scale_at_last_info: f64,
}

/// A change of the power share's scale worth an INFO line.
const SCALE_NEWS: f64 = 0.05;

impl Default for PowerLog {
    fn default() -> Self {
        Self {
            idle_known: false,
            // Before the power share knows anything it scales nothing.
            scale_at_last_info: 1.0,
        }
    }
}

impl PowerLog {
    pub(super) fn wants_info(&mut self, state: &PowerState) -> bool {
        let idle_news = !self.idle_known && state.idle_watts.is_some();
        self.idle_known |= state.idle_watts.is_some();
        let scale_news = (state.scale - self.scale_at_last_info).abs() > SCALE_NEWS;
        if idle_news || scale_news {
            self.scale_at_last_info = state.scale;
        }
        idle_news || scale_news
    }
}

/// Watts for a log line, `?` while unknown.
pub(super) struct Watts(pub(super) Option<f64>);

impl std::fmt::Display for Watts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(w) => write!(f, "{w:.0}"),
            None => f.write_str("?"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(idle: Option<f64>, scale: f64) -> PowerState {
        PowerState {
            watts: 300.0,
            busy: 0.5,
            idle_watts: idle,
            busy_watts: idle.map(|_| 400.0),
            limit_watts: 500.0,
            scale,
        }
    }

    #[test]
    fn power_info_lines_when_idle_power_is_learnt_and_when_the_scale_moves() {
        let mut log = PowerLog::default();
        assert!(!log.wants_info(&state(None, 1.0)), "nothing known yet");
        assert!(
            log.wants_info(&state(Some(100.0), 1.0)),
            "idle power learnt"
        );
        assert!(!log.wants_info(&state(Some(100.0), 1.0)));
        assert!(!log.wants_info(&state(Some(100.0), 0.96)), "within 0.05");
        assert!(log.wants_info(&state(Some(100.0), 0.9)), "moved 0.1");
        // Measured from the last INFO line (0.9), not from the previous call.
        assert!(!log.wants_info(&state(Some(100.0), 0.86)));
        assert!(!log.wants_info(&state(Some(100.0), 0.86)));
        assert!(log.wants_info(&state(Some(100.0), 0.84)));
        assert!(
            !log.wants_info(&state(Some(100.0), f64::NAN)),
            "no NaN lines"
        );
    }

    #[test]
    fn a_scale_change_before_the_idle_power_is_known_is_logged_too() {
        let mut log = PowerLog::default();
        assert!(log.wants_info(&state(None, 0.8)));
        assert!(log.wants_info(&state(Some(90.0), 0.8)), "idle power learnt");
    }

    #[test]
    fn watts_show_a_question_mark_while_unknown() {
        assert_eq!(Watts(Some(99.6)).to_string(), "100");
        assert_eq!(Watts(None).to_string(), "?");
    }

    #[test]
    fn a_baseline_is_handed_over_once() {
        let baselines = Baselines::new();
        let d = MAX_DEVICES - 1;
        assert_eq!(baselines.take(d), None);
        let sample = PowerSample {
            at: 5,
            energy_mj: 7,
            limit_mw: 500_000,
            device_busy: Some(0.0),
            idle_mw: None,
        };
        baselines.sample[d].publish(sample);
        assert_eq!(baselines.take(d), Some(sample));
        assert_eq!(baselines.take(d), None);
        assert_eq!(baselines.take(MAX_DEVICES), None, "out of range");
    }
}
