//! The size grammar: binary units throughout, as HAMi-core reads them: `4g`, `4G`,
//! `4GiB`, `4GB`, `4096m`, `512Mi`, `1.5g`, `1073741824`; `k`, `m`, `g`, `t` each optionally
//! followed by `i` and/or `b`, any case; surrounding whitespace is ignored. Anything else is
//! an error (HAMi-core's `strtoul` turns `1.5g` into 1 GiB and garbage into 0 = unlimited).

/// Why a size string was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Nothing but whitespace.
    #[error("empty value")]
    Empty,
    /// Not `<digits>[.<digits>][unit]`.
    #[error("expected a size such as 4g, 4096m, 512Mi, 1.5GiB or a byte count")]
    Syntax,
    /// A fraction of a byte (`1.5` with no unit).
    #[error("a fraction needs a unit (k, m, g, t)")]
    FractionalBytes,
    /// Does not fit in 64 bits.
    #[error("size overflows 64 bits")]
    Overflow,
    /// A non-zero size smaller than one byte (`0.0001k`): 0 would mean "unlimited".
    #[error("a non-zero size that rounds down to 0 bytes (0 means unlimited; write 0 for that)")]
    RoundsToZero,
}

/// Parse a size in bytes (binary units, see the module docs). The fraction of a
/// fractional size is rounded down to whole bytes (`1.3k` = 1331), but a non-zero size is
/// never rounded to 0, which would read as "unlimited" ([`SizeError::RoundsToZero`]).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(SizeError::Empty);
    }
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(num_end);
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (num, None),
    };
    if int_part.is_empty() || frac_part.is_some_and(|f| f.is_empty() || f.contains('.')) {
        return Err(SizeError::Syntax);
    }
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kb" | "kib" => 10,
        "m" | "mi" | "mb" | "mib" => 20,
        "g" | "gi" | "gb" | "gib" => 30,
        "t" | "ti" | "tb" | "tib" => 40,
        _ => return Err(SizeError::Syntax),
    };
    let int: u64 = int_part.parse().map_err(|_| SizeError::Overflow)?;
    let whole = int.checked_mul(1u64 << shift).ok_or(SizeError::Overflow)?;
    let Some(frac) = frac_part else {
        return Ok(whole);
    };
    if shift == 0 {
        return Err(SizeError::FractionalBytes);
    }
    // Exact: frac/10^len * 2^shift, rounded down. Digits past the 19th change the result
    // by less than 2^40 * 10^-19 bytes, so they are ignored (they were checked to be digits).
    let digits = &frac[..frac.len().min(19)];
    let numerator: u128 = digits.parse().map_err(|_| SizeError::Syntax)?;
    let denominator = 10u128.pow(digits.len() as u32);
    let extra = (numerator << shift) / denominator;
    // `extra` < 2^shift and `whole` is a multiple of 2^shift, so this cannot overflow
    // when `whole` did not; checked anyway.
    let bytes = whole.checked_add(extra as u64).ok_or(SizeError::Overflow)?;
    // All digits count here, also those past the 19th that the arithmetic ignored.
    if bytes == 0 && frac.bytes().any(|b| b != b'0') {
        return Err(SizeError::RoundsToZero);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn sizes_users_write_are_accepted() {
        let ok: &[(&str, u64)] = &[
            ("4g", 4 * GIB),
            ("4G", 4 * GIB),
            ("4096m", 4 * GIB),
            ("4096M", 4 * GIB),
            ("1073741824", GIB),
            ("1.5g", 3 * GIB / 2),
            ("4GiB", 4 * GIB),
            ("4gib", 4 * GIB),
            ("512Mi", 512 * MIB),
            ("4GB", 4 * GIB),
            ("4gb", 4 * GIB),
            ("  4g\t\n", 4 * GIB),
            ("0", 0),
            ("0g", 0),
            ("1k", 1024),
            ("1K", 1024),
            ("1KiB", 1024),
            ("1t", 1 << 40),
            ("1TiB", 1 << 40),
            ("10b", 10),
            ("1.3k", 1331),
            ("0.5m", MIB / 2),
            ("1.0000000000000000000000001g", GIB),
            ("18446744073709551615", u64::MAX),
            ("16777215t", 16_777_215 << 40),
            // The smallest fractions that still make a byte, and zeros written as fractions.
            ("0.0009766k", 1),
            ("0.000g", 0),
        ];
        for &(text, want) in ok {
            assert_eq!(parse_size(text), Ok(want), "{text:?}");
        }
    }

    #[test]
    fn everything_else_is_rejected() {
        use SizeError::*;
        let bad: &[(&str, SizeError)] = &[
            ("", Empty),
            ("   ", Empty),
            ("0x10", Syntax),
            ("0X10", Syntax),
            ("4gx", Syntax),
            ("4 g", Syntax),
            ("4g4", Syntax),
            ("-1", Syntax),
            ("+1", Syntax),
            ("-1g", Syntax),
            ("NaN", Syntax),
            ("inf", Syntax),
            ("1e9", Syntax),
            ("g", Syntax),
            (".5g", Syntax),
            ("1.g", Syntax),
            ("1..5g", Syntax),
            ("1.5.0g", Syntax),
            ("4p", Syntax),
            ("4gibb", Syntax),
            ("4bg", Syntax),
            ("1.5", FractionalBytes),
            ("18446744073709551616", Overflow),
            ("99999999999999999999999", Overflow),
            ("16777216t", Overflow),
            ("17179869184g", Overflow),
            ("0.0001k", RoundsToZero),
            ("0.0009765k", RoundsToZero),
            ("0.00000000000000000000001t", RoundsToZero),
        ];
        for &(text, want) in bad {
            assert_eq!(parse_size(text), Err(want), "{text:?}");
        }
    }
}
