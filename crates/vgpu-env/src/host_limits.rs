//! What the host lets a process pin, read from the texts the kernel publishes (the reading
//! itself is the caller's: this crate does no I/O). Host-backed device memory
//! (docs/oversubscription.md) is pinned: it counts against the container's memory cgroup, and
//! a driver may also hold it to `RLIMIT_MEMLOCK`.

/// Bytes the memory cgroup still allows, from its limit and usage files (cgroup v2
/// `memory.max` and `memory.current`, or v1 `memory.limit_in_bytes` and
/// `memory.usage_in_bytes`); `None` when unlimited or unreadable. Past its limit the kernel's
/// OOM killer ends the container rather than refusing a pin, so a spill must stay inside it.
pub fn cgroup_headroom(max: &str, current: &str) -> Option<u64> {
    let max = max.trim();
    if max == "max" {
        return None;
    }
    let max: u64 = max.parse().ok()?;
    // v1 writes "unlimited" as a huge page-rounded number.
    if max >= (1 << 62) {
        return None;
    }
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Where the memory cgroup's limit and usage files of a process are, from its
/// `/proc/self/cgroup` text: `(limit file, usage file)` under `/sys/fs/cgroup`.
pub fn cgroup_memory_files(proc_self_cgroup: &str) -> Option<(String, String)> {
    for line in proc_self_cgroup.lines() {
        // "0::/path" (v2) or "N:memory,…:/path" (v1).
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_end_matches('/');
        if controllers.is_empty() {
            let dir = format!("/sys/fs/cgroup{path}");
            return Some((format!("{dir}/memory.max"), format!("{dir}/memory.current")));
        }
        if controllers.split(',').any(|c| c == "memory") {
            let dir = format!("/sys/fs/cgroup/memory{path}");
            return Some((
                format!("{dir}/memory.limit_in_bytes"),
                format!("{dir}/memory.usage_in_bytes"),
            ));
        }
    }
    None
}

/// The soft `RLIMIT_MEMLOCK` in bytes from a `/proc/self/limits` text; `None` when unlimited
/// or not found.
pub fn memlock_soft_limit(proc_self_limits: &str) -> Option<u64> {
    let line = proc_self_limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let soft = line["Max locked memory".len()..]
        .split_whitespace()
        .next()?;
    soft.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_headroom_reads_both_versions_and_unlimited() {
        assert_eq!(cgroup_headroom("max\n", "123\n"), None);
        assert_eq!(cgroup_headroom("1000\n", "300\n"), Some(700));
        assert_eq!(cgroup_headroom("1000", "3000"), Some(0));
        assert_eq!(
            cgroup_headroom("9223372036854771712\n", "5"),
            None,
            "v1 unlimited"
        );
        assert_eq!(cgroup_headroom("garbage", "5"), None);
    }

    #[test]
    fn cgroup_files_of_v2_and_v1() {
        assert_eq!(
            cgroup_memory_files("0::/kubepods/pod1/c2\n"),
            Some((
                "/sys/fs/cgroup/kubepods/pod1/c2/memory.max".into(),
                "/sys/fs/cgroup/kubepods/pod1/c2/memory.current".into()
            ))
        );
        assert_eq!(
            cgroup_memory_files("0::/\n"),
            Some((
                "/sys/fs/cgroup/memory.max".into(),
                "/sys/fs/cgroup/memory.current".into()
            ))
        );
        let v1 = "12:cpu,cpuacct:/docker/x\n4:memory:/docker/x\n";
        assert_eq!(
            cgroup_memory_files(v1).unwrap().0,
            "/sys/fs/cgroup/memory/docker/x/memory.limit_in_bytes"
        );
        assert_eq!(cgroup_memory_files("5:cpu:/x\n"), None);
    }

    #[test]
    fn memlock_from_proc_limits() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max locked memory         8388608              8388608              bytes     \n";
        assert_eq!(memlock_soft_limit(text), Some(8 << 20));
        let unlimited =
            "Max locked memory         unlimited            unlimited            bytes\n";
        assert_eq!(memlock_soft_limit(unlimited), None);
    }
}
