//! The simulated power draw, for NVML's energy counter and power limit.
//!
//! A device draws `idle_w` watts while no kernel runs and `idle_w + busy_w` while one or more
//! do (so over a span, `idle_w + busy fraction × busy_w` on average). The energy counter
//! integrates that since the simulated driver started and, like the H200's, advances in
//! [`ENERGY_STEP`] steps: a read returns the energy at the last step boundary, not the
//! energy now. The simulator never slows kernels down at the limit: the limit is only
//! reported, so a test can describe a GPU whose unlimited work would exceed it.

use std::time::{Duration, Instant};

/// How often the energy counter advances (the H200's `nvmlDeviceGetTotalEnergyConsumption`
/// moves in steps of about 100 ms).
pub const ENERGY_STEP: Duration = Duration::from_millis(100);

/// The power of one simulated device, whole watts (`VGPU_SIM_POWER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PowerModel {
    /// Drawn while no kernel runs.
    pub idle_w: u32,
    /// Drawn on top of `idle_w` while a kernel runs.
    pub busy_w: u32,
    /// What `nvmlDeviceGetEnforcedPowerLimit` reports.
    pub limit_w: u32,
}

impl Default for PowerModel {
    /// Never power-capped: idle + busy stays under the limit.
    fn default() -> Self {
        Self {
            idle_w: 100,
            busy_w: 300,
            limit_w: 700,
        }
    }
}

impl PowerModel {
    /// Parses `<idle_w>,<busy_w>,<limit_w>` (whole watts, the limit above 0).
    pub fn parse(value: &str) -> Option<Self> {
        let mut watts = value.split(',').map(|w| w.trim().parse::<u32>().ok());
        let model = Self {
            idle_w: watts.next()??,
            busy_w: watts.next()??,
            limit_w: watts.next()??,
        };
        (watts.next().is_none() && model.limit_w > 0).then_some(model)
    }

    fn watts(&self, busy: bool) -> u128 {
        u128::from(self.idle_w) + if busy { u128::from(self.busy_w) } else { 0 }
    }
}

/// A device's energy since the simulated driver started. Power is constant between two
/// changes of the busy state, so the integral is brought up to date at each change and
/// each read; the energy at a step boundary crossed meanwhile is interpolated exactly.
#[derive(Debug, Clone)]
pub struct EnergyMeter {
    model: PowerModel,
    start: Instant,
    /// Up to when `energy_mj` is integrated.
    last: Instant,
    /// Whether a kernel runs since `last`.
    busy: bool,
    /// Energy from `start` to `last`, nanojoules (watts × nanoseconds: exact).
    energy_nj: u128,
    /// Energy at the latest step boundary not after `last`, nanojoules.
    reported_nj: u128,
}

impl EnergyMeter {
    /// A meter of an idle device, starting at `start`.
    pub fn new(model: PowerModel, start: Instant) -> Self {
        Self {
            model,
            start,
            last: start,
            busy: false,
            energy_nj: 0,
            reported_nj: 0,
        }
    }

    /// The device turns busy (a first kernel starts) or idle (the last one ends) at `now`.
    pub fn set_busy(&mut self, now: Instant, busy: bool) {
        self.advance(now);
        self.busy = busy;
    }

    /// The counter as NVML reports it at `now`: the energy at the last step boundary.
    pub fn reported_mj(&mut self, now: Instant) -> u64 {
        self.advance(now);
        u64::try_from(self.reported_nj / 1_000_000).unwrap_or(u64::MAX)
    }

    /// The draw now, milliwatts (`nvmlDeviceGetPowerUsage`: the simulator reports the
    /// instantaneous draw, as NVML does before Ampere; newer GPUs average over a second).
    pub fn draw_mw(&self) -> u32 {
        u32::try_from(self.model.watts(self.busy) * 1000).unwrap_or(u32::MAX)
    }

    /// The enforced power limit, milliwatts.
    pub fn limit_mw(&self) -> u32 {
        self.model.limit_w.saturating_mul(1000)
    }

    fn advance(&mut self, now: Instant) {
        if now <= self.last {
            return;
        }
        let watts = self.model.watts(self.busy);
        let since_start = now.duration_since(self.start);
        // The latest boundary not after `now`.
        let boundary =
            now - Duration::from_nanos((since_start.as_nanos() % ENERGY_STEP.as_nanos()) as u64);
        if boundary > self.last {
            self.reported_nj =
                self.energy_nj + watts * boundary.duration_since(self.last).as_nanos();
        }
        self.energy_nj += watts * now.duration_since(self.last).as_nanos();
        self.last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn power_parses_three_whole_watt_figures() {
        let m = PowerModel::parse(" 100, 900 ,500").unwrap();
        assert_eq!((m.idle_w, m.busy_w, m.limit_w), (100, 900, 500));
        for bad in [
            "",
            "100,900",
            "100,900,500,1",
            "100,900,0",
            "1.5,2,3",
            "a,b,c",
            "-1,2,3",
        ] {
            assert_eq!(PowerModel::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn energy_integrates_idle_and_busy_power_in_100ms_steps() {
        let model = PowerModel {
            idle_w: 100,
            busy_w: 900,
            limit_w: 500,
        };
        let t0 = Instant::now();
        let mut m = EnergyMeter::new(model, t0);
        assert_eq!(m.limit_mw(), 500_000);
        // Idle for 250 ms: the counter shows the first two steps (100 W × 0.2 s).
        assert_eq!(m.reported_mj(t0 + ms(250)), 20_000);
        // Busy from 250 ms to 550 ms (1000 W), idle again until 1 s.
        m.set_busy(t0 + ms(250), true);
        // At 299 ms nothing new is reported; at 300 ms: 25 J idle + 50 ms at 1000 W.
        assert_eq!(m.reported_mj(t0 + ms(299)), 20_000);
        assert_eq!(m.reported_mj(t0 + ms(300)), 75_000);
        m.set_busy(t0 + ms(550), false);
        // The 500 ms boundary, crossed while busy, is interpolated: 25 J + 250 J.
        assert_eq!(m.reported_mj(t0 + ms(599)), 275_000);
        // 1 s: 0.7 s idle (70 J) + 0.3 s busy (300 J).
        assert_eq!(m.reported_mj(t0 + ms(1_049)), 370_000);
        // A read in the past (another thread's older instant) changes nothing.
        assert_eq!(m.reported_mj(t0 + ms(10)), 370_000);
    }

    #[test]
    fn a_busy_span_across_several_steps_reports_each_boundary() {
        let t0 = Instant::now();
        let mut m = EnergyMeter::new(PowerModel::default(), t0);
        m.set_busy(t0, true);
        // 400 W: 40 J per step, whichever step the read falls in.
        for step in 1..=5u64 {
            assert_eq!(m.reported_mj(t0 + ms(step * 100 + 50)), step * 40_000);
        }
    }
}
