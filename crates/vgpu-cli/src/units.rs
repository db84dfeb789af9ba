//! Human-readable sizes and durations.

use std::time::Duration;

/// Bytes in binary units with up to two decimals: `0 B`, `512 KiB`, `1.50 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    if unit == 0 {
        return format!("{bytes} B");
    }
    let scale = 1u64 << (10 * unit);
    if bytes % scale == 0 {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        format!("{:.2} {}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

/// A size as a short `--memory` argument: `4g`, `384m`, `12k`, or bytes.
pub fn format_size_arg(bytes: u64) -> String {
    for (shift, unit) in [(40, "t"), (30, "g"), (20, "m"), (10, "k")] {
        if bytes != 0 && bytes % (1u64 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// `used` as a whole percentage of `limit`, rounded down (so a device shows 100% only when
/// it is full); `None` when unlimited. What `status` and `watch` both show.
pub fn percent_of(used: u64, limit: Option<u64>) -> Option<u64> {
    let limit = limit.filter(|&l| l > 0)?;
    Some(
        (u128::from(used) * 100 / u128::from(limit))
            .try_into()
            .unwrap_or(u64::MAX),
    )
}

/// `n` and the noun in the number it takes: `1 allocation`, `2 allocations`.
pub fn counted(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A limit for display: `unlimited` for `None`.
pub fn format_limit(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_owned(), format_bytes)
}

/// Wall-clock time `unix_secs` in the local time zone (the system's, or `$TZ`), formatted
/// by `strftime` with `format`: libc's tz database reader, rather than a second one.
pub fn format_local_time(unix_secs: i64, format: &std::ffi::CStr) -> String {
    crate::sys::local_time(unix_secs).map_or_else(
        || unix_secs.to_string(),
        |tm| crate::sys::strftime(format, &tm),
    )
}

/// RFC 3339 local time with offset, `2026-12-01T10:15:03+01:00`.
pub fn rfc3339_local(unix_secs: i64) -> String {
    let mut s = format_local_time(unix_secs, c"%Y-%m-%dT%H:%M:%S%z");
    // strftime's %z is `+0100`; RFC 3339 wants `+01:00`.
    if s.len() >= 5 && s.is_char_boundary(s.len() - 2) {
        s.insert(s.len() - 2, ':');
    }
    s
}

/// Parse `1s`, `500ms`, `2m`, `1.5s` or a number of seconds; between 10 ms and 1 hour.
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && !num.starts_with('.') && !num.ends_with('.'))
        .ok_or_else(|| format!("`{text}` is not a duration (examples: 1s, 500ms, 2m, 1.5)"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        _ => return Err(format!("`{text}`: unknown unit `{unit}` (use ms, s or m)")),
    };
    if !(0.01..=3600.0).contains(&seconds) {
        return Err(format!("`{text}` is out of range (10ms to 1 hour)"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_time_is_rfc3339_with_a_colon_in_the_offset() {
        let s = rfc3339_local(1_700_000_000);
        let b = s.as_bytes();
        assert_eq!(s.len(), 25, "{s}");
        assert_eq!((b[10], b[22]), (b'T', b':'), "{s}");
        assert!(b[19] == b'+' || b[19] == b'-', "{s}");
    }

    #[test]
    fn bytes_format() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1024), "1 KiB");
        assert_eq!(format_bytes(256 << 20), "256 MiB");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
        assert_eq!(format_bytes(u64::MAX), "16384.00 PiB");
        assert_eq!(format_limit(None), "unlimited");
        assert_eq!(format_size_arg(4 << 30), "4g");
        assert_eq!(format_size_arg(384 << 20), "384m");
        assert_eq!(format_size_arg(3 << 29), "1536m");
        assert_eq!(format_size_arg(1000), "1000");
        assert_eq!(format_size_arg(0), "0");
    }

    #[test]
    fn intervals_parse() {
        assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_interval("1.5"), Ok(Duration::from_millis(1500)));
        for bad in [
            "", "s", "1h", "0", "5ms", "2 hours", "-1s", "1.s", ".5s", "nan",
        ] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }
}
