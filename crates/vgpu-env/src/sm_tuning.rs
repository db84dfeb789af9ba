//! Where the SM limiter's containers meet: the turn board's directory.

use crate::names::DEFAULT_TURN_DIR;

/// Settings of the SM limiter beyond the limit itself (where the board lives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmTuning {
    /// Turn board directory ([`ENV_TURN_DIR`](crate::ENV_TURN_DIR)); `None` = no board.
    pub turn_dir: Option<String>,
}

impl SmTuning {
    /// The turn board directory for a value of [`ENV_TURN_DIR`](crate::ENV_TURN_DIR) (`None`: unset, giving
    /// [`DEFAULT_TURN_DIR`]); `off`, `0` or empty: no board.
    pub fn turn_dir_of(value: Option<&str>) -> Option<String> {
        let Some(v) = value else {
            return Some(DEFAULT_TURN_DIR.to_owned());
        };
        let t = v.trim();
        (!(t.is_empty() || t == "0" || t.eq_ignore_ascii_case("off"))).then(|| t.to_owned())
    }
}

impl Default for SmTuning {
    fn default() -> Self {
        Self {
            turn_dir: Some(DEFAULT_TURN_DIR.to_owned()),
        }
    }
}
