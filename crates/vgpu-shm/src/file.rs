//! Opening files that someone else may control: the usage file (every process of its
//! container can write it) and the turn board (every container of the node can).
//!
//! Invariant: an open here never follows a symbolic link at the last component
//! (`O_NOFOLLOW`), never blocks (`O_NONBLOCK`: a FIFO opens at once and is then refused), is
//! `O_CLOEXEC`, and hands back only a regular file. [`check_owner`] is the usage table's
//! further rule for writers: in a world-writable directory (`/tmp`, HAMi's 0777 per-container
//! directories) the file must belong to the caller or root, because there another user may
//! have put it in place, and its limits would then be theirs. (The kernel's
//! `fs.protected_regular` applies a like rule to `O_CREAT` opens in sticky directories, not to
//! the plain open of an existing file.) The turn board has no owner rule: every container of
//! the node, under any uid, writes it by design. Which existing files vgpu may initialize is
//! the rule of `table/open.rs` and `turns.rs`: empty ones with one name, and their own.

use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::sys;

/// Why a file was not opened.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// A system call failed: the step, and the error.
    Io(&'static str, io::Error),
    /// The file is not one vgpu reads or writes: why, in words.
    Refused(String),
}

/// An opened file, checked.
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) file: File,
    pub(crate) meta: Metadata,
    /// Whether this open created it (`O_CREAT | O_EXCL`): nobody else can have written it.
    pub(crate) created: bool,
}

const FLAGS: libc::c_int = libc::O_NOFOLLOW | libc::O_NONBLOCK;

/// Open `path` read-only (node-side readers, inspection).
pub(crate) fn open_read_only(path: &Path) -> Result<Opened, OpenError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(FLAGS)
        .open(path)
        .map_err(|e| refusal_of(path, "open", e))?;
    checked(file, false)
}

/// Open `path` read-write; with `create`, create it first if it does not exist, mode 0666
/// whatever the umask (every user of the container, or every container of the node, may need
/// it; the umask is left alone).
pub(crate) fn open_writable(path: &Path, create: bool) -> Result<Opened, OpenError> {
    if create {
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags(FLAGS)
            .open(path)
        {
            Ok(file) => {
                // The umask may have masked bits; set them without touching the umask.
                file.set_permissions(std::fs::Permissions::from_mode(0o666))
                    .map_err(|e| OpenError::Io("fchmod", e))?;
                return checked(file, true);
            }
            // Exists (a symbolic link too: O_EXCL never follows one); open it below.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refusal_of(path, "create", e)),
        }
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(FLAGS)
        .open(path)
        .map_err(|e| refusal_of(path, "open", e))?;
    checked(file, false)
}

/// `ELOOP` from `O_NOFOLLOW` is a symbolic link: say so.
fn refusal_of(path: &Path, op: &'static str, e: io::Error) -> OpenError {
    if e.raw_os_error() == Some(libc::ELOOP) && is_symlink(path) {
        OpenError::Refused("is a symbolic link (vgpu does not follow links to its files)".into())
    } else {
        OpenError::Io(op, e)
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

fn checked(file: File, created: bool) -> Result<Opened, OpenError> {
    let meta = file.metadata().map_err(|e| OpenError::Io("fstat", e))?;
    if !meta.is_file() {
        let t = meta.file_type();
        let kind = if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_dir() {
            "a directory"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else {
            "not a plain file"
        };
        return Err(OpenError::Refused(format!(
            "is not a regular file ({kind})"
        )));
    }
    Ok(Opened {
        file,
        meta,
        created,
    })
}

/// In a world-writable directory, the file must belong to the caller or to root.
pub(crate) fn check_owner(path: &Path, meta: &Metadata) -> Result<(), OpenError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir_mode = std::fs::metadata(dir)
        .map_err(|e| OpenError::Io("stat directory", e))?
        .mode();
    let me = sys::effective_uid();
    if dir_mode & 0o002 != 0 && meta.uid() != me && meta.uid() != 0 {
        return Err(OpenError::Refused(format!(
            "is owned by uid {} in the world-writable directory {} (vgpu writes only its own \
             or root's files there; remove it, or use a directory only the container can write)",
            meta.uid(),
            dir.display()
        )));
    }
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::tests::TempPath;

    #[test]
    fn symlinks_fifos_and_directories_are_refused_with_words() {
        let real = TempPath::new("file-real");
        std::fs::write(&real.0, b"x").unwrap();
        let link = TempPath::new("file-link");
        std::os::unix::fs::symlink(&real.0, &link.0).unwrap();
        for create in [false, true] {
            match open_writable(&link.0, create) {
                Err(OpenError::Refused(why)) => assert!(why.contains("symbolic link"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            open_read_only(&link.0),
            Err(OpenError::Refused(_))
        ));
        assert!(matches!(
            open_read_only(&std::env::temp_dir()),
            Err(OpenError::Refused(why)) if why.contains("a directory")
        ));
        assert!(open_read_only(&real.0).is_ok());
        assert!(open_writable(&real.0, false).is_ok());
    }
}
