//! Which pod and container a usage file belongs to, from the node's own layout.
//!
//! HAMi's device plugin gives each container the host directory
//! `<hook path>/containers/<pod UID>_<container>/` for its cache file (Volcano's plugin does the
//! same under `<hook path>/vgpu/containers/`, HAMi's DRA driver with its PR #42 under
//! `/usr/local/vgpu/containers/`), so the path alone names the pod UID and the container. The
//! namespace and pod name come from the kubelet's log directories
//! (`/var/log/pods/<namespace>_<pod>_<pod UID>/`, present for every pod the kubelet runs),
//! which needs neither API credentials nor network. Without them, `pod` is the UID and
//! `namespace` is empty: the series stay distinct and joinable, never silently dropped.
//!
//! HAMi's DRA driver without that PR names a claim instead: `/usr/local/vgpu/claims/<claim
//! UID>/<uuid>.cache`. Which pod holds the claim is in the driver's own checkpoint
//! (`/var/lib/kubelet/plugins/<driver>/checkpoint.json`: each prepared claim's status lists the
//! pod it is reserved for, by name and UID); the container is the pod's only one when its log
//! directory names one, else unknown (empty). Without the checkpoint, `pod` is the claim UID.
//! The same checkpoint resolves PR #42's fallback directory (`<claim UID>_unknown`, used when
//! the driver could not find the pod).

use std::collections::HashMap;
use std::path::Path;

/// At most this many entries of the pod-log directory are read per scrape.
const MAX_POD_DIRS: usize = 100_000;

/// At most this many bytes of the driver's checkpoint are read (it holds one entry per claim
/// prepared on the node).
const MAX_CHECKPOINT_BYTES: u64 = 32 << 20;

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

/// The claim UID from `.../vgpu/claims/<claim UID>/<file>`, the layout of HAMi's DRA driver.
pub fn claim_of(cache: &Path) -> Option<String> {
    let dir = cache.parent()?;
    let claims = dir.parent()?;
    if claims.file_name()? != "claims" || claims.parent()?.file_name()? != "vgpu" {
        return None;
    }
    let uid = dir.file_name()?.to_str()?;
    (!uid.is_empty()).then(|| uid.to_owned())
}

/// A pod a claim is reserved for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ClaimPod {
    name: String,
    uid: String,
}

/// Claim UID → the pod it is reserved for, from the DRA driver's checkpoint text (its `v2`
/// and older `v1` forms: `preparedClaims.<claim UID>.status.reservedFor[]`, the entry whose
/// `resource` is `pods`). Anything else in the file is ignored; unreadable text gives nothing.
fn claims_of_checkpoint(text: &str) -> HashMap<String, ClaimPod> {
    let mut out = HashMap::new();
    let Ok(doc) = serde_json::from_str::<serde_json::Value>(text) else {
        return out;
    };
    for version in ["v1", "v2"] {
        let Some(claims) = doc[version]["preparedClaims"].as_object() else {
            continue;
        };
        for (claim, entry) in claims {
            let pods = entry["status"]["reservedFor"].as_array();
            let pod = pods.into_iter().flatten().find(|r| r["resource"] == "pods");
            // Names become a path below the log directory: plain names only.
            let plain = |s: &str| !s.is_empty() && !s.starts_with('.') && !s.contains('/');
            if let Some((Some(name), Some(uid))) =
                pod.map(|p| (p["name"].as_str(), p["uid"].as_str()))
                && plain(name)
                && plain(uid)
            {
                out.insert(
                    claim.clone(),
                    ClaimPod {
                        name: name.to_owned(),
                        uid: uid.to_owned(),
                    },
                );
            }
        }
    }
    out
}

/// Pod UID → (namespace, pod name), from the kubelet's log directory names; claim UID → pod,
/// from the DRA driver's checkpoint.
#[derive(Debug, Default)]
pub struct PodIndex {
    by_uid: HashMap<String, (String, String)>,
    claims: HashMap<String, ClaimPod>,
    logs: std::path::PathBuf,
}

impl PodIndex {
    /// Read `dir` (`/var/log/pods`) and, when given, the DRA driver's `checkpoint`; a missing
    /// or unreadable one gives an empty index.
    pub fn read(dir: &Path, checkpoint: Option<&Path>) -> Self {
        let claims = checkpoint
            .and_then(|p| std::fs::File::open(p).ok())
            .and_then(|f| {
                let mut text = String::new();
                std::io::Read::read_to_string(
                    &mut std::io::Read::take(f, MAX_CHECKPOINT_BYTES),
                    &mut text,
                )
                .ok()
                .map(|_| text)
            })
            .map(|t| claims_of_checkpoint(&t))
            .unwrap_or_default();
        let mut by_uid = HashMap::new();
        let logs = dir.to_path_buf();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Self {
                by_uid,
                claims,
                logs,
            };
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
        Self {
            by_uid,
            claims,
            logs,
        }
    }

    /// The identity of `cache`: from its directory and this index; `None` outside the
    /// plugins' layout (a workstation file: only the `cache` label names it).
    pub fn identify(&self, cache: &Path) -> Option<Identity> {
        if let Some((uid, container)) = container_of(cache) {
            // PR #42's directory for a claim whose pod the driver could not find.
            if !self.by_uid.contains_key(&uid) && container == "unknown" {
                if let Some(pod) = self.claims.get(&uid) {
                    return Some(self.of_claim_pod(pod));
                }
            }
            let (namespace, pod) = self
                .by_uid
                .get(&uid)
                .cloned()
                .unwrap_or_else(|| (String::new(), uid.clone()));
            return Some(Identity {
                namespace,
                pod,
                container,
                pod_uid: uid,
            });
        }
        let claim = claim_of(cache)?;
        Some(match self.claims.get(&claim) {
            Some(pod) => self.of_claim_pod(pod),
            None => Identity {
                pod: claim,
                ..Identity::default()
            },
        })
    }

    /// The identity of a claim's pod: its namespace from the log directories, its container
    /// when the pod has exactly one (its log directory lists one per container).
    fn of_claim_pod(&self, pod: &ClaimPod) -> Identity {
        let namespace = self
            .by_uid
            .get(&pod.uid)
            .map(|(ns, _)| ns.clone())
            .unwrap_or_default();
        let dir = self
            .logs
            .join(format!("{namespace}_{}_{}", pod.name, pod.uid));
        let mut containers = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .take(2)
            .filter_map(|e| e.file_name().into_string().ok());
        let container = match (containers.next(), containers.next()) {
            (Some(only), None) if !namespace.is_empty() => only,
            _ => String::new(),
        };
        Identity {
            namespace,
            pod: pod.name.clone(),
            container,
            pod_uid: pod.uid.clone(),
        }
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
        let index = PodIndex::read(dir.path(), None);
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
        let none = PodIndex::read(Path::new("/nonexistent/pods"), None);
        let id = none.identify(Path::new(&p)).unwrap();
        assert_eq!((id.namespace.as_str(), id.pod.as_str()), ("", UID));
    }

    const CLAIM: &str = "7d2c1b0a-1111-4222-8333-444455556666";

    /// The HAMi DRA driver's checkpoint for one claim reserved for pod `pod`/`uid`.
    fn checkpoint(pod: &str, uid: &str) -> String {
        format!(
            r#"{{"checksum":1,"v1":{{}},"v2":{{"checksum":2,"preparedClaims":{{"{CLAIM}":{{"checkpointState":"PrepareCompleted","status":{{"allocation":{{"devices":{{"results":[]}}}},"reservedFor":[{{"resource":"pods","name":"{pod}","uid":"{uid}"}}]}},"preparedDevices":[]}}}}}}}}"#
        )
    }

    #[test]
    fn a_claim_directory_names_its_claim() {
        let p = format!("/usr/local/vgpu/claims/{CLAIM}/1f0e.cache");
        assert_eq!(claim_of(Path::new(&p)), Some(CLAIM.to_owned()));
        assert_eq!(container_of(Path::new(&p)), None);
        assert_eq!(
            claim_of(Path::new("/x/claims/a/b.cache")),
            None,
            "not under vgpu/"
        );
        assert_eq!(claim_of(Path::new("/usr/local/vgpu/a.cache")), None);
    }

    #[test]
    fn the_checkpoint_maps_claims_to_pods_and_ignores_the_rest() {
        let claims = claims_of_checkpoint(&checkpoint("train-0", UID));
        assert_eq!(
            claims.get(CLAIM),
            Some(&ClaimPod {
                name: "train-0".into(),
                uid: UID.into()
            })
        );
        assert!(claims_of_checkpoint("not json").is_empty());
        assert!(
            claims_of_checkpoint(r#"{"v2":{"preparedClaims":{"c":{"status":{}}}}}"#).is_empty()
        );
        // A v1-only checkpoint (older drivers) has the same status.
        let v1 = checkpoint("train-0", UID).replace(r#""v1":{},"v2""#, r#""v0":{},"v1""#);
        assert_eq!(claims_of_checkpoint(&v1).len(), 1);
        // A name that would leave the log directory is not taken.
        assert!(claims_of_checkpoint(&checkpoint("../x", UID)).is_empty());
        assert!(claims_of_checkpoint(&checkpoint("a/b", UID)).is_empty());
    }

    #[test]
    fn a_claims_pod_comes_from_the_checkpoint_and_its_container_from_the_logs() {
        let dir = crate::private_tempdir("vgpu-pods").unwrap();
        let logs = dir.path().join("pods");
        let pod_dir = logs.join(format!("team-a_train-0_{UID}"));
        std::fs::create_dir_all(pod_dir.join("main")).unwrap();
        let cp = dir.path().join("checkpoint.json");
        std::fs::write(&cp, checkpoint("train-0", UID)).unwrap();
        let cache = format!("/usr/local/vgpu/claims/{CLAIM}/1f0e.cache");
        let want = Identity {
            namespace: "team-a".into(),
            pod: "train-0".into(),
            container: "main".into(),
            pod_uid: UID.into(),
        };
        let index = PodIndex::read(&logs, Some(&cp));
        assert_eq!(index.identify(Path::new(&cache)), Some(want.clone()));
        // PR #42's fallback directory for the same claim.
        let fallback = format!("/usr/local/vgpu/containers/{CLAIM}_unknown/{CLAIM}.cache");
        assert_eq!(index.identify(Path::new(&fallback)), Some(want.clone()));
        // Two containers: which one holds the claim is unknown.
        std::fs::create_dir(pod_dir.join("sidecar")).unwrap();
        let id = PodIndex::read(&logs, Some(&cp))
            .identify(Path::new(&cache))
            .unwrap();
        assert_eq!((id.pod.as_str(), id.container.as_str()), ("train-0", ""));
        // Without the checkpoint the claim UID stands for the pod: distinct, never dropped.
        let id = PodIndex::read(&logs, None)
            .identify(Path::new(&cache))
            .unwrap();
        assert_eq!((id.namespace.as_str(), id.pod.as_str()), ("", CLAIM));
    }
}
