//! Device memory shared between processes (`VGPU_SIM_SHARED_MEM=<file>`): on a real GPU what
//! one process frees another can allocate, and tests of two processes meeting over memory
//! (docs/swap.md, "For a more urgent container") need that. Every process naming the same
//! file publishes, per physical device, the bytes it uses in a slot of its own; a device's
//! free memory is then its total less the static `VGPU_SIM_OTHER_USED`, less what the
//! other live processes' slots say, less this process's own use.
//!
//! Layout: [`SLOTS`] slots of 1 + [`DEVICES`] little-endian u64 words: the owner's pid (0 =
//! free), then its bytes per physical device. A slot whose pid no longer lives is free. A
//! reservation reads the others, then takes from its own counter: two processes reserving
//! at the same instant can together pass the total (a test artefact accepted: the tests
//! that use this take turns). No lock: the simulator's files are the tests' own.

use std::fs::File;
use std::os::unix::fs::FileExt;

const SLOTS: usize = 64;
const DEVICES: usize = 8;
const SLOT_WORDS: usize = 1 + DEVICES;

/// This process's slot in the shared file.
#[derive(Debug)]
pub struct SharedMem {
    file: File,
    slot: usize,
}

fn words(file: &File) -> Vec<u64> {
    let mut bytes = vec![0u8; SLOTS * SLOT_WORDS * 8];
    let mut done = 0;
    while done < bytes.len() {
        match file.read_at(&mut bytes[done..], done as u64) {
            Ok(0) | Err(_) => break,
            Ok(n) => done += n,
        }
    }
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

fn alive(pid: u64) -> bool {
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

impl SharedMem {
    /// Opens (creating) `path` and claims a free slot (written, then read back: of two
    /// processes claiming one slot at once, the one whose pid stayed keeps it and the other
    /// tries the next); `None` if it cannot.
    pub fn open(path: &str) -> Option<SharedMem> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .ok()?;
        let me = u64::from(std::process::id());
        for _ in 0..SLOTS {
            let w = words(&file);
            let slot = (0..SLOTS).find(|&s| !alive(w[s * SLOT_WORDS]))?;
            let mut fresh = vec![0u8; SLOT_WORDS * 8];
            fresh[..8].copy_from_slice(&me.to_le_bytes());
            file.write_all_at(&fresh, (slot * SLOT_WORDS * 8) as u64)
                .ok()?;
            std::thread::sleep(std::time::Duration::from_millis(1));
            if words(&file)[slot * SLOT_WORDS] == me {
                return Some(SharedMem { file, slot });
            }
        }
        None
    }

    /// Bytes the other live processes use on physical device `dev`.
    pub fn others(&self, dev: usize) -> u64 {
        if dev >= DEVICES {
            return 0;
        }
        let w = words(&self.file);
        (0..SLOTS)
            .filter(|&s| s != self.slot && alive(w[s * SLOT_WORDS]))
            .map(|s| w[s * SLOT_WORDS + 1 + dev])
            .sum()
    }

    /// Publishes this process's use of physical device `dev`.
    pub fn publish(&self, dev: usize, used: u64) {
        if dev < DEVICES {
            let at = (self.slot * SLOT_WORDS + 1 + dev) * 8;
            let _ = self.file.write_all_at(&used.to_le_bytes(), at as u64);
        }
    }
}
