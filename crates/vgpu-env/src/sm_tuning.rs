//! The SM limiter's tuning: accuracy, not enforcement, so bad values are warnings.

use crate::names::DEFAULT_TURN_DIR;

/// Tuning of the SM limiter (accuracy, not enforcement: bad values are warnings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmTuning {
    /// NVML-based contention correction ([`ENV_SM_CONTENTION`](crate::ENV_SM_CONTENTION), default off).
    pub contention_correction: bool,
    /// Turn board directory ([`ENV_TURN_DIR`](crate::ENV_TURN_DIR)); `None` = no turns.
    pub turn_dir: Option<String>,
    /// Shortest turn cycle in milliseconds ([`ENV_TURN_CYCLE_MS`](crate::ENV_TURN_CYCLE_MS), 1..=1000, default 20).
    pub turn_cycle_ms: u64,
    /// Lead-in in microseconds ([`ENV_TURN_LEAD_US`](crate::ENV_TURN_LEAD_US), 0..=10000, default 0).
    pub turn_lead_us: u64,
    /// Share mode's idle grace, us ([`ENV_SHARE_GRACE_US`](crate::ENV_SHARE_GRACE_US),
    /// 50..=20000; `None`: the limiter's default).
    pub share_grace_us: Option<u64>,
    /// Share mode's queue while outranked, us
    /// ([`ENV_SHARE_OUTRANKED_QUEUE_US`](crate::ENV_SHARE_OUTRANKED_QUEUE_US), 10..=10000;
    /// `None`: the limiter's default).
    pub share_outranked_queue_us: Option<u64>,
    /// Share mode's gap-filling queue, us ([`ENV_SHARE_GAP_FILL_US`](crate::ENV_SHARE_GAP_FILL_US),
    /// 0..=10000, 0 = none; `None`: the limiter's default).
    pub share_gap_fill_us: Option<u64>,
    /// Timer slack of the launch path's waits, us ([`ENV_WAKE_SLACK_US`](crate::ENV_WAKE_SLACK_US),
    /// 0..=1000; `None`: the hook's default).
    pub wake_slack_us: Option<u64>,
    /// The power-share exponent in hundredths ([`ENV_SM_POWER_EXPONENT`](crate::ENV_SM_POWER_EXPONENT), 0..=100,
    /// default 50; 0 = limit time only).
    pub power_exponent_pct: u32,
}

impl SmTuning {
    /// The turn board directory for a value of [`ENV_TURN_DIR`](crate::ENV_TURN_DIR) (`None`: unset, giving
    /// [`DEFAULT_TURN_DIR`]); `off`, `0` or empty: no turns.
    pub fn turn_dir_of(value: Option<&str>) -> Option<String> {
        let Some(v) = value else {
            return Some(DEFAULT_TURN_DIR.to_owned());
        };
        let t = v.trim();
        (!(t.is_empty() || t == "0" || t.eq_ignore_ascii_case("off"))).then(|| t.to_owned())
    }

    /// The power-share exponent in hundredths for a value of [`ENV_SM_POWER_EXPONENT`](crate::ENV_SM_POWER_EXPONENT):
    /// `0` to `1` with at most two decimals (`0.5`, `.25`, `1.0`), or `off` (0). `None` when
    /// malformed or out of range.
    pub fn power_exponent_of(value: &str) -> Option<u32> {
        let t = value.trim();
        if t.eq_ignore_ascii_case("off") {
            return Some(0);
        }
        let (int, frac) = t.split_once('.').unwrap_or((t, ""));
        if (int.is_empty() && frac.is_empty())
            || frac.len() > 2
            || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let int: u32 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let frac: u32 = match frac.len() {
            0 => 0,
            1 => frac.parse::<u32>().ok()? * 10,
            _ => frac.parse().ok()?,
        };
        let pct = int.checked_mul(100)?.checked_add(frac)?;
        (pct <= 100).then_some(pct)
    }
}

impl Default for SmTuning {
    fn default() -> Self {
        Self {
            contention_correction: false,
            turn_dir: Some(DEFAULT_TURN_DIR.to_owned()),
            turn_cycle_ms: 20,
            turn_lead_us: 0,
            share_grace_us: None,
            share_outranked_queue_us: None,
            share_gap_fill_us: None,
            wake_slack_us: None,
            power_exponent_pct: 50,
        }
    }
}
