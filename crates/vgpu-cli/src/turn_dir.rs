//! The turn directory (`$VGPU_TURN_DIR`, default `/tmp/vgpulock`) on a workstation.
//!
//! Jobs with an SM limit on one GPU see each other's claims through a board file per GPU in this
//! directory; the hook does not create the directory (under Kubernetes the device plugin
//! mounts it), so without it two `--sm` jobs each run as if alone. `vgpu run` creates it
//! like `/tmp`: mode 1777, so every user's jobs can meet there and, thanks to the sticky
//! bit, nobody can remove or rename another user's board. What cannot be made so is
//! reported, never fatal: the job still runs, only without turns.

use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

/// Mode of a turn directory created by vgpu: world-writable and sticky, like `/tmp`.
pub const TURN_DIR_MODE: u32 = 0o1777;

/// Create `dir` (mode 1777, whatever the umask) or check the existing one; `Err` is the
/// warning to print.
pub fn ensure(dir: &Path) -> Result<(), String> {
    let consequence = "jobs with an SM limit on the same GPU will not see each other's claims";
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            // Made 0700 first so nobody else writes into it before it has the sticky bit.
            return std::fs::set_permissions(dir, std::fs::Permissions::from_mode(TURN_DIR_MODE))
                .map_err(|e| {
                    format!(
                        "cannot set mode 1777 on {}: {e}; {consequence}",
                        dir.display()
                    )
                });
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(format!(
                "cannot create the turn directory {}: {e}; {consequence} \
                 (create it with `install -d -m 1777 {}`, or set VGPU_TURN_DIR)",
                dir.display(),
                dir.display()
            ));
        }
    }
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| format!("cannot inspect {}: {e}; {consequence}", dir.display()))?;
    if meta.file_type().is_symlink() {
        return Err(format!(
            "the turn directory {} is a symlink; check where it points (another user may control it)",
            dir.display()
        ));
    }
    if !meta.is_dir() {
        return Err(format!(
            "the turn directory {} is not a directory; {consequence}",
            dir.display()
        ));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "the turn directory {} is world-writable without the sticky bit (mode {mode:04o}): any user \
             can remove the boards; `chmod +t {}` fixes it",
            dir.display(),
            dir.display()
        ));
    }
    if !writable(dir) {
        return Err(format!(
            "the turn directory {} (owner uid {}, mode {mode:04o}) is not writable by you; {consequence} \
             with other users' jobs",
            dir.display(),
            meta.uid()
        ));
    }
    Ok(())
}

fn writable(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    crate::sys::may_access(&c, libc::W_OK | libc::X_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_like_tmp_and_checked_when_present() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("vgpulock");
        ensure(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, TURN_DIR_MODE);
        ensure(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(ensure(&dir).unwrap_err().contains("sticky"));
        let file = base.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(ensure(&file).unwrap_err().contains("not a directory"));
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(ensure(&link).unwrap_err().contains("symlink"));
        assert!(ensure(&base.path().join("no/such/dir")).is_err());
    }
}
