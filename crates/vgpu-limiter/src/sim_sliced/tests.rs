//! The time-slicing model's physics, one property per test.

use super::*;

const US: Nanos = 1_000;
const MS: Nanos = 1_000_000;
const S: Nanos = 1_000_000_000;

const SLICE: Nanos = 2_090 * US;
const SWITCH: Nanos = 150 * US;
const YIELD: Nanos = 20 * US;
const KERNEL_LATENCY: Nanos = 3 * US;
const MARKER_LATENCY: Nanos = US;
const MARKER_HOST: Nanos = 3 * US;

/// The H200's parameters with free markers: the other tests' arithmetic leaves the
/// marker's drain out (it has its own test).
fn h200_params() -> SliceParams {
    SliceParams {
        marker_cost: 0,
        ..SliceParams::h200()
    }
}

fn h200() -> SlicedGpu {
    let gpu = SlicedGpu::new(h200_params());
    let p = gpu.params();
    assert_eq!(
        (p.slice, p.switch_cost, p.yield_cost),
        (SLICE, SWITCH, YIELD)
    );
    assert_eq!(
        (p.kernel_latency, p.marker_latency, p.marker_host),
        (KERNEL_LATENCY, MARKER_LATENCY, MARKER_HOST)
    );
    gpu
}

fn with(f: impl FnOnce(&mut SliceParams)) -> SlicedGpu {
    let mut p = h200_params();
    f(&mut p);
    SlicedGpu::new(p)
}

/// `n` kernels of `dur` tagged `tag`, all submitted at `at`.
fn queue(gpu: &SlicedGpu, ctx: CtxId, at: Nanos, n: usize, dur: Nanos, tag: u64) {
    for _ in 0..n {
        gpu.submit_kernel(ctx, 1, at, dur, tag);
    }
}

/// A host program driving one stream of one context.
#[derive(Clone, Copy, Debug)]
enum Program {
    /// Keeps at least `depth / 2` kernels of `dur` queued (tops up to `depth`), tag `tag`.
    Deep { dur: Nanos, depth: usize, tag: u64 },
    /// Launches a kernel of `dur` every `period` (the host is away in between, whatever the
    /// GPU does); the n-th launch is tagged `tag + n`.
    LaunchBound { dur: Nanos, period: Nanos, tag: u64 },
}

struct Host {
    ctx: CtxId,
    program: Program,
    next: Nanos,
    /// (host submission, tag) of every launch.
    launched: Vec<(Nanos, u64)>,
}

impl Host {
    fn new(gpu: &SlicedGpu, program: Program) -> Self {
        Self {
            ctx: gpu.add_context(),
            program,
            next: 0,
            launched: Vec::new(),
        }
    }

    fn act(&mut self, gpu: &SlicedGpu, t: Nanos) {
        match self.program {
            Program::Deep { dur, depth, tag } => {
                for _ in gpu.queued(self.ctx, 1)..depth {
                    gpu.submit_kernel(self.ctx, 1, t, dur, tag);
                }
                self.next = t + dur * depth as u64 / 2;
            }
            Program::LaunchBound { dur, period, tag } => {
                let tag = tag + self.launched.len() as u64;
                gpu.submit_kernel(self.ctx, 1, t, dur, tag);
                self.launched.push((t, tag));
                self.next = t + period;
            }
        }
    }
}

/// The driver loop: steps to the earlier of the hosts' next action and the GPU's next event.
fn drive(gpu: &SlicedGpu, hosts: &mut [Host], until: Nanos) {
    loop {
        let host = hosts.iter().map(|h| h.next).min().unwrap_or(Nanos::MAX);
        let t = gpu.next_event().map_or(host, |e| e.min(host));
        if t >= until {
            gpu.advance_to(until);
            return;
        }
        gpu.advance_to(t);
        for h in hosts.iter_mut().filter(|h| h.next == t) {
            h.act(gpu, t);
        }
    }
}

/// Runs of the GPU by one context without a gap: (ctx, start, end).
fn turns(gpu: &SlicedGpu, t0: Nanos, t1: Nanos) -> Vec<(CtxId, Nanos, Nanos)> {
    let mut out: Vec<(CtxId, Nanos, Nanos)> = Vec::new();
    for iv in gpu.intervals(t0, t1) {
        match out.last_mut() {
            Some(last) if last.0 == iv.ctx && last.2 == iv.start => last.2 = iv.end,
            _ => out.push((iv.ctx, iv.start, iv.end)),
        }
    }
    out
}

#[test]
fn a_context_alone_runs_back_to_back_past_any_slice() {
    let gpu = h200();
    let a = gpu.add_context();
    for i in 0..200 {
        gpu.submit_kernel(a, 1, 0, 20 * US, i);
    }
    gpu.advance_to(10 * MS);
    let ivs = gpu.intervals(0, 10 * MS);
    assert_eq!(ivs.len(), 200);
    for (i, iv) in ivs.iter().enumerate() {
        let start = KERNEL_LATENCY + i as u64 * 20 * US;
        assert_eq!(
            (iv.start, iv.end, iv.tag),
            (start, start + 20 * US, i as u64)
        );
    }
    // 4 ms of work, twice a slice, and never interrupted.
    assert_eq!(gpu.device_busy_ns(0, 10 * MS), 4 * MS);
    assert_eq!(gpu.busy_ns(a, 0, 10 * MS), 4 * MS);
    assert_eq!(gpu.switches(), 0);
    assert!(gpu.context_idle(a) && gpu.stream_idle(a, 1));
}

#[test]
fn two_deep_contexts_alternate_in_slices() {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    queue(&gpu, a, 0, 10_000, 20 * US, 1);
    queue(&gpu, b, 0, 10_000, 20 * US, 2);
    let end = 100 * MS;
    gpu.advance_to(end);
    let ivs = gpu.intervals(0, end);
    // Kernels of one tag back to back merge: one interval per slice.
    let (last, full) = ivs.split_last().unwrap();
    assert!(full.len() >= 40);
    for (k, iv) in full.iter().enumerate() {
        let start = KERNEL_LATENCY + k as u64 * (SLICE + SWITCH);
        let ctx = if k % 2 == 0 { a } else { b };
        // 2.09 ms is not a whole number of 20 µs kernels: each slice ends mid-kernel.
        assert_eq!(
            (iv.ctx, iv.start, iv.end),
            (ctx, start, start + SLICE),
            "slice {k}"
        );
    }
    assert_eq!(last.start, full.last().unwrap().end + SWITCH);
    assert_eq!(gpu.preemptions(), ivs.len() as u64 - 1);
    assert_eq!(gpu.switches(), gpu.preemptions());
    // Each gets about half, less the switches (6.7% of the GPU lost).
    let (ba, bb) = (gpu.busy_ns(a, 0, end), gpu.busy_ns(b, 0, end));
    let half = end as f64 * SLICE as f64 / (2 * (SLICE + SWITCH)) as f64;
    for got in [ba, bb] {
        assert!((got as f64 - half).abs() <= SLICE as f64, "{got} vs {half}");
    }
    assert_eq!(gpu.device_busy_ns(0, end), ba + bb);
    let lost = 1.0 - (ba + bb) as f64 / end as f64;
    assert!((0.06..0.075).contains(&lost), "{lost}");
}

#[test]
fn a_context_whose_queue_empties_yields_at_once() {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    queue(&gpu, a, 0, 3, 100 * US, 1);
    queue(&gpu, b, 0, 1_000, 20 * US, 2);
    gpu.advance_to(30 * MS);
    let ivs = gpu.intervals(0, 30 * MS);
    let b_start = KERNEL_LATENCY + 300 * US + YIELD;
    assert_eq!(
        ivs,
        [
            Interval {
                start: KERNEL_LATENCY,
                end: KERNEL_LATENCY + 300 * US,
                ctx: a,
                tag: 1
            },
            // Alone now: B runs its 20 ms without a slice expiry.
            Interval {
                start: b_start,
                end: b_start + 20 * MS,
                ctx: b,
                tag: 2
            },
        ]
    );
    assert_eq!((gpu.switches(), gpu.preemptions()), (1, 0));
    assert_eq!(gpu.switch_dead_ns(), YIELD);
}

#[test]
fn an_idle_gpu_starts_its_resident_context_at_once_and_another_after_a_switch() {
    let gpu = h200();
    let (a, b, c) = (gpu.add_context(), gpu.add_context(), gpu.add_context());
    let starts = |t| -> Vec<(CtxId, Nanos)> {
        gpu.advance_to(t);
        gpu.intervals(0, t)
            .iter()
            .map(|iv| (iv.ctx, iv.start))
            .collect()
    };
    // The first context to have work is loaded for free.
    gpu.submit_kernel(a, 1, 0, 100 * US, 1);
    // Another context after the GPU idled with A resident pays a switch; B again does not.
    gpu.submit_kernel(b, 1, MS, 100 * US, 2);
    gpu.submit_kernel(b, 1, 2 * MS, 100 * US, 2);
    let k = KERNEL_LATENCY;
    assert_eq!(
        starts(3 * MS),
        [(a, k), (b, MS + k + YIELD), (b, 2 * MS + k)]
    );
    // Work of several contexts at once on an idle GPU: round robin after the resident one.
    gpu.submit_kernel(a, 1, 5 * MS, 100 * US, 1);
    gpu.submit_kernel(c, 1, 5 * MS, 100 * US, 3);
    let c_start = 5 * MS + k + YIELD;
    assert_eq!(
        starts(6 * MS)[3..],
        [(c, c_start), (a, c_start + 100 * US + YIELD)]
    );
    assert_eq!((gpu.switches(), gpu.preemptions()), (3, 0));
}

#[test]
fn a_long_kernel_is_preempted_at_slice_expiry_and_resumes() {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    gpu.submit_kernel(a, 1, 0, 10 * MS, 1);
    let behind = gpu.record_marker(a, 1, 0);
    queue(&gpu, b, 0, 10_000, 20 * US, 2);
    gpu.advance_to(40 * MS);
    let pieces: Vec<_> = (gpu.intervals(0, 40 * MS).into_iter())
        .filter(|iv| iv.ctx == a)
        .map(|iv| (iv.start, iv.end))
        .collect();
    let round = 2 * (SLICE + SWITCH);
    let mut want: Vec<_> = (0..4)
        .map(|k| KERNEL_LATENCY + k * round)
        .map(|s| (s, s + SLICE))
        .collect();
    let a_end = KERNEL_LATENCY + 4 * round + (10 * MS - 4 * SLICE);
    want.push((KERNEL_LATENCY + 4 * round, a_end));
    assert_eq!(pieces, want);
    assert_eq!(gpu.tag_busy_ns(1, 0, 40 * MS), 10 * MS);
    // The marker behind it completes when it ends, B's slices included.
    assert_eq!(gpu.marker_done(behind), Some(a_end));
    // Then A yields and B runs alone.
    let last = *gpu.intervals(0, 40 * MS).last().unwrap();
    assert_eq!(
        (last.ctx, last.start, last.end),
        (b, a_end + YIELD, 40 * MS)
    );
    assert_eq!((gpu.preemptions(), gpu.switches()), (8, 9));
}

#[test]
fn a_preempted_kernel_resumes_before_its_contexts_other_streams() {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    gpu.submit_kernel(a, 1, 0, 5 * MS, 1);
    gpu.submit_kernel(a, 2, 0, 20 * US, 2);
    queue(&gpu, b, 0, 1_000, 20 * US, 3);
    gpu.advance_to(20 * MS);
    let ivs = gpu.intervals(0, 20 * MS);
    let first_of_2 = ivs.iter().find(|iv| iv.tag == 2).unwrap().start;
    let end_of_1 = ivs.iter().rfind(|iv| iv.tag == 1).unwrap().end;
    assert_eq!(first_of_2, end_of_1);
    assert_eq!(gpu.tag_busy_ns(1, 0, 20 * MS), 5 * MS);
}

#[test]
fn streams_of_one_context_take_turns_at_item_boundaries() {
    let gpu = h200();
    let a = gpu.add_context();
    for i in 0..3 {
        gpu.submit_kernel(a, 7, 0, 10 * US, 10 + i);
        gpu.submit_kernel(a, 9, 0, 10 * US, 20 + i);
    }
    gpu.advance_to(MS);
    let tags: Vec<u64> = gpu.intervals(0, MS).iter().map(|iv| iv.tag).collect();
    assert_eq!(tags, [10, 20, 11, 21, 12, 22]);
    assert_eq!(gpu.device_busy_ns(0, MS), 60 * US);
    assert_eq!(gpu.switches(), 0);
}

#[test]
fn a_start_marker_on_an_idle_stream_completes_before_the_kernel_starts() {
    let gpu = h200();
    let a = gpu.add_context();
    let start = gpu.record_marker(a, 1, 0);
    gpu.submit_kernel(a, 1, 0, 100 * US, 1);
    let end = gpu.record_marker(a, 1, 0);
    gpu.advance_to(MARKER_LATENCY - 1);
    assert_eq!(gpu.marker_done(start), None);
    gpu.advance_to(MS);
    assert_eq!(gpu.marker_done(start), Some(MARKER_LATENCY));
    // The host recorded the start marker before the launch call: the kernel comes that
    // much later.
    let k = gpu.intervals(0, MS)[0];
    let visible = MARKER_HOST + KERNEL_LATENCY;
    assert_eq!((k.start, k.end), (visible, visible + 100 * US));
    // The end marker was visible long before: it completes with the kernel.
    assert_eq!(gpu.marker_done(end), Some(k.end));
    let span = gpu.marker_done(end).unwrap() - gpu.marker_done(start).unwrap();
    assert_eq!(span, 100 * US + visible - MARKER_LATENCY);
}

#[test]
fn a_marker_behind_queued_work_completes_when_the_work_ends() {
    let gpu = h200();
    let a = gpu.add_context();
    gpu.submit_kernel(a, 1, 0, MS, 1);
    let m = gpu.record_marker(a, 1, 500 * US);
    gpu.advance_to(MS);
    assert_eq!(gpu.marker_done(m), None);
    assert!(!gpu.stream_idle(a, 1));
    gpu.advance_to(2 * MS);
    assert_eq!(gpu.marker_done(m), Some(KERNEL_LATENCY + MS));
    assert!(gpu.stream_idle(a, 1));
}

#[test]
fn a_marker_drains_before_its_timestamp_so_a_bracket_measures_more_than_its_kernels() {
    const DRAIN: Nanos = 4 * US;
    let gpu = with(|p| p.marker_cost = DRAIN);
    let a = gpu.add_context();
    // One kernel bracketed, behind queued work (a chained sample): its time plus one drain.
    gpu.submit_kernel(a, 1, 0, MS, 1);
    let start = gpu.record_marker(a, 1, 0);
    gpu.submit_kernel(a, 1, 0, 10 * US, 1);
    let end = gpu.record_marker(a, 1, 0);
    // Ten kernels back to back inside one bracket: their time plus one drain.
    for _ in 0..10 {
        gpu.submit_kernel(a, 1, 0, 10 * US, 1);
    }
    let end10 = gpu.record_marker(a, 1, 0);
    gpu.advance_to(5 * MS);
    let t = |m| gpu.marker_done(m).expect("done");
    assert_eq!(t(end) - t(start), 10 * US + DRAIN);
    assert_eq!(t(end10) - t(end), 100 * US + DRAIN);
    // The drain is the context's GPU time, not its kernels'.
    assert_eq!(gpu.busy_ns(a, 0, 5 * MS), MS + 110 * US + 3 * DRAIN);
    assert_eq!(gpu.tag_busy_ns(1, 0, 5 * MS), MS + 110 * US);
}

#[test]
fn a_completion_only_marker_drains_nothing_and_has_no_time_to_read() {
    // On the H200 a completion-only event costs the stream no measurable time where a
    // timing event costs ~2.1 µs (gpu-tests/compute/marker_cost.cu).
    const DRAIN: Nanos = 4 * US;
    let gpu = with(|p| p.marker_cost = DRAIN);
    let a = gpu.add_context();
    gpu.submit_kernel(a, 1, 0, 10 * US, 1);
    let done = gpu.record_marker_as(a, 1, 0, MarkerKind::Completion);
    gpu.submit_kernel(a, 1, 0, 10 * US, 1);
    gpu.advance_to(MS);
    assert_eq!(gpu.marker_done(done), Some(KERNEL_LATENCY + 10 * US));
    assert!(!gpu.is_timed(done));
    assert_eq!(gpu.busy_ns(a, 0, MS), 20 * US, "no drain");
    let clock = SimClock::default();
    clock.set(MS);
    let mut timer = SlicedTimer {
        gpu: gpu.clone(),
        clock,
        ctx: a,
        gates: Vec::new(),
    };
    let start = timer.record(1, MarkerKind::Timed).unwrap();
    timer.clock.set(2 * MS);
    assert!(timer.is_complete(start).unwrap());
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = timer.elapsed(done, start);
    }))
    .expect_err("the limiter must never ask for a completion marker's time");
    let said = refused
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| refused.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(said.contains("completion-only"), "{said}");
}

#[test]
fn a_marker_is_work_of_its_context_and_waits_for_its_turn() {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    queue(&gpu, b, 0, 1_000, 20 * US, 2);
    let m = gpu.record_marker(a, 1, MS);
    gpu.advance_to(10 * MS);
    let a_runs = KERNEL_LATENCY + SLICE + SWITCH;
    assert_eq!(gpu.marker_done(m), Some(a_runs));
    // A had nothing else: it yields at once.
    let b_turns: Vec<_> = turns(&gpu, 0, 10 * MS);
    assert_eq!(b_turns[1].1, a_runs + YIELD);
    assert_eq!((gpu.switches(), gpu.preemptions()), (2, 1));
}

#[test]
fn a_newcomer_waits_for_the_slice_boundary_as_the_renewal_rule_says() {
    // B alone since 3 µs, deep; A launches one kernel at `at`: when does it start?
    let start_of_a = |renewal, at| {
        let gpu = with(|p| p.renewal = renewal);
        let (a, b) = (gpu.add_context(), gpu.add_context());
        queue(&gpu, b, 0, 1_000, 20 * US, 2);
        gpu.submit_kernel(a, 1, at, 50 * US, 1);
        gpu.advance_to(30 * MS);
        gpu.intervals(0, 30 * MS)
            .iter()
            .find(|iv| iv.ctx == a)
            .unwrap()
            .start
    };
    let first_expiry = KERNEL_LATENCY + SLICE;
    for renewal in [SliceRenewal::Periodic, SliceRenewal::Exhausted] {
        assert_eq!(
            start_of_a(renewal, MS),
            first_expiry + SWITCH,
            "{renewal:?}"
        );
    }
    // Visible at 10.503 ms, inside B's fifth renewed slice.
    let visible = 10_500 * US + KERNEL_LATENCY;
    assert_eq!(
        start_of_a(SliceRenewal::Periodic, 10_500 * US),
        first_expiry + 5 * SLICE + SWITCH
    );
    assert_eq!(
        start_of_a(SliceRenewal::Exhausted, 10_500 * US),
        visible + SWITCH
    );
}

#[test]
fn a_launch_bound_context_waits_for_the_rest_of_a_deep_ones_slice() {
    let gpu = h200();
    let bound = Program::LaunchBound {
        dur: 50 * US,
        period: 300 * US,
        tag: 1_000,
    };
    let deep = Program::Deep {
        dur: 20 * US,
        depth: 64,
        tag: 2,
    };
    let mut hosts = [Host::new(&gpu, bound), Host::new(&gpu, deep)];
    let (a, b) = (hosts[0].ctx, hosts[1].ctx);
    let end = S;
    drive(&gpu, &mut hosts, end);
    let turns = turns(&gpu, 0, end);
    assert!(turns.len() > 400, "{}", turns.len());
    for w in turns.windows(2).skip(1).take(turns.len() - 3) {
        let ((c0, s0, e0), (c1, s1, _)) = (w[0], w[1]);
        if c0 == b {
            // B is never cut short by A's arrival: it loses the GPU at its slice's end.
            assert_eq!((e0 - s0, c1, s1), (SLICE, a, e0 + SWITCH));
        } else {
            // A never fills a slice: it yields the moment its queue is empty.
            assert!(e0 - s0 < SLICE);
            assert_eq!((c1, s1), (b, e0 + YIELD));
        }
    }
    // Every kernel of A waited for B's slice (less what B had run when it came).
    let ivs = gpu.intervals(0, end);
    let waits: Vec<Nanos> = (hosts[0].launched.iter())
        .filter_map(|&(at, tag)| {
            let iv = ivs.iter().find(|iv| iv.tag == tag)?;
            Some(iv.start - (at + KERNEL_LATENCY))
        })
        .collect();
    assert!(waits.len() as u64 >= end / (300 * US) - 10);
    let max = *waits.iter().max().unwrap();
    let mean = waits.iter().sum::<Nanos>() / waits.len() as Nanos;
    // Kernels that came while A waited also wait for the ones ahead (at most 7 of them).
    assert!(max <= SLICE + SWITCH + 7 * 50 * US, "{max}");
    assert!(mean > SLICE / 3, "{mean}");
    // A got all it asked for; B the rest, less the switches.
    let got_a = gpu.busy_ns(a, 0, end);
    assert!(got_a >= waits.len() as u64 * 50 * US);
    let got_b = gpu.busy_ns(b, 0, end);
    assert!(got_a + got_b + gpu.switch_dead_ns() >= end - SLICE);
}

fn mixed_run(renewal: SliceRenewal) -> (Vec<Interval>, u64, u64, Vec<Option<Nanos>>) {
    let gpu = with(|p| p.renewal = renewal);
    let programs = [
        Program::Deep {
            dur: 20 * US,
            depth: 64,
            tag: 1,
        },
        Program::LaunchBound {
            dur: 50 * US,
            period: 310 * US,
            tag: 100,
        },
        Program::Deep {
            dur: 5 * MS,
            depth: 2,
            tag: 3,
        },
    ];
    let mut hosts: Vec<Host> = programs.iter().map(|&p| Host::new(&gpu, p)).collect();
    let mut markers = Vec::new();
    for k in 0..20 {
        drive(&gpu, &mut hosts, k * 10 * MS + 7 * US);
        markers.push(gpu.record_marker(hosts[0].ctx, 1, gpu.now()));
    }
    drive(&gpu, &mut hosts, 300 * MS);
    let done = markers.iter().map(|&m| gpu.marker_done(m)).collect();
    (
        gpu.intervals(0, 300 * MS),
        gpu.switches(),
        gpu.preemptions(),
        done,
    )
}

#[test]
fn the_same_inputs_give_the_same_run() {
    for renewal in [SliceRenewal::Periodic, SliceRenewal::Exhausted] {
        let first = mixed_run(renewal);
        assert!(first.0.len() > 100 && first.3.iter().all(Option::is_some));
        assert_eq!(first, mixed_run(renewal));
    }
}

#[test]
fn empty_queues_and_idle_gpus_are_fine() {
    let gpu = h200();
    assert_eq!(gpu.next_event(), None);
    gpu.advance_to(MS);
    gpu.advance_to(MS);
    assert_eq!(gpu.device_busy_ns(0, MS), 0);
    let a = gpu.add_context();
    assert!(gpu.context_idle(a) && gpu.stream_idle(a, 5));
    assert_eq!(gpu.queued(a, 5), 0);
    assert_eq!(gpu.next_event(), None);
    // A zero-length kernel and a marker, then nothing.
    gpu.submit_kernel(a, 1, 2 * MS, 0, 1);
    let m = gpu.record_marker(a, 1, 2 * MS);
    assert_eq!(gpu.next_event(), Some(2 * MS + KERNEL_LATENCY));
    gpu.advance_to(3 * MS);
    assert_eq!(gpu.marker_done(m), Some(2 * MS + KERNEL_LATENCY));
    assert_eq!(gpu.next_event(), None);
    assert_eq!(gpu.busy_ns(a, 0, 3 * MS), 0);
    assert!(gpu.intervals(0, 3 * MS).is_empty());
    assert_eq!(gpu.switches(), 0);
}

#[test]
fn free_switches_and_instant_visibility_still_alternate_and_terminate() {
    let gpu = with(|p| {
        (p.switch_cost, p.yield_cost) = (0, 0);
        (p.kernel_latency, p.marker_latency) = (0, 0);
    });
    let (a, b) = (gpu.add_context(), gpu.add_context());
    queue(&gpu, a, 0, 100, 50 * US, 1);
    let m = gpu.record_marker(a, 1, 0);
    queue(&gpu, b, 0, 100, 50 * US, 2);
    gpu.submit_kernel(b, 1, 0, 0, 2);
    gpu.advance_to(20 * MS);
    // 10 ms of work, no dead time: slices tile the GPU (A, B, A, B, then A's and B's last
    // 0.82 ms each) until both are done.
    assert_eq!(gpu.device_busy_ns(0, 20 * MS), 10 * MS);
    let t = turns(&gpu, 0, 20 * MS);
    assert_eq!(
        (t.len(), t[0].2 - t[0].1, t.last().unwrap().2),
        (6, SLICE, 10 * MS)
    );
    assert_eq!(
        gpu.marker_done(m),
        Some(t.iter().rfind(|t| t.0 == a).unwrap().2)
    );
    assert!(gpu.context_idle(a) && gpu.context_idle(b));
    assert_eq!(gpu.next_event(), None);
}

#[test]
fn markers_released_early_still_take_their_place_and_slots_are_reused() {
    let gpu = h200();
    let a = gpu.add_context();
    gpu.submit_kernel(a, 1, 0, MS, 1);
    let pending = gpu.record_marker(a, 1, 0);
    gpu.release_marker(pending);
    let after = gpu.record_marker(a, 1, 0);
    assert_eq!(gpu.live_markers(), 1);
    assert_eq!(gpu.queued(a, 1), 3);
    gpu.advance_to(2 * MS);
    assert_eq!(gpu.marker_done(after), Some(KERNEL_LATENCY + MS));
    gpu.release_marker(after);
    assert_eq!(gpu.live_markers(), 0);
    // Both slots are free again: no new ones for the next two.
    let (x, y) = (
        gpu.record_marker(a, 1, 2 * MS),
        gpu.record_marker(a, 1, 2 * MS),
    );
    assert_eq!(gpu.0.borrow().markers.len(), 2);
    assert!(x != pending && y != pending && x != after && y != after);
}

#[test]
#[should_panic(expected = "use of a released marker")]
fn a_stale_marker_id_is_refused() {
    let gpu = h200();
    let a = gpu.add_context();
    let m = gpu.record_marker(a, 1, 0);
    gpu.advance_to(MS);
    gpu.release_marker(m);
    let _reuses_the_slot = gpu.record_marker(a, 1, MS);
    gpu.marker_done(m);
}

#[test]
#[should_panic(expected = "use of a released marker")]
fn a_marker_released_before_completion_cannot_be_asked() {
    let gpu = h200();
    let a = gpu.add_context();
    gpu.submit_kernel(a, 1, 0, MS, 1);
    let m = gpu.record_marker(a, 1, 0);
    gpu.release_marker(m);
    gpu.marker_done(m);
}

#[test]
#[should_panic(expected = "use of a released marker")]
fn a_marker_is_released_once() {
    let gpu = h200();
    let a = gpu.add_context();
    let m = gpu.record_marker(a, 1, 0);
    gpu.release_marker(m);
    gpu.release_marker(m);
}

#[test]
#[should_panic(expected = "GPU time runs forward")]
fn time_does_not_run_backwards() {
    let gpu = h200();
    gpu.advance_to(MS);
    gpu.advance_to(MS - 1);
}

#[test]
fn ten_seconds_of_two_deep_contexts_stay_compact() {
    // The speed figure (release build) is in the report; here: the work per event and the
    // memory stay small, and the split is right over a long run.
    let gpu = h200();
    let deep = |tag| Program::Deep {
        dur: 20 * US,
        depth: 64,
        tag,
    };
    let mut hosts = [Host::new(&gpu, deep(1)), Host::new(&gpu, deep(2))];
    let end = 10 * S;
    drive(&gpu, &mut hosts, end);
    let half = end as f64 * SLICE as f64 / (2 * (SLICE + SWITCH)) as f64;
    for h in &hosts {
        let got = gpu.busy_ns(h.ctx, 0, end) as f64;
        assert!((got / half - 1.0).abs() < 0.001, "{got} vs {half}");
    }
    let slices = end / (SLICE + SWITCH);
    assert!(gpu.intervals_kept() as u64 <= slices + 1);
    assert_eq!(gpu.preemptions() + 1, gpu.intervals_kept() as u64);
}

/// One second of a launch-bound and a deep context, keeping 50 ms of history.
fn bounded_history_run() -> SlicedGpu {
    let gpu = with(|p| p.history = 50 * MS);
    let bound = Program::LaunchBound {
        dur: 50 * US,
        period: 300 * US,
        tag: 10,
    };
    let deep = Program::Deep {
        dur: 20 * US,
        depth: 64,
        tag: 2,
    };
    let mut hosts = [Host::new(&gpu, bound), Host::new(&gpu, deep)];
    drive(&gpu, &mut hosts, S);
    gpu
}

#[test]
fn history_is_bounded_when_asked() {
    let gpu = bounded_history_run();
    // About 50 ms of intervals: A's kernels one each, B one per slice.
    assert!(gpu.intervals_kept() < 400, "{}", gpu.intervals_kept());
    assert!(gpu.device_busy_ns(S - 50 * MS, S) > 40 * MS);
}

#[test]
#[should_panic(expected = "before the kept history")]
fn a_window_older_than_the_history_is_refused() {
    bounded_history_run().device_busy_ns(0, S);
}

#[test]
fn the_limiters_timer_counts_another_contexts_slice_as_its_own_span() {
    let gpu = h200();
    let clock = SimClock::default();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    let mut timer = SlicedTimer {
        gpu: gpu.clone(),
        clock: clock.clone(),
        ctx: b,
        gates: Vec::new(),
    };
    let start = timer.record(1, MarkerKind::Timed).unwrap();
    queue(&gpu, b, 0, 200, 20 * US, 2);
    let end = timer.record(1, MarkerKind::Timed).unwrap();
    gpu.submit_kernel(a, 1, 500 * US, MS, 1);
    clock.set(MS);
    assert!(timer.is_complete(start).unwrap());
    assert!(!timer.is_complete(end).unwrap());
    clock.set(5 * MS);
    assert!(!timer.is_complete(end).unwrap());
    clock.set(6 * MS);
    assert!(timer.is_complete(end).unwrap());
    // B's 4 ms, A's 1 ms slice and both switches, and the start marker's lead (the host
    // recorded it before the first launch).
    let span = timer.elapsed(start, end).unwrap();
    let lead = MARKER_HOST + KERNEL_LATENCY - MARKER_LATENCY;
    assert_eq!(span, 4 * MS + SWITCH + MS + YIELD + lead);
    assert_eq!(gpu.busy_ns(b, 0, 6 * MS), 4 * MS);
    timer.release(start);
    timer.release(end);
    assert_eq!(gpu.live_markers(), 0);
}

/// A bracket around one 50 µs kernel of context A on an idle stream, with B's deep queue
/// arriving during A's launch call (`gated`: behind a gate opened once the end marker is
/// queued). Returns the bracket's span.
fn bracket_beside_a_newcomer(gated: bool) -> Nanos {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    let gate = gated.then(|| gpu.gate(a, 1, 0));
    let start = gpu.record_marker(a, 1, 0);
    // The launch call returns once its doorbell is rung: the markers' and gate's host time,
    // then the call.
    let host = gpu.submit_kernel(a, 1, 0, 50 * US, 1);
    let returned = host + KERNEL_LATENCY;
    queue(&gpu, b, 2 * US, 10, MS, 2);
    let end = gpu.record_marker(a, 1, returned);
    if let Some(g) = gate {
        gpu.open_gate(g, returned);
    }
    gpu.advance_to(20 * MS);
    gpu.marker_done(end).unwrap() - gpu.marker_done(start).unwrap()
}

#[test]
fn a_bracket_opened_on_an_idle_stream_holds_a_newcomers_slice_and_a_gated_one_does_not() {
    // The H200 (sample_probe.sh, docs/runs/2026-12-02-compute18/sample-probe/): beside a
    // launch-bound neighbour, 5 µs kernels bracketed on an idle stream measured up to 1.56 ms
    // (the GPU ran the start marker, found the stream dry during the launch call and gave the
    // neighbour a slice); behind a gate, 7.7–8.3 µs, as queued behind other work.
    let open = bracket_beside_a_newcomer(false);
    assert!(open > SLICE, "open bracket {open} ns");
    assert_eq!(bracket_beside_a_newcomer(true), 50 * US);
}

#[test]
fn a_gate_holds_its_stream_and_the_context_yields_meanwhile() {
    let gpu = h200();
    let (a, b) = (gpu.add_context(), gpu.add_context());
    let g = gpu.gate(a, 1, 0);
    let m = gpu.record_marker(a, 1, 0);
    gpu.submit_kernel(a, 1, 0, 100 * US, 1);
    gpu.submit_kernel(b, 1, 0, 100 * US, 2);
    gpu.advance_to(MS);
    assert_eq!(gpu.marker_done(m), None, "held behind the gate");
    assert_eq!(gpu.busy_ns(a, 0, MS), 0);
    assert_eq!(
        gpu.busy_ns(b, 0, MS),
        100 * US,
        "the other context ran meanwhile"
    );
    gpu.open_gate(g, MS);
    gpu.open_gate(g, MS);
    gpu.advance_to(2 * MS);
    assert_eq!(gpu.marker_done(m), Some(MS + MARKER_LATENCY + YIELD));
    assert_eq!(gpu.busy_ns(a, 0, 2 * MS), 100 * US);
}
