//! Limit flags (`--memory [DEVICE=]SIZE`, `--sm [DEVICE=]PERCENT`) and the HAMi environment
//! variables they become. Values are checked with vgpu-env's parser, the one the hook
//! uses, and written back in canonical form (bytes, whole percent) so that any reader of the
//! environment, HAMi-core included, understands them the same way.

use std::collections::BTreeMap;

use vgpu_alloc_core::MAX_DEVICES;
use vgpu_env::{self as config, Config};

/// One `--memory` flag: a size for every device or for one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryFlag {
    /// `None` = the default for every device.
    pub device: Option<u32>,
    /// Bytes; 0 = unlimited.
    pub bytes: u64,
}

/// One `--sm` flag: a percentage for every device or for one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmFlag {
    /// `None` = the default for every device.
    pub device: Option<u32>,
    /// 1..=99, `None` = unlimited (0 or 100 written).
    pub percent: Option<u8>,
}

fn split_device(text: &str) -> Result<(Option<u32>, &str), String> {
    match text.split_once('=') {
        None => Ok((None, text)),
        Some((dev, value)) => {
            let dev = dev.trim();
            let index: u32 = dev
                .parse()
                .ok()
                .filter(|_| !dev.starts_with('+'))
                .ok_or_else(|| {
                    format!("device `{dev}` is not a device index (0..{MAX_DEVICES})")
                })?;
            if index as usize >= MAX_DEVICES {
                return Err(format!("device {index} is out of range (0..{MAX_DEVICES})"));
            }
            Ok((Some(index), value))
        }
    }
}

/// Parse a size with vgpu-env's parser; the message says what is expected.
pub fn parse_memory_value(text: &str) -> Result<u64, String> {
    config::parse_size(text).map_err(|e| format!("`{text}` is not a size: {e}"))
}

/// Like [`parse_memory_value`], but 0 is refused (where "unlimited" makes no sense).
pub fn parse_nonzero_memory_value(text: &str) -> Result<u64, String> {
    match parse_memory_value(text)? {
        0 => Err("must be more than 0 bytes".into()),
        n => Ok(n),
    }
}

/// Parse a percentage with vgpu-env's parser: 0..=100; unlimited (0 or 100) comes back as 0.
pub fn parse_sm_value(text: &str) -> Result<u8, String> {
    let percent = config::parse_percent(text)
        .map_err(|reason| format!("`{text}` is not a percentage: {reason}"))?;
    Ok(percent.unwrap_or(0))
}

impl MemoryFlag {
    /// Parse `SIZE` or `DEVICE=SIZE`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (device, value) = split_device(text)?;
        Ok(Self {
            device,
            bytes: parse_memory_value(value)?,
        })
    }
}

impl SmFlag {
    /// Parse `PERCENT` or `DEVICE=PERCENT`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (device, value) = split_device(text)?;
        let p = parse_sm_value(value)?;
        Ok(Self {
            device,
            percent: (p != 0).then_some(p),
        })
    }
}

fn var_name(base: &str, device: Option<u32>) -> String {
    match device {
        None => base.to_owned(),
        Some(i) => format!("{base}_{i}"),
    }
}

/// The environment variables the flags stand for, checked for duplicates and re-validated
/// as a whole with vgpu-env's `Config` (so the hook is guaranteed to accept them).
pub fn limit_env(memory: &[MemoryFlag], sm: &[SmFlag]) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for m in memory {
        let name = var_name(config::ENV_MEMORY_LIMIT, m.device);
        if env.insert(name, m.bytes.to_string()).is_some() {
            return Err(duplicate("--memory", m.device));
        }
    }
    for s in sm {
        let name = var_name(config::ENV_SM_LIMIT, s.device);
        if env
            .insert(name, s.percent.unwrap_or(0).to_string())
            .is_some()
        {
            return Err(duplicate("--sm", s.device));
        }
    }
    Config::from_pairs(env.iter().map(|(k, v)| (k.clone(), v.clone())))
        .map_err(|e| format!("the limits do not form a valid configuration: {e}"))?;
    Ok(env)
}

fn duplicate(flag: &str, device: Option<u32>) -> String {
    match device {
        None => format!("{flag} without a device is given more than once"),
        Some(i) => format!("{flag} is given more than once for device {i}"),
    }
}

/// Whether `name` is one of the variables a kind of flag replaces
/// (`CUDA_DEVICE_MEMORY_LIMIT` and `CUDA_DEVICE_MEMORY_LIMIT_<i>`, same for SM).
pub fn is_limit_var(base: &str, name: &str) -> bool {
    match name.strip_prefix(base) {
        Some("") => true,
        Some(rest) => rest
            .strip_prefix('_')
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn memory_flags_parse_default_and_per_device() {
        assert_eq!(
            MemoryFlag::parse("4g"),
            Ok(MemoryFlag {
                device: None,
                bytes: 4 * GIB
            })
        );
        assert_eq!(
            MemoryFlag::parse("1=1.5g"),
            Ok(MemoryFlag {
                device: Some(1),
                bytes: 3 * GIB / 2
            })
        );
        assert_eq!(
            MemoryFlag::parse("15=512Mi"),
            Ok(MemoryFlag {
                device: Some(15),
                bytes: 512 << 20
            })
        );
        assert!(
            MemoryFlag::parse("16=1g")
                .unwrap_err()
                .contains("out of range")
        );
        assert!(
            MemoryFlag::parse("x=1g")
                .unwrap_err()
                .contains("not a device index")
        );
        assert!(MemoryFlag::parse("4x").unwrap_err().contains("not a size"));
        assert!(MemoryFlag::parse("0x10").is_err());
        assert!(MemoryFlag::parse("").is_err());
    }

    #[test]
    fn sm_flags_parse_with_unlimited_as_none() {
        assert_eq!(
            SmFlag::parse("50"),
            Ok(SmFlag {
                device: None,
                percent: Some(50)
            })
        );
        assert_eq!(
            SmFlag::parse("2=30"),
            Ok(SmFlag {
                device: Some(2),
                percent: Some(30)
            })
        );
        assert_eq!(
            SmFlag::parse("100"),
            Ok(SmFlag {
                device: None,
                percent: None
            })
        );
        assert_eq!(
            SmFlag::parse("0"),
            Ok(SmFlag {
                device: None,
                percent: None
            })
        );
        assert!(SmFlag::parse("101").unwrap_err().contains("percentage"));
        assert!(SmFlag::parse("50g").is_err());
        assert!(SmFlag::parse("-1").is_err());
    }

    #[test]
    fn env_is_canonical_and_rejects_duplicates() {
        let env = limit_env(
            &[
                MemoryFlag::parse("4g").unwrap(),
                MemoryFlag::parse("1=1.5g").unwrap(),
            ],
            &[
                SmFlag::parse("50").unwrap(),
                SmFlag::parse("3=100").unwrap(),
            ],
        )
        .unwrap();
        let got: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("CUDA_DEVICE_MEMORY_LIMIT", "4294967296"),
                ("CUDA_DEVICE_MEMORY_LIMIT_1", "1610612736"),
                ("CUDA_DEVICE_SM_LIMIT", "50"),
                ("CUDA_DEVICE_SM_LIMIT_3", "0"),
            ]
        );
        let err = limit_env(
            &[
                MemoryFlag::parse("1=1g").unwrap(),
                MemoryFlag::parse("1=2g").unwrap(),
            ],
            &[],
        )
        .unwrap_err();
        assert!(err.contains("more than once for device 1"), "{err}");
        assert!(
            limit_env(
                &[],
                &[SmFlag::parse("5").unwrap(), SmFlag::parse("6").unwrap()]
            )
            .is_err()
        );
    }

    #[test]
    fn limit_vars_are_recognised() {
        assert!(is_limit_var(
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMIT"
        ));
        assert!(is_limit_var(
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMIT_12"
        ));
        assert!(!is_limit_var(
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMIT_"
        ));
        assert!(!is_limit_var(
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMITX"
        ));
        assert!(!is_limit_var(
            "CUDA_DEVICE_SM_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMIT"
        ));
    }
}
