//! vgpu under HAMi's DRA driver (Project-HAMi/k8s-dra-driver, `cmd/hami-kubelet-plugin/
//! hami_core.go`, feature gate `HAMiCoreSupport`), both of its layouts, on two simulated GPUs,
//! everything laid out as the driver and its chart lay it out:
//!
//! - the driver's DaemonSet mounts the host's `/usr/local/vgpu` and `/tmp` at the same paths
//!   and runs `/bin/bash -c "/usr/bin/vgpu-init.sh /usr/local/vgpu"` at postStart: here our
//!   installer, as the DRA image carries it, with the image's library in `/usr/local/lib/hami`;
//! - each GPU container gets the CDI edits of `GetCDIContainerEdits`: the cache directory
//!   bind-mounted read-write at its host path (`/usr/local/vgpu/claims/<claim UID>` at the
//!   driver's HEAD, `/usr/local/vgpu/containers/<pod UID>_<container>` with its PR #42),
//!   `/usr/local/vgpu/libvgpu.so` read-only, `/etc/ld.so.preload` from the host's
//!   `/usr/local/vgpu/ld.so.preload`, `/tmp/vgpulock` read-write; and the environment
//!   `CUDA_DEVICE_MEMORY_SHARED_CACHE`, `CUDA_DEVICE_SM_LIMIT_<idx>`,
//!   `CUDA_DEVICE_MEMORY_LIMIT_<idx>=<MiB>m`, where `idx` counts a Go map's iterations (here the
//!   order that puts the wrong GPU first);
//! - the node side (the exporter) sees the host paths, the kubelet's `/var/log/pods` and the
//!   driver's checkpoint (`/var/lib/kubelet/plugins/hami-core-gpu.project-hami.io/`).
//!
//! Each process runs in its own PID and mount namespace; the node's directories are one
//! scratch directory. Needs root (or user namespaces) for `unshare`.

mod common;
use common::*;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use vgpu_cli::http;
use vgpu_testkit::{built_library, compile_c};

const MIB: u64 = 1 << 20;
const U0: &str = "GPU-d7a00000-0000-4000-8000-000000000000";
const U1: &str = "GPU-d7a00000-0000-4000-8000-000000000001";

/// Allocates argv[1] MiB on device 0 and argv[2] MiB on device 1, then launches the
/// simulator's `spin` kernel on device 0 until killed; says `READY r0=<code> r1=<code>`.
const PROGRAM: &str = r#"
#include "standalone.h"
#include <unistd.h>
int main(int argc, char **argv) {
  if (argc < 3 || load_driver()) return 1;
  CUresult (*cuMemAlloc_v2)(unsigned long long *, size_t);
  NEED(cuMemAlloc_v2)
  CUresult r[2]; H ctx[2], mod, f, s; int dev; unsigned long long p;
  CHECK(cuInit(0));
  for (int d = 0; d < 2; d++) {
    CHECK(cuDeviceGet(&dev, d));
    CHECK(cuDevicePrimaryCtxRetain(&ctx[d], dev));
    CHECK(cuCtxSetCurrent(ctx[d]));
    r[d] = cuMemAlloc_v2(&p, strtoull(argv[d + 1], 0, 10) << 20);
  }
  CHECK(cuCtxSetCurrent(ctx[0]));
  CHECK(cuModuleLoadData(&mod, "vgpusim-module: spin"));
  CHECK(cuModuleGetFunction(&f, mod, "spin"));
  CHECK(cuStreamCreate(&s, 0));
  unsigned long long ns = 2000000; void *args[] = {&ns};
  for (long n = 0;; n++) {
    CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, 0));
    CHECK(cuStreamSynchronize(s));
    if (n == 20) { printf("READY pid=%d r0=%d r1=%d\n", (int)getpid(), r[0], r[1]); fflush(stdout); }
  }
}
"#;

/// Mounts the scratch node at /mnt/node (before anything covers /tmp, where it may live).
const NODE_AT_MNT: &str =
    "mount -t tmpfs tmpfs /mnt\nmkdir /mnt/node\nmount --bind \"$NODE\" /mnt/node\n";

/// The node: the host's directories under one scratch directory.
struct Node {
    sim: SimNode,
}

impl Node {
    fn new() -> Self {
        let sim = SimNode::new("vgpu-dra");
        let r = sim.dir.path();
        for d in [
            "usr/local/vgpu",
            "tmp",
            "pods",
            "plugins/hami-core-gpu.project-hami.io",
            "image/usr/local/lib/hami",
            "image/usr/bin",
            "driver-files",
        ] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        // Everything a container runs lies inside the node directory (real files, no links
        // out of it): the program, the simulated driver.
        let includes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vgpu-hook/tests/programs");
        compile_c(
            r,
            "program",
            PROGRAM,
            ["-O2", &format!("-I{}", includes.display())],
        );
        for entry in std::fs::read_dir(sim.driver()).unwrap().flatten() {
            let target = std::fs::canonicalize(entry.path()).unwrap();
            std::fs::copy(target, r.join("driver-files").join(entry.file_name())).unwrap();
        }
        // The DRA image: HAMi-core's place for the library (vgpu-init.sh's source) holds ours,
        // and our installer is its /usr/bin/vgpu-init.sh.
        std::fs::copy(
            built_library("libvgpu.so"),
            r.join("image/usr/local/lib/hami/libvgpu.so"),
        )
        .unwrap();
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/common/vgpu-install-lib.sh"),
            r.join("image/usr/bin/vgpu-init.sh"),
        )
        .unwrap();
        Node { sim }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.sim.path(p)
    }

    /// In namespaces of their own: the plugin pod's mounts and its postStart.
    fn post_start(&self) {
        let script = format!(
            "set -eu\n{NODE_AT_MNT}\
             mount --bind /mnt/node/tmp /tmp\n\
             mount -t tmpfs tmpfs /usr/local\n\
             mkdir -p /usr/local/vgpu /usr/local/lib/hami\n\
             mount --bind /mnt/node/usr/local/vgpu /usr/local/vgpu\n\
             mount --bind /mnt/node/image/usr/local/lib/hami /usr/local/lib/hami\n\
             /bin/bash -c '/mnt/node/image/usr/bin/vgpu-init.sh /usr/local/vgpu'\n"
        );
        let mut cmd = in_namespaces(&script);
        cmd.env("NODE", self.sim.dir.path())
            // The DRA image's ENV (deploy/hami-dra/Dockerfile).
            .env("VGPU_SOURCE_DIR", "/usr/local/lib/hami");
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "postStart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A GPU container with the driver's CDI edits: its cache directory `cache_dir` (a path
    /// under /usr/local/vgpu, the same on the host and inside), the driver's `env` and the
    /// pod's own; the program allocates `alloc` MiB on each of the two GPUs.
    fn start(
        &self,
        cache_dir: &str,
        cache: &str,
        env: &[(String, String)],
        alloc: [u64; 2],
    ) -> Container {
        let host_dir = self.path(&cache_dir[1..]);
        std::fs::create_dir_all(&host_dir).unwrap();
        let script = format!(
            r#"set -eu
{NODE_AT_MNT}mount -t tmpfs tmpfs /tmp
mkdir /tmp/vgpulock
mount --bind /mnt/node/tmp/vgpulock /tmp/vgpulock
mount -t tmpfs tmpfs /usr/local
mkdir -p '{cache_dir}'
mount --bind '/mnt/node{cache_dir}' '{cache_dir}'
touch /usr/local/vgpu/libvgpu.so
mount --bind /mnt/node/usr/local/vgpu/libvgpu.so /usr/local/vgpu/libvgpu.so
mount -o remount,bind,ro /usr/local/vgpu/libvgpu.so
if [ ! -e /etc/ld.so.preload ]; then
  etc="/mnt/node/etc-$CONTAINER"
  mkdir -p "$etc/orig" "$etc/view"
  mount --bind /etc "$etc/orig"
  for f in "$etc"/orig/* "$etc"/orig/.[!.]*; do [ -e "$f" ] && ln -s "$f" "$etc/view/"; done
  touch "$etc/view/ld.so.preload"
  mount --bind "$etc/view" /etc
fi
mount --bind /mnt/node/usr/local/vgpu/ld.so.preload /etc/ld.so.preload
mount -o remount,bind,ro /etc/ld.so.preload
export LD_LIBRARY_PATH=/mnt/node/driver-files
exec /mnt/node/program {} {}
"#,
            alloc[0], alloc[1]
        );
        let mut cmd = in_namespaces(&script);
        cmd.env("NODE", self.sim.dir.path())
            .env("CONTAINER", cache)
            .env(
                "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                format!("{cache_dir}/{cache}"),
            )
            .env("VGPU_SIM_DEVICE_COUNT", "2")
            .env("VGPU_SIM_UUIDS", format!("{U0},{U1}"))
            .env("VGPU_SIM_TOTAL_MEM", "8g")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("unshare (util-linux)");
        let lines = stdout_lines(&mut child);
        Container {
            unshare: Reaped(child),
            lines,
        }
    }
}

/// `unshare` running `script` in new PID and mount namespaces, with a clean environment.
fn in_namespaces(script: &str) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--pid",
        "--fork",
        "--kill-child",
        "--mount",
        "--propagation",
        "private",
        "--mount-proc",
        "sh",
        "-c",
        script,
    ]);
    cmd.env_clear().env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    cmd
}

struct Container {
    unshare: Reaped,
    lines: Receiver<String>,
}

impl Container {
    fn ready(&self) -> String {
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                if l.starts_with("READY") {
                    return l;
                }
                eprintln!("container: {l}");
            }
        }
        panic!("a container never became ready");
    }

    fn running(&mut self) -> bool {
        self.unshare.0.try_wait().unwrap().is_none()
    }
}

/// The environment `GetCDIContainerEdits` writes for a two-GPU claim, in its map order:
/// `idx` 0 is `first`'s limits, 1 is `second`'s.
fn dra_env(first: (u64, u32), second: (u64, u32)) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for (idx, (mib, sm)) in [first, second].into_iter().enumerate() {
        env.push((format!("CUDA_DEVICE_SM_LIMIT_{idx}"), sm.to_string()));
        env.push((format!("CUDA_DEVICE_MEMORY_LIMIT_{idx}"), format!("{mib}m")));
    }
    env
}

const CLAIM_A: &str = "c1a1a000-0000-4000-8000-00000000000a";
const CLAIM_B: &str = "c1a1b000-0000-4000-8000-00000000000b";
const POD_A: &str = "90d0a000-0000-4000-8000-00000000000a";
const POD_B: &str = "90d0b000-0000-4000-8000-00000000000b";

#[test]
fn both_dra_layouts_limit_the_right_gpus_and_the_node_sees_them_by_pod() {
    if !namespaces_permitted() {
        eprintln!(
            "SKIP: cannot create PID + mount namespaces here (unshare --pid --mount needs root \
             or user namespaces); the DRA container test did not run"
        );
        return;
    }
    let node = Node::new();
    node.post_start();
    // What the installer left on the host: the library, the preload naming it where the CDI
    // edits mount it, the turn directory.
    let lib = node.path("usr/local/vgpu/libvgpu.so");
    assert_eq!(
        std::fs::read(&lib).unwrap(),
        std::fs::read(built_library("libvgpu.so")).unwrap()
    );
    assert_eq!(
        std::fs::read_to_string(node.path("usr/local/vgpu/ld.so.preload")).unwrap(),
        "/usr/local/vgpu/libvgpu.so\n"
    );
    assert!(node.path("tmp/vgpulock").is_dir());

    // Claim A (the driver's HEAD: a claim directory). The scheduler gave GPU 0 512 MiB / 60%
    // and GPU 1 256 MiB / 30%; the map put GPU 1 first. The pod names both by UUID, in the
    // spelling that survives the `sh -c` (dash) this container starts through.
    let by_uuid =
        |kind: &str, uuid: &str| format!("CUDA_DEVICE_{kind}_LIMIT_{}", uuid.replace('-', "_"));
    let mut env_a = dra_env((256, 30), (512, 60));
    env_a.push((by_uuid("MEMORY", U0), "512m".into()));
    env_a.push((by_uuid("MEMORY", U1), "256m".into()));
    env_a.push((by_uuid("SM", U0), "60".into()));
    env_a.push((by_uuid("SM", U1), "30".into()));
    let dir_a = format!("/usr/local/vgpu/claims/{CLAIM_A}");
    let mut a = node.start(&dir_a, "5e0f.cache", &env_a, [400, 300]);
    // Claim B (PR #42: a container directory), the same map order, indices only.
    let dir_b = format!("/usr/local/vgpu/containers/{POD_B}_server");
    let b = node.start(
        &dir_b,
        &format!("{CLAIM_B}.cache"),
        &dra_env((512, 60), (256, 30)),
        [300, 200],
    );
    let (ra, rb) = (a.ready(), b.ready());
    // A: each GPU under its own limit: 400 of 512 fits on GPU 0, 300 of 256 not on GPU 1.
    assert!(ra.contains("r0=0 r1=2"), "A: {ra}");
    // B: which index is whose is unknown, so both GPUs get the smaller (256 MiB): 300 MiB
    // does not fit on GPU 0, 200 does on GPU 1.
    assert!(rb.contains("r0=2 r1=0"), "B: {rb}");

    // The node: the kubelet's pod directories and the driver's checkpoint for claim A.
    std::fs::create_dir_all(node.path(&format!("pods/team-a_train-a_{POD_A}/main"))).unwrap();
    std::fs::create_dir_all(node.path(&format!("pods/team-b_infer-b_{POD_B}/server"))).unwrap();
    let checkpoint = node.path("plugins/hami-core-gpu.project-hami.io/checkpoint.json");
    std::fs::write(
        &checkpoint,
        format!(
            r#"{{"checksum":0,"v2":{{"checksum":0,"preparedClaims":{{"{CLAIM_A}":{{"checkpointState":"PrepareCompleted","status":{{"reservedFor":[{{"resource":"pods","name":"train-a","uid":"{POD_A}"}}]}}}}}}}}}}"#
        ),
    )
    .unwrap();
    let mut cmd = vgpu();
    cmd.env("VGPU_TURN_DIR", node.path("tmp/vgpulock"));
    let exporter = Exporter::start(
        cmd,
        &[
            "--per-process",
            "--pod-logs",
            node.path("pods").to_str().unwrap(),
            "--dra-checkpoint",
            checkpoint.to_str().unwrap(),
            "--cache",
            // Both layouts: claims/<claim>/ and containers/<pod>_<container>/.
            &format!("{}/*/*/*.cache", node.path("usr/local/vgpu").display()),
        ],
    );
    let scrape = || {
        parse_metrics(
            &http::get(&exporter.addr, "/metrics", Duration::from_secs(5))
                .unwrap()
                .1,
        )
    };
    let pod_a = [
        ("namespace", "team-a"),
        ("pod", "train-a"),
        ("container", "main"),
    ];
    let pod_b = [
        ("namespace", "team-b"),
        ("pod", "infer-b"),
        ("container", "server"),
    ];
    let on = |pod: &[(&'static str, &'static str)], uuid: &'static str| {
        let mut l = pod.to_vec();
        l.push(("device_uuid", uuid));
        l
    };
    let s = scrape();
    let limit = |pod, uuid| metric_value(&s, "hami_vgpu_memory_limit_bytes", &on(pod, uuid));
    assert_eq!(limit(&pod_a, U0), Some((512 * MIB) as f64));
    assert_eq!(limit(&pod_a, U1), Some((256 * MIB) as f64));
    assert_eq!(limit(&pod_b, U0), Some((256 * MIB) as f64));
    assert_eq!(limit(&pod_b, U1), Some((256 * MIB) as f64));
    let used = |pod, uuid| metric_value(&s, "hami_vgpu_memory_used_bytes", &on(pod, uuid));
    // Each container's usage under its pod, on the GPU it used (the context's own memory
    // may be charged on top).
    let used_mib = |pod, uuid| used(pod, uuid).map(|b| b / MIB as f64);
    assert!(
        used_mib(&pod_a, U0).is_some_and(|m| (400.0..512.0).contains(&m)),
        "{:?}",
        used_mib(&pod_a, U0)
    );
    assert!(
        used_mib(&pod_b, U1).is_some_and(|m| (200.0..256.0).contains(&m)),
        "{:?}",
        used_mib(&pod_b, U1)
    );
    let mut alive = pod_a.to_vec();
    alive.push(("pid", "1"));
    assert_eq!(metric_value(&s, "vgpu_process_alive", &alive), Some(1.0));
    assert_eq!(metric_value(&s, "vgpu_exporter_files", &[]), Some(2.0));
    // Both containers meet on GPU 0's one board in the shared /tmp/vgpulock.
    let mut board = pod_a.to_vec();
    board.push(("uuid", U0));
    let end = Instant::now() + Duration::from_secs(10);
    let mut s = s;
    while metric_value(&s, "vgpu_device_turn_containers", &board) != Some(2.0)
        && Instant::now() < end
    {
        std::thread::sleep(Duration::from_millis(200));
        s = scrape();
    }
    assert_eq!(
        metric_value(&s, "vgpu_device_turn_containers", &board),
        Some(2.0)
    );

    // An upgrade while they run: the postStart installs a changed library by rename. The
    // running containers keep the inode their bind mount pins and run on.
    let before = std::fs::metadata(&lib).unwrap().ino();
    let mut changed = std::fs::read(built_library("libvgpu.so")).unwrap();
    changed.extend_from_slice(b"\0vgpu-next");
    std::fs::write(node.path("image/usr/local/lib/hami/libvgpu.so"), &changed).unwrap();
    node.post_start();
    assert_ne!(
        std::fs::metadata(&lib).unwrap().ino(),
        before,
        "renamed, not rewritten"
    );
    assert_eq!(std::fs::read(&lib).unwrap(), changed);
    std::thread::sleep(Duration::from_millis(500));
    assert!(a.running(), "a running container survives the upgrade");
    let s = scrape();
    assert_eq!(metric_value(&s, "vgpu_process_alive", &alive), Some(1.0));
    let _ = b;
}
