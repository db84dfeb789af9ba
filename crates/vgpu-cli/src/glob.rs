//! Which usage files a `--cache` pattern names: shell-style wildcards (`*`, `?`, `[abc]`,
//! `[!a-z]` in a name, the maintained `glob` crate's matching, and `**` for any number of
//! directories), walked here, bounded, and without the library HAMi's monitor also skips.
//!
//! The walk reads directories a tenant can write (its own container directory), so it holds
//! to what a node-side reader must (docs/security.md): a name that is not UTF-8 is not matched
//! (it cannot match a text pattern; the `glob` crate's own walk panics on one), a symbolic
//! link is never followed where a wildcard matched it (a matched file that is one is listed and
//! then refused by the reader, visibly), and one directory is read only so far
//! ([`MAX_ENTRIES_PER_DIRECTORY`], [`MAX_MATCHES_PER_DIRECTORY`]): a tenant filling its own
//! directory loses only its own series, never another container's file nor the page.

use std::fs::DirEntry;
use std::path::{Path, PathBuf};

/// At most this many files are taken per expansion, so a mistaken pattern over a huge tree
/// stays bounded (a node runs at most a few hundred containers).
pub const MAX_MATCHES: usize = 10_000;

/// At most this many entries of one directory are read per expansion.
pub const MAX_ENTRIES_PER_DIRECTORY: usize = 4_096;

/// At most this many files are taken from one directory: a container's directory holds one
/// usage file per GPU claim, so more is a tenant's doing and costs only its own series.
pub const MAX_MATCHES_PER_DIRECTORY: usize = 64;

/// `**` descends at most this many directories.
const MAX_DEPTH: usize = 32;

/// Whether `s` contains a wildcard.
pub fn has_magic(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

/// The options every match uses: `*` does not match a leading `.` (hidden entries, as in
/// the shell), and matching is case-sensitive.
const OPTIONS: glob::MatchOptions = glob::MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: true,
};

/// Whether `name` matches `pattern` (one path component); an invalid pattern matches nothing.
pub fn matches(pattern: &str, name: &str) -> bool {
    glob::Pattern::new(pattern).is_ok_and(|p| p.matches_with(name, OPTIONS))
}

/// One component of a pattern.
enum Part {
    /// A name without wildcards: taken as it is (symbolic links followed: the operator wrote it).
    Literal(String),
    /// A name with wildcards, matched against each entry of the directory.
    Wild(glob::Pattern),
    /// `**`: this directory and every directory below it (hidden ones excepted).
    AnyDirs,
}

fn parse(pattern: &str) -> Result<(PathBuf, Vec<Part>), String> {
    let root = if pattern.starts_with('/') {
        PathBuf::from("/")
    } else {
        PathBuf::new()
    };
    let parts = pattern
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(|c| match c {
            "**" => Ok(Part::AnyDirs),
            c if has_magic(c) => glob::Pattern::new(c)
                .map(Part::Wild)
                .map_err(|e| format!("glob {pattern}: {e}")),
            c => Ok(Part::Literal(c.to_owned())),
        })
        .collect::<Result<_, _>>()?;
    Ok((root, parts))
}

/// The regular files `pattern` matches, sorted. Files whose name contains `libvgpu.so` are
/// skipped (the monitor does the same: the library sits beside the cache files).
pub fn expand(pattern: &str) -> Result<Vec<PathBuf>, String> {
    if pattern.is_empty() {
        return Err("empty glob".into());
    }
    let (root, parts) = parse(pattern)?;
    let mut walk = Walk { out: Vec::new() };
    walk.visit(&root, &parts, 0);
    if walk.out.len() > MAX_MATCHES {
        return Err(format!(
            "glob {pattern} matches more than {MAX_MATCHES} files; make it narrower"
        ));
    }
    walk.out.sort();
    Ok(walk.out)
}

struct Walk {
    out: Vec<PathBuf>,
}

/// The entries of `dir` (the current directory for an empty path) with UTF-8 names, at most
/// [`MAX_ENTRIES_PER_DIRECTORY`] of them read; an unreadable directory has none, as in the
/// shell.
fn entries(dir: &Path) -> impl Iterator<Item = (DirEntry, String)> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .take(MAX_ENTRIES_PER_DIRECTORY)
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            Some((e, name))
        })
}

/// Whether an entry found by a wildcard is a real directory (a link to one is not entered).
fn is_real_dir(e: &DirEntry) -> bool {
    e.file_type().is_ok_and(|t| t.is_dir())
}

impl Walk {
    fn full(&self) -> bool {
        self.out.len() > MAX_MATCHES
    }

    /// `path`, reached by the whole pattern: taken when it is a file or a symbolic link (the
    /// reader refuses a link, visibly) and not the library.
    fn take(&mut self, path: PathBuf, file_type: Option<std::fs::FileType>) {
        let is_library = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains(crate::locate::HOOK_NAME));
        let is_file = file_type.is_some_and(|t| t.is_file() || t.is_symlink());
        if is_file && !is_library {
            self.out.push(path);
        }
    }

    fn visit(&mut self, dir: &Path, parts: &[Part], depth: usize) {
        let Some((part, rest)) = parts.split_first() else {
            return;
        };
        if self.full() {
            return;
        }
        match part {
            Part::Literal(name) => {
                let next = dir.join(name);
                if rest.is_empty() {
                    let file_type = next.symlink_metadata().ok().map(|m| m.file_type());
                    self.take(next, file_type);
                } else if next.is_dir() {
                    self.visit(&next, rest, depth);
                }
            }
            Part::Wild(pattern) => {
                let mut taken = 0;
                for (entry, name) in entries(dir) {
                    if self.full() || !pattern.matches_with(&name, OPTIONS) {
                        continue;
                    }
                    if rest.is_empty() {
                        if taken < MAX_MATCHES_PER_DIRECTORY {
                            taken += 1;
                            self.take(dir.join(name), entry.file_type().ok());
                        }
                    } else if is_real_dir(&entry) {
                        self.visit(&dir.join(name), rest, depth);
                    }
                }
            }
            Part::AnyDirs => {
                self.visit(dir, rest, depth);
                if depth == MAX_DEPTH {
                    return;
                }
                for (entry, name) in entries(dir) {
                    if !self.full() && !name.starts_with('.') && is_real_dir(&entry) {
                        self.visit(&dir.join(name), parts, depth + 1);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_like_the_shell() {
        for (pattern, name, matching) in [
            ("*.cache", "a.cache", true),
            ("*.cache", ".cache", true),
            ("*.cache", "a.cache.bak", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("*", "", true),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXbYY", false),
            ("[ab]x", "bx", true),
            ("[!ab]x", "bx", false),
            ("[a-c]1", "c1", true),
            ("[a-c]1", "d1", false),
            ("[]]", "]", true),
            // The crate's escapes are classes, and an unterminated `[` is an invalid pattern.
            ("[*]", "*", true),
            ("[*]", "a", false),
            ("[", "[", false),
        ] {
            assert_eq!(matches(pattern, name), matching, "{pattern:?} on {name:?}");
        }
    }

    #[test]
    fn expansion_walks_directories_and_skips_the_library() {
        let dir = tempfile::Builder::new()
            .prefix("vgpu-glob-test")
            .tempdir()
            .unwrap();
        let root = dir.path();
        for sub in ["c1", "c2", ".hidden"] {
            std::fs::create_dir(root.join(sub)).unwrap();
            std::fs::write(root.join(sub).join("x.cache"), b"").unwrap();
            std::fs::write(root.join(sub).join("libvgpu.so"), b"").unwrap();
            std::fs::write(root.join(sub).join("libvgpu.so.v2.10.0"), b"").unwrap();
        }
        std::fs::write(root.join("c1/y.txt"), b"").unwrap();
        std::fs::create_dir(root.join("c1/d.cache")).unwrap();
        let pat = format!("{}/*/*", root.display());
        let got = expand(&pat).unwrap();
        let want: Vec<PathBuf> = ["c1/x.cache", "c1/y.txt", "c2/x.cache"]
            .iter()
            .map(|p| root.join(p))
            .collect();
        assert_eq!(got, want);
        let got = expand(&format!("{}/c[12]/*.cache", root.display())).unwrap();
        assert_eq!(got.len(), 2);
        let got = expand(&format!("{}/**/*.cache", root.display())).unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            expand(&format!("{}/none/*.cache", root.display()))
                .unwrap()
                .is_empty()
        );
        assert!(expand("").is_err());
        assert!(expand(&format!("{}/[/*.cache", root.display())).is_err());
        assert!(expand(&format!("{}/a**/*.cache", root.display())).is_err());
    }

    /// What a tenant can put in its own directory: a name that is not UTF-8 (the `glob`
    /// crate's walk panicked on it, taking the exporter down), a link to a directory elsewhere,
    /// and more files than a container has. None of it hides another container's file.
    #[test]
    fn a_tenants_directory_cannot_break_or_widen_the_walk() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::Builder::new()
            .prefix("vgpu-glob-tenant")
            .tempdir()
            .unwrap();
        let root = dir.path();
        for sub in ["a", "b", "elsewhere"] {
            std::fs::create_dir(root.join(sub)).unwrap();
        }
        std::fs::write(root.join("a/x.cache"), b"").unwrap();
        std::fs::write(root.join("elsewhere/secret.cache"), b"").unwrap();
        let b = root.join("b");
        std::fs::write(b.join(std::ffi::OsStr::from_bytes(b"n\xff.cache")), b"").unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), b.join("link")).unwrap();
        std::os::unix::fs::symlink(root.join("a/x.cache"), b.join("l.cache")).unwrap();
        for i in 0..MAX_MATCHES_PER_DIRECTORY + 10 {
            std::fs::write(b.join(format!("f{i:03}.cache")), b"").unwrap();
        }
        let got = expand(&format!("{}/*/*.cache", root.display())).unwrap();
        assert!(got.contains(&root.join("a/x.cache")), "{got:?}");
        assert!(got.contains(&root.join("elsewhere/secret.cache")));
        let from_b = got.iter().filter(|p| p.starts_with(&b)).count();
        assert_eq!(from_b, MAX_MATCHES_PER_DIRECTORY, "{got:?}");
        // `**` does not follow the link out of b.
        let got = expand(&format!("{}/b/**/*.cache", root.display())).unwrap();
        assert!(
            got.iter().all(|p| !p.starts_with(b.join("link"))),
            "{got:?}"
        );
        // A matched link is listed (the reader refuses it and says so).
        let got = expand(&format!("{}/b/l.*", root.display())).unwrap();
        assert_eq!(got, [b.join("l.cache")]);
    }
}
