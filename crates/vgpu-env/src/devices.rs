//! Which device a per-device variable names, and what the plugin that set it means by it.
//!
//! A per-device variable names its device in one of two ways:
//! - `<BASE>_<i>`: the container's GPU i, 0..=15 in plain decimal: NVML's device i, which
//!   is CUDA's ordinal i in a process that narrows nothing (HAMi's grammar, the only one
//!   HAMi-core reads);
//! - `<BASE>_GPU_<uuid>`: a GPU by its UUID as NVML prints it
//!   (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, hex in either case) with each `-` written
//!   `_`, or as printed (`<BASE>_GPU-<uuid>`). vgpu's own form, for the places where an index
//!   does not say which GPU is meant. The `_` spelling is a shell identifier: dash (`sh` on
//!   Debian and Ubuntu) silently drops variables whose names hold `-` from the environment it
//!   passes on, so `sh -c` anywhere in a container's start would lose the other spelling.
//!
//! Whether `<i>` really is the container's GPU i depends on who wrote it, and the one trace of that
//! in a container's environment is where its shared file lives ([`Layout`], from
//! `CUDA_DEVICE_MEMORY_SHARED_CACHE`): each plugin puts it in a path of its own shape.

/// How a per-device variable names its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKey {
    /// `_<i>`: the container's GPU i (under [`Layout::indices_are_ordinals`]).
    Index(usize),
    /// `_GPU-<uuid>`: a GPU UUID, lowercase as NVML prints it.
    Uuid(String),
}

/// The key of a per-device variable's suffix (what follows `<BASE>_`), or why it is not one.
/// Indices are 0..=`last` in plain decimal (HAMi-core reads exactly those names and ignores
/// any other, so `_16` or `_00` would silently limit nothing there; here they are errors).
pub fn device_key(suffix: &str, last: usize) -> Result<DeviceKey, String> {
    if let Some(hex) = suffix
        .strip_prefix("GPU_")
        .or_else(|| suffix.strip_prefix("GPU-"))
    {
        return gpu_uuid(&hex.replace('_', "-"))
            .map(DeviceKey::Uuid)
            .ok_or_else(|| {
                "a device named by UUID must be GPU_xxxxxxxx_xxxx_xxxx_xxxx_xxxxxxxxxxxx (the \
                 UUID nvidia-smi -L prints, hex digits, each - written _) or \
                 GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
                    .to_owned()
            });
    }
    if suffix.is_empty() || !suffix.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "not a per-device variable: the suffix must be a device index 0..={last} or a GPU \
             UUID (GPU_xxxxxxxx_xxxx_xxxx_xxxx_xxxxxxxxxxxx)"
        ));
    }
    match suffix.parse::<usize>() {
        Ok(i) if i <= last && suffix == i.to_string() => Ok(DeviceKey::Index(i)),
        Ok(i) if i <= last => Err(format!(
            "write the device index without leading zeros (_{i}), the name HAMi-core reads"
        )),
        _ => Err(format!(
            "device index {suffix} is out of range: per-device variables name CUDA devices 0..={last}"
        )),
    }
}

/// `GPU-` and the lowercase form of `hex` when it is 8-4-4-4-12 hex digits.
fn gpu_uuid(hex: &str) -> Option<String> {
    let groups: Vec<&str> = hex.split('-').collect();
    let shape_ok = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()));
    shape_ok.then(|| format!("GPU-{}", hex.to_ascii_lowercase()))
}

/// Whether `a` and `b` name the same GPU (NVML's UUIDs are lowercase; a hand-written one may
/// not be).
pub fn same_uuid(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

/// Which plugin made this container, as far as the path of its shared file tells (the path
/// as the container sees it). Each writes that path in a shape of its own:
///
/// | layout | `CUDA_DEVICE_MEMORY_SHARED_CACHE` |
/// |---|---|
/// | HAMi's device plugin | `/usr/local/vgpu/<uuid>.cache` |
/// | Volcano's vgpu device plugin | `/tmp/vgpu/<uuid>.cache` |
/// | HAMi's DRA driver | `<hook>/vgpu/claims/<claim UID>/<uuid>.cache` |
/// | HAMi's DRA driver, PR #42 | `<hook>/vgpu/containers/<pod UID>_<container>/<claim UID>.cache` |
///
/// (`<hook>` is `/usr/local` unless the driver's `HOOK_PATH` says otherwise.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Layout {
    /// Any other path (a workstation, `vgpu run`): HAMi's meanings.
    #[default]
    Plain,
    /// HAMi's device plugin.
    HamiDevicePlugin,
    /// Volcano's vgpu device plugin.
    Volcano,
    /// HAMi's DRA driver, one directory per claim.
    HamiDraClaim,
    /// HAMi's DRA driver with the per-container directory (its PR #42).
    HamiDraContainer,
}

impl Layout {
    /// The layout a shared-file path belongs to.
    pub fn of_shared_cache(path: &str) -> Self {
        let parts: Vec<&str> = path.split('/').collect();
        let n = parts.len();
        let at = |back: usize| n.checked_sub(back).map_or("", |i| parts[i]);
        let file_ok = !at(1).is_empty();
        if !file_ok {
            return Self::Plain;
        }
        match (at(4), at(3), at(2)) {
            ("vgpu", "claims", claim) if !claim.is_empty() => return Self::HamiDraClaim,
            ("vgpu", "containers", dir)
                if dir
                    .split_once('_')
                    .is_some_and(|(p, c)| !p.is_empty() && !c.is_empty()) =>
            {
                return Self::HamiDraContainer;
            }
            _ => {}
        }
        let parent = &path[..path.len() - at(1).len()];
        match parent {
            "/usr/local/vgpu/" => Self::HamiDevicePlugin,
            "/tmp/vgpu/" => Self::Volcano,
            _ => Self::Plain,
        }
    }

    /// Whether `_<i>` names the container's GPU `i`. Not under HAMi's DRA driver: it numbers a
    /// claim's devices in the order it iterates a Go map, which is random, so `_0` is one of
    /// the claim's GPUs, not necessarily the container's first.
    pub fn indices_are_ordinals(self) -> bool {
        !matches!(self, Self::HamiDraClaim | Self::HamiDraContainer)
    }

    /// Whether `CUDA_OVERSUBSCRIBE=true` says that memory limits may add up past the GPU
    /// (HAMi's device plugin sets it for `deviceMemoryScaling > 1`). Not under Volcano's
    /// plugin: it sets the variable for `deviceCoreScaling > 1`, a statement about compute.
    pub fn oversubscribe_means_memory(self) -> bool {
        self != Self::Volcano
    }

    /// The plugin, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Plain => "no device plugin's layout",
            Self::HamiDevicePlugin => "HAMi's device plugin",
            Self::Volcano => "Volcano's vgpu device plugin",
            Self::HamiDraClaim => "HAMi's DRA driver (claim directory)",
            Self::HamiDraContainer => "HAMi's DRA driver (container directory)",
        }
    }
}

/// The smallest of some limits where `None` is unlimited (the largest); `None` when there are
/// none or all are unlimited.
pub fn smallest<T: Ord + Copy>(limits: impl IntoIterator<Item = Option<T>>) -> Option<T> {
    limits.into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: &str = "GPU-5a1e5130-0000-4000-8000-0000000c0de0";

    #[test]
    fn keys_are_ordinals_or_uuids() {
        assert_eq!(device_key("0", 15), Ok(DeviceKey::Index(0)));
        assert_eq!(device_key("15", 15), Ok(DeviceKey::Index(15)));
        assert!(device_key(&U[4..], 15).unwrap_err().contains("suffix"));
        for spelling in [
            "GPU-5A1E5130-0000-4000-8000-0000000C0DE0",
            "GPU_5a1e5130_0000_4000_8000_0000000c0de0",
        ] {
            assert_eq!(
                device_key(spelling, 15),
                Ok(DeviceKey::Uuid(U.to_owned())),
                "{spelling}"
            );
        }
        for bad in [
            "GPU-",
            "GPU-5a1e5130",
            "GPU-5a1e5130-0000-4000-8000-0000000c0de",
            "GPU-5a1e5130-0000-4000-8000-0000000c0de00",
            "GPU-5a1e513g-0000-4000-8000-0000000c0de0",
            "GPU-5a1e5130-0000-4000-8000-0000000c0de0-1",
            "MIG-5a1e5130-0000-4000-8000-0000000c0de0",
            "gpu-5a1e5130-0000-4000-8000-0000000c0de0",
            "GPU_5a1e5130_0000_4000_8000_0000000c0de0_",
            "GPU__5a1e5130_0000_4000_8000_0000000c0de0",
        ] {
            assert!(device_key(bad, 15).is_err(), "{bad}");
        }
        assert!(device_key("16", 15).unwrap_err().contains("out of range"));
        assert!(device_key("01", 15).unwrap_err().contains("leading zeros"));
        assert!(same_uuid(U, &U.to_ascii_uppercase()));
    }

    #[test]
    fn layouts_are_told_apart_by_the_shared_file_path() {
        let claim = "0c3f5b1e-8d6a-4f7e-9a51-2d3c4b5a6f70";
        for (path, want) in [
            ("/usr/local/vgpu/1f0e.cache", Layout::HamiDevicePlugin),
            ("/tmp/vgpu/1f0e.cache", Layout::Volcano),
            (
                &format!("/usr/local/vgpu/claims/{claim}/1f0e.cache") as &str,
                Layout::HamiDraClaim,
            ),
            (
                &format!("/opt/hook/vgpu/claims/{claim}/1f0e.cache"),
                Layout::HamiDraClaim,
            ),
            (
                &format!("/usr/local/vgpu/containers/9b1d_main/{claim}.cache"),
                Layout::HamiDraContainer,
            ),
            ("/tmp/cudevshr.cache", Layout::Plain),
            ("/usr/local/vgpu/sub/x.cache", Layout::Plain),
            (
                "/usr/local/vgpu/containers/nounderscore/x.cache",
                Layout::Plain,
            ),
            ("/usr/local/vgpu/claims/x/", Layout::Plain),
            ("/tmp/vgpu/", Layout::Plain),
            ("", Layout::Plain),
            ("x.cache", Layout::Plain),
        ] {
            assert_eq!(Layout::of_shared_cache(path), want, "{path}");
        }
        assert!(!Layout::HamiDraClaim.indices_are_ordinals());
        assert!(!Layout::HamiDraContainer.indices_are_ordinals());
        assert!(Layout::Volcano.indices_are_ordinals());
        assert!(!Layout::Volcano.oversubscribe_means_memory());
        assert!(Layout::HamiDevicePlugin.oversubscribe_means_memory());
    }

    #[test]
    fn smallest_treats_unlimited_as_largest() {
        assert_eq!(smallest([Some(3), None, Some(2)]), Some(2));
        assert_eq!(smallest::<u64>([None, None]), None);
        assert_eq!(smallest::<u64>([]), None);
    }
}
