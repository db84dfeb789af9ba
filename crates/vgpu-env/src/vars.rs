//! A snapshot of environment variables: what the parser reads. The parser never reads the
//! process itself, so the hook decides where values come from and tests stay pure; and it
//! sees every name, so a misspelt per-device variable can be refused rather than ignored.

use std::collections::BTreeMap;
use std::ffi::OsString;

/// Variables by name, as the program will see them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vars(BTreeMap<String, String>);

impl Vars {
    /// Literal pairs (tests, the demo, a computed environment); a later pair wins.
    pub fn from_pairs<K, V>(pairs: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
    {
        Self(
            pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }

    /// The process environment as `std::env::vars_os()` gives it (which, unlike
    /// `std::env::vars()`, never panics). A name that is not UTF-8 cannot be one of ours
    /// and is skipped; a value that is not UTF-8 is kept lossily, so a limit written in
    /// another encoding is reported as bad instead of being taken as unset.
    pub fn from_os(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Self {
        Self(
            vars.into_iter()
                .filter_map(|(k, v)| {
                    Some((k.into_string().ok()?, v.to_string_lossy().into_owned()))
                })
                .collect(),
        )
    }

    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// Sets `name` (as an exec with this variable would).
    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.0.insert(name.into(), value.into());
    }

    /// Removes `name`.
    pub fn remove(&mut self, name: &str) {
        self.0.remove(name);
    }

    /// Every variable whose name starts with `prefix`, in name order.
    pub fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> {
        self.0
            .range(prefix.to_owned()..)
            .take_while(move |(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_lists_only_matching_names_in_order() {
        let vars = Vars::from_pairs([
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/x"),
            ("CUDA_DEVICE_MEMORY_LIMIT_16", "3g"),
        ]);
        let got: Vec<&str> = vars
            .with_prefix("CUDA_DEVICE_MEMORY_LIMIT_")
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            got,
            ["CUDA_DEVICE_MEMORY_LIMIT_1", "CUDA_DEVICE_MEMORY_LIMIT_16"]
        );
    }

    #[test]
    fn os_values_that_are_not_utf8_stay_visible() {
        use std::os::unix::ffi::OsStringExt;
        let vars = Vars::from_os([
            (OsString::from("A"), OsString::from_vec(vec![b'4', 0xff])),
            (OsString::from_vec(vec![0xfe]), OsString::from("x")),
        ]);
        assert_eq!(vars.get("A"), Some("4\u{fffd}"));
        assert_eq!(vars.with_prefix("").count(), 1);
    }
}
