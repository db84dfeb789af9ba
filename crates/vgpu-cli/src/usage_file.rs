//! Which usage file a command uses (the default, a `--share` group's) and, for a `vgpu run`
//! job, the table prepared so that sharing a workstation GPU cannot go wrong.
//!
//! Invariants:
//! - A job shares a table (and so one limit per device) only when asked: `--share NAME`,
//!   `--cache PATH`, or an inherited `CUDA_DEVICE_MEMORY_SHARED_CACHE` (a HAMi container).
//!   Otherwise it gets a private table in a fresh directory, removed when the job ends
//!   ([`crate::job_cleanup`]).
//! - A table vgpu creates is not writable by other users unless `--all-users` asks for it:
//!   private and `--share` tables live in `$TMPDIR/vgpu-<uid>/` (mode 0700, checked to be
//!   ours), a new `--cache` file is created 0600 (0666 with `--all-users`), never through a
//!   symlink.
//! - Limits and the host memory policy left in an existing table never silently replace the
//!   ones this job asks for: while live processes use it under others the job is refused;
//!   when nobody uses it any more, the job's replace the old ones (with a note).

use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use vgpu_alloc_core::DeviceIndex;
use vgpu_env::Config;
use vgpu_shm::HostPolicy;

use crate::Failure;
use crate::units::format_limit;

/// File name of a private job's table inside its directory.
pub const PRIVATE_FILE_NAME: &str = "usage.cache";

/// Longest `--share` name.
const MAX_SHARE_NAME: usize = 64;

/// Check a `--share` name: letters, digits, `.`, `_`, `-`, not starting with `.`.
pub fn parse_share_name(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= MAX_SHARE_NAME
        && !text.starts_with('.')
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "`{text}` is not a group name: use 1 to {MAX_SHARE_NAME} letters, digits, `.`, `_` or `-`, \
             not starting with `.`"
        ))
    }
}

/// This user's directory for private and shared tables: `$TMPDIR/vgpu-<uid>` (not created).
pub fn user_dir() -> PathBuf {
    std::env::temp_dir().join(format!("vgpu-{}", crate::sys::effective_uid()))
}

/// The usage file when none is named: `$CUDA_DEVICE_MEMORY_SHARED_CACHE`, else HAMi's default
/// `/tmp/cudevshr.cache`.
pub fn default_cache_path() -> PathBuf {
    match std::env::var_os(vgpu_env::ENV_SHARED_CACHE) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(vgpu_env::DEFAULT_SHARED_CACHE),
    }
}

/// The table of the group `name` (`vgpu run --share NAME`), whether it exists or not.
pub fn share_path(name: &str) -> PathBuf {
    user_dir().join(format!("{name}.cache"))
}

/// Create [`user_dir`] (mode 0700) or check that the existing one is a real directory of
/// ours that nobody else can write into: in a shared `/tmp`, another user could have made it.
pub fn ensure_user_dir() -> Result<PathBuf, String> {
    let dir = user_dir();
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => return Ok(dir),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(&dir)
        .map_err(|e| format!("cannot inspect {}: {e}", dir.display()))?;
    let mode = meta.permissions().mode() & 0o7777;
    if !meta.is_dir() || meta.uid() != crate::sys::effective_uid() || mode & 0o022 != 0 {
        return Err(format!(
            "{} is not a private directory of yours (owner uid {}, mode {mode:04o}{}): another user \
             could change the tables in it; remove it, or set TMPDIR to a directory of your own",
            dir.display(),
            meta.uid(),
            if meta.file_type().is_symlink() {
                ", a symlink"
            } else {
                ""
            }
        ));
    }
    Ok(dir)
}

/// A fresh private directory for one job (mode 0700, unique name) in [`ensure_user_dir`];
/// the caller arranges its removal.
pub fn create_job_dir() -> Result<PathBuf, String> {
    let base = ensure_user_dir()?;
    tempfile::Builder::new()
        .prefix("job-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(&base)
        .map(tempfile::TempDir::keep)
        .map_err(|e| {
            format!(
                "cannot create a private directory in {}: {e}",
                base.display()
            )
        })
}

/// Create the empty file `path` (the hook initializes an empty file) with `mode`, whatever
/// the umask; refuses to follow a symlink or to reuse an existing file.
pub fn create_table_file(path: &Path, mode: u32) -> std::io::Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
}

/// Make sure an explicitly named table (`--cache PATH`) can be used: an existing one must be
/// a regular file (not a symlink) we can write; a missing one is created 0600, or 0666 when
/// `all_users`.
pub fn prepare_explicit(path: &Path, all_users: bool) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => Err(format!(
            "{} is a symlink; vgpu does not write a usage table through one (name the file itself)",
            path.display()
        )),
        Ok(meta) if !meta.is_file() => Err(format!("{} is not a regular file", path.display())),
        Ok(meta)
            if meta.uid() != crate::sys::effective_uid()
                && meta.uid() != 0
                && in_world_writable_dir(path) =>
        {
            // The hook's owner rule (docs/security.md): said here, before the program starts.
            Err(format!(
                "{} belongs to uid {} and lies in a world-writable directory, where anyone could \
                 have put it: the hook refuses it. To share a table across users, put it in a \
                 directory they can write that is not world-writable (a shared group's)",
                path.display(),
                meta.uid()
            ))
        }
        Ok(meta) => {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
                .map_err(|_| format!("{} contains a NUL byte", path.display()))?;
            if !crate::sys::may_access(&c, libc::R_OK | libc::W_OK) {
                return Err(format!(
                    "{} belongs to uid {} (mode {:04o}) and you cannot write it: its owner can let \
                     other users join with `vgpu run --cache PATH --all-users` when creating it",
                    path.display(),
                    meta.uid(),
                    meta.permissions().mode() & 0o7777
                ));
            }
            Ok(())
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            create_table_file(path, if all_users { 0o666 } else { 0o600 }).or_else(|e| {
                // Another job created it in between: join it like any existing file.
                if e.kind() == ErrorKind::AlreadyExists {
                    prepare_explicit(path, all_users)
                } else {
                    Err(format!("cannot create {}: {e}", path.display()))
                }
            })
        }
        Err(e) => Err(format!("cannot inspect {}: {e}", path.display())),
    }
}

fn in_world_writable_dir(path: &Path) -> bool {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o002 != 0)
}

/// One device whose stored limit differs from what the job asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mismatch {
    device: u32,
    what: &'static str,
    stored: String,
    wanted: String,
    set: LimitChange,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LimitChange {
    Memory(Option<u64>),
    Sm(Option<u64>),
    Host(HostPolicy),
}

/// The kinds of setting a job asks for (flags, or its environment's variables), which an
/// existing table's must match: the others it takes from the table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Asked {
    /// Memory limits.
    pub memory: bool,
    /// SM limits.
    pub sm: bool,
    /// The host memory policy (`VGPU_HOST_SPILL`, `CUDA_OVERSUBSCRIBE`).
    pub host_policy: bool,
}

fn host_policy(p: HostPolicy) -> String {
    format!(
        "spill {}, oversubscribe {}",
        crate::units::format_bytes(p.spill),
        if p.oversubscribe { "on" } else { "off" }
    )
}

fn percent(p: Option<u64>) -> String {
    p.map_or_else(|| "unlimited".to_owned(), |p| format!("{p}%"))
}

/// Bring the limits and host memory policy stored in an existing table in line with `cfg`
/// for the kinds the job asks for: refuse while live processes use it under others,
/// replace them when nobody does and `may_replace` (false for a table the environment
/// named, such as a HAMi container's, whose settings are its operator's). Returns the notes
/// to print. A missing table is fine (the hook creates it from the environment).
pub fn reconcile_limits(
    path: &Path,
    cfg: &Config,
    asked: Asked,
    may_replace: bool,
) -> Result<Vec<String>, Failure> {
    // Empty: created just now (by `prepare_explicit`) and initialized by the hook.
    if std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        return Ok(Vec::new());
    }
    let Some(report) = crate::usage_table::read_if_exists(path)? else {
        return Ok(Vec::new());
    };
    let mut mismatches = Vec::new();
    for d in &report.devices {
        let i = d.index as usize;
        let want_mem = cfg.memory_limit.get(i).copied().flatten();
        if asked.memory && want_mem != d.memory_limit_bytes {
            mismatches.push(Mismatch {
                device: d.index,
                what: "memory limit",
                stored: format_limit(d.memory_limit_bytes),
                wanted: format_limit(want_mem),
                set: LimitChange::Memory(want_mem),
            });
        }
        let want_sm = cfg.sm_limit.get(i).copied().flatten().map(u64::from);
        if asked.sm && want_sm != d.sm_limit_percent {
            mismatches.push(Mismatch {
                device: d.index,
                what: "SM limit",
                stored: percent(d.sm_limit_percent),
                wanted: percent(want_sm),
                set: LimitChange::Sm(want_sm),
            });
        }
        let want_host = HostPolicy {
            spill: cfg.host_backing.spill,
            oversubscribe: cfg.host_backing.oversubscribe,
        };
        let stored_host = HostPolicy {
            spill: d.host_spill_bytes,
            oversubscribe: d.oversubscribe,
        };
        if asked.host_policy && want_host != stored_host {
            mismatches.push(Mismatch {
                device: d.index,
                what: "host memory policy",
                stored: host_policy(stored_host),
                wanted: host_policy(want_host),
                set: LimitChange::Host(want_host),
            });
        }
    }
    if mismatches.is_empty() {
        return Ok(Vec::new());
    }
    let list: Vec<String> = mismatches
        .iter()
        .map(|m| {
            format!(
                "device {} {} {} (this job: {})",
                m.device, m.what, m.stored, m.wanted
            )
        })
        .collect();
    let live = report.processes.iter().filter(|p| p.alive).count();
    if live > 0 {
        return Err(Failure::msg(format!(
            "{} is in use by {live} live process(es) under other limits or host memory policy: {}.\n\
             Run with the same ones to join them, change the limits for all of them with \
             `vgpu set-limit --cache {}` (the host memory policy stays the group's while it \
             runs), or use another group (--share NAME) or none (a private table).",
            path.display(),
            list.join("; "),
            path.display()
        )));
    }
    if !may_replace {
        return Err(Failure::msg(format!(
            "{} (named by $CUDA_DEVICE_MEMORY_SHARED_CACHE) holds other limits: {}.\n\
             vgpu run does not change the limits of a table the environment gives it (in a HAMi \
             container they are the operator's); run with the same limits, use `vgpu set-limit` \
             if you mean to change them, or --share NAME for a table of your own.",
            path.display(),
            list.join("; ")
        )));
    }
    let table = crate::usage_table::open_writable(path)?;
    for m in &mismatches {
        let dev = DeviceIndex(m.device);
        match m.set {
            LimitChange::Memory(l) => table.set_memory_limit(dev, l),
            LimitChange::Sm(p) => table.set_sm_limit(dev, p),
            LimitChange::Host(p) => table.set_host_policy(dev, p),
        }
        .map_err(|e| Failure::msg(format!("cannot update {}: {e}", path.display())))?;
    }
    Ok(vec![format!(
        "{} held other limits from an earlier job ({}); no process uses it now, so this job's limits replace them",
        path.display(),
        list.join("; ")
    )])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_names_are_plain_file_names() {
        assert_eq!(parse_share_name("team-a.1_x"), Ok("team-a.1_x".into()));
        for bad in ["", ".hidden", "a/b", "..", "a b", &"x".repeat(65)] {
            assert!(parse_share_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_new_explicit_table_is_private_unless_all_users() {
        let dir = tempfile::tempdir().unwrap();
        let mine = dir.path().join("mine.cache");
        prepare_explicit(&mine, false).unwrap();
        let mode = std::fs::metadata(&mine).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let all = dir.path().join("all.cache");
        prepare_explicit(&all, true).unwrap();
        let mode = std::fs::metadata(&all).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666);
        // Joining an existing file keeps it as it is.
        prepare_explicit(&mine, true).unwrap();
        let mode = std::fs::metadata(&mine).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_foreign_file_in_a_world_writable_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let path = dir.path().join("theirs.cache");
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        // Needs the right to give a file away (root, as in CI); elsewhere nothing to check.
        if std::os::unix::fs::chown(&path, Some(12345), None).is_err() {
            return;
        }
        let err = prepare_explicit(&path, false).unwrap_err();
        assert!(
            err.contains("uid 12345") && err.contains("world-writable"),
            "{err}"
        );
        // The same file in a directory that is not world-writable may be joined.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o775)).unwrap();
        prepare_explicit(&path, false).unwrap();
    }

    #[test]
    fn symlinks_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"").unwrap();
        let link = dir.path().join("link.cache");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(
            prepare_explicit(&link, false)
                .unwrap_err()
                .contains("symlink")
        );
        let dangling = dir.path().join("dangling.cache");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
        assert!(prepare_explicit(&dangling, false).is_err());
        assert!(!dir.path().join("nowhere").exists());
    }
}
