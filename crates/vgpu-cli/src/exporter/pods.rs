//! Which pod and container a usage file belongs to, from the node's own layout.
//!
//! HAMi's device plugin gives each container the host directory
//! `<hook path>/containers/<pod UID>_<container>/` for its cache file (Volcano's plugin does the
//! same under `<hook path>/vgpu/containers/`), so the path alone names the pod UID and the
//! container. The namespace and pod name come from the kubelet's log directories
//! (`/var/log/pods/<namespace>_<pod>_<pod UID>/`, present for every pod the kubelet runs),
//! which needs neither API credentials nor network. Without them, `pod` is the UID and
//! `namespace` is empty: the series stay distinct and joinable, never silently dropped.

use std::collections::HashMap;
use std::path::Path;

/// Where the kubelet keeps per-pod log directories.
pub const DEFAULT_POD_LOGS: &str = "/var/log/pods";

/// At most this many entries of the pod-log directory are read per scrape.
const MAX_POD_DIRS: usize = 100_000;

/// The Kubernetes identity of one usage file; empty strings where unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Pod namespace (empty when no pod metadata was found).
    pub namespace: String,
    /// Pod name (the pod UID when no pod metadata was found).
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Pod UID.
    pub pod_uid: String,
}

/// `(pod UID, container)` from `.../containers/<pod UID>_<container>/<file>`, the layout of
/// HAMi's and Volcano's device plugins. Pod UIDs contain no `_` and container names are DNS
/// labels (no `_`), so the first `_` separates them.
pub fn container_of(cache: &Path) -> Option<(String, String)> {
    let dir = cache.parent()?;
    if dir.parent()?.file_name()? != "containers" {
        return None;
    }
    let (uid, container) = dir.file_name()?.to_str()?.split_once('_')?;
    (!uid.is_empty() && !container.is_empty()).then(|| (uid.to_owned(), container.to_owned()))
}

/// Pod UID → (namespace, pod name), from the kubelet's log directory names.
#[derive(Debug, Default)]
pub struct PodIndex {
    by_uid: HashMap<String, (String, String)>,
}

impl PodIndex {
    /// Read `dir` (`/var/log/pods`); a missing or unreadable directory gives an empty index.
    pub fn read(dir: &Path) -> Self {
        let mut by_uid = HashMap::new();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Self { by_uid };
        };
        for entry in entries.flatten().take(MAX_POD_DIRS) {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            // Namespaces and pod names are DNS names (no `_`); the UID is last.
            let mut parts = name.splitn(3, '_');
            if let (Some(ns), Some(pod), Some(uid)) = (parts.next(), parts.next(), parts.next()) {
                if !ns.is_empty() && !pod.is_empty() && !uid.is_empty() {
                    by_uid.insert(uid.to_owned(), (ns.to_owned(), pod.to_owned()));
                }
            }
        }
        Self { by_uid }
    }

    /// The identity of `cache`: from its directory and this index; `None` outside the
    /// plugins' layout (a workstation file: only the `cache` label names it).
    pub fn identify(&self, cache: &Path) -> Option<Identity> {
        let (uid, container) = container_of(cache)?;
        let (namespace, pod) = self
            .by_uid
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| (String::new(), uid.clone()));
        Some(Identity {
            namespace,
            pod,
            container,
            pod_uid: uid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b6d0a7e-3c1f-4f7e-9a51-2d3c4b5a6f70";

    #[test]
    fn the_plugin_layout_names_pod_uid_and_container() {
        let p = format!("/usr/local/vgpu/containers/{UID}_trainer/5f0e.cache");
        assert_eq!(
            container_of(Path::new(&p)),
            Some((UID.to_owned(), "trainer".to_owned()))
        );
        assert_eq!(container_of(Path::new("/tmp/cudevshr.cache")), None);
        assert_eq!(container_of(Path::new("/x/other/a_b/c.cache")), None);
        assert_eq!(
            container_of(Path::new("/x/containers/nounderscore/c.cache")),
            None
        );
    }

    #[test]
    fn pod_metadata_comes_from_the_kubelet_log_directories_else_the_uid() {
        let dir = crate::private_tempdir("vgpu-pods").unwrap();
        std::fs::create_dir(dir.path().join(format!("team-a_train-0_{UID}"))).unwrap();
        std::fs::create_dir(dir.path().join("junk")).unwrap();
        let index = PodIndex::read(dir.path());
        let p = format!("/h/containers/{UID}_main/x.cache");
        assert_eq!(
            index.identify(Path::new(&p)),
            Some(Identity {
                namespace: "team-a".into(),
                pod: "train-0".into(),
                container: "main".into(),
                pod_uid: UID.into(),
            })
        );
        let none = PodIndex::read(Path::new("/nonexistent/pods"));
        let id = none.identify(Path::new(&p)).unwrap();
        assert_eq!((id.namespace.as_str(), id.pod.as_str()), ("", UID));
    }
}
