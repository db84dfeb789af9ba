//! The `LIBCUDA_LOG_LEVEL` grammar, the one the hook's logger and the CLI's checks share.
//!
//! HAMi-core's scale: 0 errors, 1 warnings, 2 messages (the default), 3 info, 4 debug.
//! The value is a decimal integer in 0..=4, surrounding whitespace allowed. Anything else
//! (a word, a sign, empty, or a number above 4) is not a level: HAMi-core shows debug
//! output for any number ≥ 4, but "99" may as well be a typo for "9" or a level of another
//! tool, so rather than guess the most verbose level, vgpu reports the value once and uses
//! the default (the strict check of `vgpu run` and `vgpu doctor` refuses it).

/// The level used when `LIBCUDA_LOG_LEVEL` is unset or not a level.
pub const DEFAULT_LOG_LEVEL: u8 = 2;
/// The most verbose level (debug).
pub const MAX_LOG_LEVEL: u8 = 4;
/// Why a value was not a level (the reason in the report).
pub const LOG_LEVEL_EXPECTED: &str = "expected 0, 1, 2, 3 or 4";

/// The level `value` names, or `None` when it is not a level (see the module docs).
pub fn parse_log_level(value: &str) -> Option<u8> {
    let t = value.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse::<u8>().ok().filter(|l| *l <= MAX_LOG_LEVEL)
}

/// The level in force for an optional value: unset and invalid values give the default.
/// The caller reports an invalid value (the hook does through `Config::warnings`).
pub fn log_level_or_default(value: Option<&str>) -> u8 {
    value.and_then(parse_log_level).unwrap_or(DEFAULT_LOG_LEVEL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_0_to_4_and_nothing_else() {
        for (v, l) in [
            ("0", 0),
            ("1", 1),
            ("2", 2),
            (" 3 ", 3),
            ("4\n", 4),
            ("04", 4),
        ] {
            assert_eq!(parse_log_level(v), Some(l), "{v:?}");
        }
        for v in [
            "", " ", "5", "9", "99", "256", "-1", "+1", "1.0", "loud", "0x1", "4 4",
        ] {
            assert_eq!(parse_log_level(v), None, "{v:?}");
        }
    }

    #[test]
    fn unset_and_invalid_values_give_the_default() {
        assert_eq!(log_level_or_default(None), DEFAULT_LOG_LEVEL);
        assert_eq!(log_level_or_default(Some("99")), DEFAULT_LOG_LEVEL);
        assert_eq!(log_level_or_default(Some("loud")), DEFAULT_LOG_LEVEL);
        assert_eq!(log_level_or_default(Some("0")), 0);
        assert_eq!(log_level_or_default(Some("4")), MAX_LOG_LEVEL);
    }
}
