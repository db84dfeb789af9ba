//! Which usage files a `--cache` pattern names: the maintained `glob` crate's matching
//! (`*`, `?`, `[abc]`, `[!a-z]`, `**`), bounded, and without the library HAMi's monitor also
//! skips.

use std::path::PathBuf;

/// At most this many files are taken per expansion, so a mistaken pattern over a huge tree
/// stays bounded (a node runs at most a few hundred containers).
pub const MAX_MATCHES: usize = 10_000;

/// Whether `s` contains a wildcard.
pub fn has_magic(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

/// The options every expansion uses: `*` does not match a leading `.` (hidden entries, as in
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

/// The regular files `pattern` matches, sorted. Files whose name contains `libvgpu.so` are
/// skipped (the monitor does the same: the library sits beside the cache files).
pub fn expand(pattern: &str) -> Result<Vec<PathBuf>, String> {
    if pattern.is_empty() {
        return Err("empty glob".into());
    }
    let paths = glob::glob_with(pattern, OPTIONS).map_err(|e| format!("glob {pattern}: {e}"))?;
    let mut out = Vec::new();
    // Unreadable directories are skipped, as the shell does.
    for path in paths.flatten() {
        let is_library = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains(crate::locate::HOOK_NAME));
        if is_library || !path.is_file() {
            continue;
        }
        if out.len() == MAX_MATCHES {
            return Err(format!(
                "glob {pattern} matches more than {MAX_MATCHES} files; make it narrower"
            ));
        }
        out.push(path);
    }
    out.sort();
    Ok(out)
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
    }
}
