//! A small glob (`*`, `?`, `[abc]`, `[a-z]`, `[!x]` within path components; no `**`), enough
//! for "every usage file under a directory" as HAMi's monitor scans. Written here rather
//! than pulling a crate: about 100 lines, and the exporter needs only this.

use std::path::{Path, PathBuf};

/// At most this many directory entries are examined per expansion, so a mistaken
/// pattern over a huge tree stays bounded.
pub const MAX_ENTRIES: usize = 100_000;

/// Whether `s` contains a wildcard.
pub fn has_magic(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

/// Match one class `[...]` starting after `[`; returns (matched, bytes consumed incl. `]`).
fn match_class(p: &[u8], c: u8) -> Option<(bool, usize)> {
    let mut i = 0;
    let negate = matches!(p.first(), Some(b'!' | b'^'));
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == b']' && !first {
            return Some((matched != negate, i + 1));
        }
        first = false;
        let lo = p[i];
        if i + 2 < p.len() && p[i + 1] == b'-' && p[i + 2] != b']' {
            matched |= lo <= c && c <= p[i + 2];
            i += 3;
        } else {
            matched |= lo == c;
            i += 1;
        }
    }
    None // unterminated: `[` is literal
}

/// Whether `name` matches `pattern` (one path component).
pub fn matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    // Backtracking point of the last `*`: (pattern index after it, name index it covers to).
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        let step = match p.get(pi) {
            Some(b'*') => {
                star = Some((pi + 1, ni));
                pi += 1;
                continue;
            }
            Some(b'?') => Some(1),
            Some(b'[') => match match_class(&p[pi + 1..], n[ni]) {
                Some((true, used)) => Some(1 + used),
                Some((false, _)) => None,
                None => (n[ni] == b'[').then_some(1),
            },
            Some(b'\\') if pi + 1 < p.len() => (p[pi + 1] == n[ni]).then_some(2),
            Some(&c) => (c == n[ni]).then_some(1),
            None => None,
        };
        match step {
            Some(used) => {
                pi += used;
                ni += 1;
            }
            None => match star {
                Some((sp, sn)) => {
                    pi = sp;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Expand `pattern` to the regular files it matches, sorted. Hidden names match only a
/// component that starts with `.`; files named `libvgpu.so` are skipped (as the monitor does).
pub fn expand(pattern: &str) -> Result<Vec<PathBuf>, String> {
    if pattern.is_empty() {
        return Err("empty glob".into());
    }
    let mut frontier: Vec<PathBuf> = vec![if pattern.starts_with('/') {
        PathBuf::from("/")
    } else {
        PathBuf::new()
    }];
    let components: Vec<&str> = pattern.split('/').filter(|c| !c.is_empty()).collect();
    let mut budget = MAX_ENTRIES;
    for (i, comp) in components.iter().enumerate() {
        let last = i + 1 == components.len();
        let mut next = Vec::new();
        for dir in &frontier {
            if !has_magic(comp) {
                next.push(dir.join(comp));
                continue;
            }
            let read_from = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir.as_path()
            };
            let Ok(entries) = std::fs::read_dir(read_from) else {
                continue;
            };
            for entry in entries.flatten() {
                budget = budget.checked_sub(1).ok_or_else(|| {
                    format!(
                        "glob {pattern} examines more than {MAX_ENTRIES} entries; make it narrower"
                    )
                })?;
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if name.starts_with('.') && !comp.starts_with('.') {
                    continue;
                }
                if matches(comp, name) {
                    next.push(dir.join(name));
                }
            }
        }
        if !last {
            next.retain(|p| p.is_dir());
        }
        frontier = next;
    }
    frontier.retain(|p| p.is_file() && p.file_name().is_none_or(|n| n != crate::locate::HOOK_NAME));
    frontier.sort();
    frontier.dedup();
    Ok(frontier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_like_the_shell() {
        assert!(matches("*.cache", "a.cache"));
        assert!(matches("*.cache", ".cache"));
        assert!(!matches("*.cache", "a.cache.bak"));
        assert!(matches("a?c", "abc"));
        assert!(!matches("a?c", "ac"));
        assert!(matches("*", ""));
        assert!(matches("a*b*c", "aXXbYYc"));
        assert!(!matches("a*b*c", "aXXbYY"));
        assert!(matches("[ab]x", "bx"));
        assert!(!matches("[!ab]x", "bx"));
        assert!(matches("[a-c]1", "c1"));
        assert!(!matches("[a-c]1", "d1"));
        assert!(matches("[]]", "]"));
        assert!(matches("[", "["));
        assert!(matches("\\*", "*"));
        assert!(!matches("\\*", "a"));
        assert!(matches("**x", "abx"));
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
        assert!(
            expand(&format!("{}/none/*.cache", root.display()))
                .unwrap()
                .is_empty()
        );
        assert!(expand("").is_err());
    }
}
