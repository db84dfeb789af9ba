//! Finding `libvgpu.so` and the simulated driver `libvgpusim.so`.

use std::path::{Path, PathBuf};

/// File name of the hook; HAMi's monitor relies on this name.
pub const HOOK_NAME: &str = "libvgpu.so";
/// File name of the simulated driver.
pub const SIM_NAME: &str = "libvgpusim.so";
/// Where HAMi's device plugin mounts the hook.
pub const HOOK_SYSTEM_PATH: &str = "/usr/local/vgpu/libvgpu.so";
/// Environment variable naming the hook explicitly.
pub const ENV_HOOK: &str = "VGPU_LIB";
/// Environment variable naming the simulated driver explicitly.
pub const ENV_SIM: &str = "VGPU_SIM_LIB";

/// A library found on disk and how it was found (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Absolute, canonical path.
    pub path: PathBuf,
    /// How it was found: `--lib`, `$VGPU_LIB`, `next to vgpu`, ...
    pub how: String,
}

/// The directory of the running `vgpu` binary.
pub fn exe_dir() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()?
        .canonicalize()
        .ok()?
        .parent()
        .map(Path::to_path_buf)
}

fn usable(path: &Path) -> Option<PathBuf> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    path.canonicalize().ok()
}

fn search(
    name: &str,
    explicit: Option<(&Path, &str)>,
    env_var: &str,
    system: Option<&str>,
) -> Result<Found, String> {
    // An explicit choice is never silently replaced by another file.
    if let Some((path, how)) = explicit {
        return usable(path)
            .map(|path| Found {
                path,
                how: how.to_owned(),
            })
            .ok_or_else(|| {
                format!(
                    "{name} given by {how} not found: {} is not a readable file",
                    path.display()
                )
            });
    }
    if let Some(v) = std::env::var_os(env_var).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(v);
        return usable(&path)
            .map(|path| Found {
                path,
                how: format!("${env_var}"),
            })
            .ok_or_else(|| {
                format!(
                    "{name} given by ${env_var} not found: {} is not a readable file",
                    path.display()
                )
            });
    }
    let mut tried = Vec::new();
    if let Some(dir) = exe_dir() {
        tried.push((dir.join(name), "next to vgpu"));
        tried.push((dir.join("../lib").join(name), "in ../lib beside vgpu"));
    }
    if let Some(s) = system {
        tried.push((PathBuf::from(s), "system location"));
    }
    for (path, how) in &tried {
        if let Some(path) = usable(path) {
            return Ok(Found {
                path,
                how: (*how).to_owned(),
            });
        }
    }
    let list: Vec<String> = tried.iter().map(|(p, _)| p.display().to_string()).collect();
    Err(format!(
        "{name} not found; looked in ${env_var} (unset) and {}",
        list.join(", ")
    ))
}

/// Find `libvgpu.so`: `--lib`, `$VGPU_LIB`, next to the vgpu binary, `../lib/` beside it,
/// `/usr/local/vgpu/libvgpu.so`.
pub fn find_hook(explicit: Option<&Path>) -> Result<Found, String> {
    search(
        HOOK_NAME,
        explicit.map(|p| (p, "--lib")),
        ENV_HOOK,
        Some(HOOK_SYSTEM_PATH),
    )
    .map_err(|e| {
        format!(
            "{e}\nhint: build it with `cargo build --workspace`, or pass --lib PATH / set $VGPU_LIB"
        )
    })
}

/// Find the simulated driver: `$VGPU_SIM_LIB`, next to the vgpu binary, `../lib/` beside it.
pub fn find_sim() -> Result<Found, String> {
    search(SIM_NAME, None, ENV_SIM, None).map_err(|e| {
        format!("{e}\nhint: build it with `cargo build --workspace`, or set $VGPU_SIM_LIB")
    })
}

/// Reject paths the dynamic loader cannot take in `LD_PRELOAD` (separators inside a name).
pub fn check_preloadable(path: &Path) -> Result<&str, String> {
    let s = path.to_str().ok_or_else(|| {
        format!(
            "{} is not valid UTF-8; LD_PRELOAD cannot name it",
            path.display()
        )
    })?;
    if s.contains([':', ' ', '\t', '\n']) {
        return Err(format!(
            "{s} contains a space or colon; LD_PRELOAD cannot name it (copy or link it elsewhere)"
        ));
    }
    Ok(s)
}

/// `LD_PRELOAD` with `lib` first and the existing entries kept (without a second copy of `lib`).
pub fn prepend_preload(lib: &str, existing: Option<&str>) -> String {
    let mut out = lib.to_owned();
    for entry in existing
        .unwrap_or("")
        .split([':', ' '])
        .filter(|e| !e.is_empty())
    {
        if entry != lib {
            out.push(':');
            out.push_str(entry);
        }
    }
    out
}

/// Whether an `LD_PRELOAD` or `/etc/ld.so.preload` text names a file called `libvgpu.so`;
/// returns the entries that do.
pub fn preload_entries(text: &str) -> Vec<String> {
    text.split([':', ' ', '\t', '\n'])
        .filter(|e| Path::new(e).file_name().is_some_and(|n| n == HOOK_NAME))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_keeps_existing_entries_once() {
        assert_eq!(prepend_preload("/a/libvgpu.so", None), "/a/libvgpu.so");
        assert_eq!(prepend_preload("/a/libvgpu.so", Some("")), "/a/libvgpu.so");
        assert_eq!(
            prepend_preload(
                "/a/libvgpu.so",
                Some("/x/libfoo.so /a/libvgpu.so:/y/libbar.so")
            ),
            "/a/libvgpu.so:/x/libfoo.so:/y/libbar.so"
        );
    }

    #[test]
    fn preload_entries_are_found_by_name() {
        assert_eq!(
            preload_entries("/x/libfoo.so:/usr/local/vgpu/libvgpu.so\n"),
            ["/usr/local/vgpu/libvgpu.so"]
        );
        assert!(preload_entries("/x/libvgpu.so.bak").is_empty());
    }

    #[test]
    fn explicit_missing_library_is_an_error_not_a_fallback() {
        let err = find_hook(Some(Path::new("/nonexistent/libvgpu.so"))).unwrap_err();
        assert!(
            err.contains("--lib") && err.contains("/nonexistent/libvgpu.so"),
            "{err}"
        );
    }

    #[test]
    fn unpreloadable_paths_are_refused() {
        assert!(check_preloadable(Path::new("/a b/libvgpu.so")).is_err());
        assert!(check_preloadable(Path::new("/a:b/libvgpu.so")).is_err());
        assert_eq!(
            check_preloadable(Path::new("/ab/libvgpu.so")),
            Ok("/ab/libvgpu.so")
        );
    }
}
