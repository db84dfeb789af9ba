//! Text a tenant controls, made safe to show: the one place that decides how a name or a
//! string a tenant chose (the file names the exporter's glob matches, the `uuids[]` bytes of
//! its usage file, anything read from a file it can write) reaches a terminal, a metrics page
//! or a JSON document.
//!
//! Invariant: what leaves here holds no character a terminal or a line-based format acts on
//! rather than prints (C0 and C1 controls, DEL, the line and paragraph separators, the
//! bidirectional embeddings, overrides and isolates), and the escaping is one-to-one: each such
//! character becomes a backslash escape and a backslash becomes `\\`, so two different strings
//! never look the same. Bytes that are not UTF-8 were already replaced (U+FFFD) when the
//! string was made.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::path::Path;

/// Whether `c` is acted on rather than printed by a terminal or a line-based reader.
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// `s` with every [`is_unsafe`] character and every backslash escaped: `\\`, `\n`, `\r`,
/// `\t`, `\x1b` for the other ASCII controls and DEL, `\u{9b}` for the rest.
pub fn text(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c == '\\' || is_unsafe(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if is_unsafe(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// A path as [`text`] shows it (a name that is not UTF-8 shown with U+FFFD).
pub fn path(p: &Path) -> String {
    text(&p.to_string_lossy()).into_owned()
}

/// A JSON document with the characters JSON encoders leave raw but terminals act on (DEL, the
/// C1 controls, the separators and bidirectional controls) written as `\uXXXX` escapes: the
/// same document to a JSON reader, inert on a terminal. (Inside strings, encoders escape the
/// C0 controls; outside, JSON holds only ASCII, its whitespace included, which stays.)
pub fn json(doc: String) -> String {
    let raw = |c: char| is_unsafe(c) && !c.is_ascii_whitespace();
    if !doc.chars().any(raw) {
        return doc;
    }
    let mut out = String::with_capacity(doc.len() + 16);
    for c in doc.chars() {
        if raw(c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_become_escapes_and_plain_text_is_untouched() {
        assert!(matches!(
            text("GPU-5a1e5130 /x/ünï.cache"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            text("a\\b\"c\n\r\t\u{1b}]0;t\u{7}\u{7f}\u{85}\u{9b}\u{202e}\u{2028}\u{fffd}"),
            "a\\\\b\"c\\n\\r\\t\\x1b]0;t\\x07\\x7f\\u{85}\\u{9b}\\u{202e}\\u{2028}\u{fffd}"
        );
    }

    #[test]
    fn escaping_is_one_to_one() {
        // A name that spells an escape differs from the control it spells.
        assert_ne!(text("\u{1b}"), text("\\x1b"));
        assert_ne!(text("\n"), text("\\n"));
        for c in (0..=0x3000u32).filter_map(char::from_u32) {
            let shown = text(&c.to_string()).into_owned();
            assert!(!shown.chars().any(is_unsafe), "{c:?} shown as {shown:?}");
        }
    }

    #[test]
    fn json_keeps_its_meaning_and_loses_the_controls() {
        let value = serde_json::json!({"uuid": "G\u{1b}\u{7f}\u{9b}\u{202e}\n\"x"});
        for doc in [
            serde_json::to_string(&value).unwrap(),
            serde_json::to_string_pretty(&value).unwrap(),
        ] {
            let doc = json(doc);
            assert!(!doc.chars().any(|c| is_unsafe(c) && c != '\n'), "{doc}");
            let back: serde_json::Value = serde_json::from_str(&doc).unwrap();
            assert_eq!(back, value);
        }
    }
}
