//! Two "containers" on one simulated GPU, laid out exactly as HAMi's device plugin lays them
//! out (pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go, Allocate), read by the
//! node side from the host layout.
//!
//! Each container is a process in its own PID and mount namespace (`unshare`), seeing:
//! - `/usr/local/vgpu` = the host's `<root>/containers/<pod UID>_<container>/` (read-write),
//!   with `libvgpu.so` bind-mounted read-only at `/usr/local/vgpu/libvgpu.so` (the runtime
//!   creates that mount point as an empty file in the host directory, which is why the monitor
//!   skips files named libvgpu.so);
//! - `/tmp/vgpulock` = the node's one turn directory (`<root>/vgpulock`), shared by every
//!   container; the namespace's `/tmp` is links to the host's entries plus that mount point,
//!   so the test needs no `/tmp/vgpulock` on the host and never makes or covers one;
//! - the preload through `/etc/ld.so.preload`, bind-mounted read-only from the node's
//!   `ld.so.preload` naming `/usr/local/vgpu/libvgpu.so` (where the host has no
//!   `/etc/ld.so.preload` to mount over, the namespace's `/etc` becomes links to the host's
//!   plus that one file, the same way: never a change on the host);
//! - `CUDA_DEVICE_MEMORY_LIMIT_0=<MiB>m`, `CUDA_DEVICE_SM_LIMIT`,
//!   `CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/<uuid>.cache`.
//!
//! The node side (`vgpu exporter`, `vgpu status`) sees only the host paths. Needs root (or
//! user namespaces) for `unshare`; skips with a message where that is not permitted.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use vgpu_cli::http;
use vgpu_testkit::compile_c;

const MIB: u64 = 1 << 20;
/// The one simulated GPU both containers are given (the simulator models one per process; the
/// shared UUID is what puts both on one turn board, as on a real GPU).
const GPU: &str = "GPU-5a1e5130-0000-4000-8000-0000000c0de0";
const CTX: u64 = 32 * MIB;

/// Allocates ALLOC MiB (must succeed), then OVER MiB more (must be refused: the limit), then
/// launches the simulator's 2 ms `spin` kernel back to back until killed.
const PROGRAM: &str = r#"
#include "standalone.h"
#include <unistd.h>
int main(int argc, char **argv) {
  if (argc < 3) return 1;
  unsigned long long alloc = strtoull(argv[1], 0, 10) << 20, over = strtoull(argv[2], 0, 10) << 20;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 3; }
  CUresult (*cuInit)(unsigned); CUresult (*cuDeviceGet)(int *, int);
  CUresult (*cuDevicePrimaryCtxRetain)(H *, int); CUresult (*cuCtxSetCurrent)(H);
  CUresult (*cuMemAlloc_v2)(unsigned long long *, size_t);
  CUresult (*cuModuleLoadData)(H *, const void *); CUresult (*cuModuleGetFunction)(H *, H, const char *);
  CUresult (*cuStreamCreate)(H *, unsigned); CUresult (*cuStreamSynchronize)(H);
  CUresult (*cuLaunchKernel)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, H, void **, void **);
  NEED(cuInit) NEED(cuDeviceGet) NEED(cuDevicePrimaryCtxRetain) NEED(cuCtxSetCurrent)
  NEED(cuMemAlloc_v2) NEED(cuModuleLoadData) NEED(cuModuleGetFunction) NEED(cuStreamCreate)
  NEED(cuStreamSynchronize) NEED(cuLaunchKernel)
  int dev; H ctx, mod, f, s; unsigned long long a, b;
  CHECK(cuInit(0)); CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev)); CHECK(cuCtxSetCurrent(ctx));
  CUresult first = cuMemAlloc_v2(&a, alloc);
  CUresult second = cuMemAlloc_v2(&b, over);
  CHECK(cuModuleLoadData(&mod, "vgpusim-module: spin"));
  CHECK(cuModuleGetFunction(&f, mod, "spin"));
  CHECK(cuStreamCreate(&s, 0));
  unsigned long long ns = 2000000; void *args[] = {&ns};
  for (long n = 0;; n++) {
    CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, 0));
    CHECK(cuStreamSynchronize(s));
    if (n == 20) {
      printf("READY pid=%d first=%d second=%d\n", (int)getpid(), first, second);
      fflush(stdout);
    }
  }
}
"#;

/// One HAMi-style container: its pod, its limits, its process.
struct Container {
    unshare: Reaped,
    lines: Receiver<String>,
    dir: PathBuf,
}

impl Container {
    fn ready(&mut self) -> String {
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.starts_with("READY") => return l,
                Ok(l) => eprintln!("container: {l}"),
                Err(_) => {
                    if let Some(status) = self.unshare.0.try_wait().unwrap() {
                        // Its setup failed (a mount, said above on stderr): no need to
                        // wait the bound out.
                        panic!(
                            "container {} exited ({status}) before it was ready",
                            self.dir.display()
                        );
                    }
                    // Stdout closed while it still runs: poll, do not spin.
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        panic!("container {} never became ready", self.dir.display());
    }

    /// Kill the container: SIGKILL to `unshare` takes its namespace's init with it
    /// (`--kill-child`), and with the init every process of the PID namespace.
    fn kill(&mut self) {
        self.unshare.kill();
    }
}

/// The node: host directories and the built program on a [`SimNode`] (the hook and the
/// simulated driver, which the NVIDIA runtime would mount as the driver).
struct Node {
    sim: SimNode,
    program: PathBuf,
}

impl Node {
    fn new() -> Self {
        let sim = SimNode::new("vgpu-node");
        let r = sim.dir.path();
        for d in ["containers", "pods", "vgpulock"] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        let includes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vgpu-hook/tests/programs");
        let program = compile_c(
            r,
            "program",
            PROGRAM,
            ["-O2", &format!("-I{}", includes.display())],
        );
        Node { sim, program }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.sim.path(p)
    }

    /// Start a container of pod `ns/pod` (UID `uid`), container `ctr`, with the plugin's
    /// environment for `memory_mib` and `sm`; its program allocates `alloc` then `over` MiB.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        ns: &str,
        pod: &str,
        uid: &str,
        ctr: &str,
        memory_mib: u64,
        sm: u32,
        alloc: u64,
        over: u64,
    ) -> Container {
        std::fs::create_dir_all(self.path(&format!("pods/{ns}_{pod}_{uid}"))).unwrap();
        let dir = self.path(&format!("containers/{uid}_{ctr}"));
        std::fs::create_dir_all(&dir).unwrap();
        let preload_file = dir.join("../..").join(format!("preload-{uid}"));
        std::fs::write(&preload_file, "/usr/local/vgpu/libvgpu.so\n").unwrap();
        // Inside the new mount namespace (private propagation): the plugin's mounts. A tmpfs
        // over /usr/local gives a /usr/local/vgpu mount point without touching the host's.
        let script = format!(
            r#"set -eu
mount -t tmpfs tmpfs /usr/local
# with_own DIR NAME KIND: this namespace's DIR becomes links to the host's entries (but
# NAME), plus an empty NAME of its own (KIND file or dir) to mount over: never a change on
# the host, whatever it holds there. (/usr/local is this namespace's own tmpfs.)
with_own() {{
  orig="/usr/local/.orig$1"; view="/usr/local/.view$1"
  mkdir -p "$orig" "$view"
  mount --bind "$1" "$orig"
  for f in "$orig"/* "$orig"/.[!.]*; do
    if [ -e "$f" ] && [ "${{f##*/}}" != "$2" ]; then ln -s "$f" "$view/"; fi
  done
  if [ "$3" = dir ]; then mkdir "$view/$2"; else touch "$view/$2"; fi
  mount --bind "$view" "$1"
}}
mkdir -p /usr/local/vgpu
mount --bind '{dir}' /usr/local/vgpu
touch /usr/local/vgpu/libvgpu.so
mount --bind '{hook}' /usr/local/vgpu/libvgpu.so
mount -o remount,bind,ro /usr/local/vgpu/libvgpu.so
with_own /tmp vgpulock dir
mount --bind '{lock}' /tmp/vgpulock
[ -e /etc/ld.so.preload ] || with_own /etc ld.so.preload file
mount --bind '{preload}' /etc/ld.so.preload
mount -o remount,bind,ro /etc/ld.so.preload
exec '{program}' {alloc} {over}
"#,
            dir = dir.display(),
            hook = self.sim.hook.display(),
            lock = self.path("vgpulock").display(),
            preload = preload_file.display(),
            program = self.program.display(),
        );
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
            &script,
        ]);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LD_LIBRARY_PATH", self.sim.driver())
            .env("CUDA_DEVICE_MEMORY_LIMIT_0", format!("{memory_mib}m"))
            .env("CUDA_DEVICE_SM_LIMIT", sm.to_string())
            .env(
                "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                format!("/usr/local/vgpu/{uid}-cache.cache"),
            )
            .env("VGPU_SIM_UUIDS", GPU)
            .env("VGPU_SIM_CTX_OVERHEAD", CTX.to_string())
            .env("VGPU_SIM_TOTAL_MEM", "8g")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut unshare = cmd.spawn().expect("unshare (util-linux)");
        let lines = stdout_lines(&mut unshare);
        Container {
            unshare: Reaped(unshare),
            lines,
            dir,
        }
    }
}

const UID_A: &str = "3f2a0c4e-0000-4000-8000-00000000000a";
const UID_B: &str = "3f2a0c4e-0000-4000-8000-00000000000b";

#[test]
fn two_hami_containers_share_one_gpu_and_the_node_sees_them_by_pod() {
    if !namespaces_permitted() {
        eprintln!(
            "SKIP: cannot create PID + mount namespaces here (unshare --pid --mount needs root \
             or user namespaces); the container test did not run"
        );
        return;
    }
    let node = Node::new();
    // Container A: 256 MiB, 30% SM; holds 128 MiB, 200 MiB more must be refused.
    let mut a = node.start("team-a", "train-a", UID_A, "main", 256, 30, 128, 200);
    // Container B: 512 MiB, 60% SM; holds 300 MiB, 300 MiB more must be refused.
    let mut b = node.start("team-b", "infer-b", UID_B, "server", 512, 60, 300, 300);
    let (ra, rb) = (a.ready(), b.ready());
    // Limits hold per container: each first allocation fits, each second is OUT_OF_MEMORY.
    assert!(ra.contains("first=0 second=2"), "A: {ra}");
    assert!(rb.contains("first=0 second=2"), "B: {rb}");
    // Each is pid 1 of its own PID namespace.
    assert!(
        ra.contains("pid=1 ") && rb.contains("pid=1 "),
        "{ra} / {rb}"
    );

    // The node side reads the host layout only.
    let mut cmd = vgpu();
    cmd.env("VGPU_TURN_DIR", node.path("vgpulock"));
    let exporter = Exporter::start(
        cmd,
        &[
            "--per-process",
            "--pod-logs",
            node.path("pods").to_str().unwrap(),
            "--cache",
            &format!("{}/containers/*/*.cache", node.sim.dir.path().display()),
        ],
    );
    let addr = exporter.addr.as_str();
    let scrape = || {
        parse_metrics(
            &http::get(addr, "/metrics", Duration::from_secs(5))
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

    // Usage under the right pod labels, limits per container, one process each, and both
    // containers announced on the one GPU's turn board in the shared /tmp/vgpulock.
    let mut s = scrape();
    let end = Instant::now() + Duration::from_secs(10);
    while metric_value(&s, "vgpu_device_turn_containers", &pod_a) != Some(2.0)
        && Instant::now() < end
    {
        std::thread::sleep(Duration::from_millis(200));
        s = scrape();
    }
    let used = |s: &[_], pod: &[(&str, &str)]| metric_value(s, "hami_vgpu_memory_used_bytes", pod);
    assert_eq!(used(&s, &pod_a), Some((CTX + 128 * MIB) as f64));
    assert_eq!(used(&s, &pod_b), Some((CTX + 300 * MIB) as f64));
    assert_eq!(
        metric_value(&s, "hami_vgpu_memory_limit_bytes", &pod_a),
        Some((256 * MIB) as f64)
    );
    assert_eq!(
        metric_value(&s, "hami_vgpu_memory_limit_bytes", &pod_b),
        Some((512 * MIB) as f64)
    );
    for pod in [&pod_a, &pod_b] {
        let mut l = pod.to_vec();
        l.push(("device_uuid", GPU));
        assert!(metric_value(&s, "hami_container_device_utilization_ratio", &l).is_some());
        let mut p = pod.to_vec();
        p.push(("pid", "1"));
        assert_eq!(
            metric_value(&s, "vgpu_process_alive", &p),
            Some(1.0),
            "{pod:?}"
        );
        assert_eq!(
            metric_value(&s, "vgpu_device_processes", pod),
            Some(1.0),
            "{pod:?}"
        );
        assert_eq!(
            metric_value(&s, "vgpu_device_turn_containers", pod),
            Some(2.0),
            "turns: {pod:?}"
        );
    }
    let boards: Vec<_> = std::fs::read_dir(node.path("vgpulock")).unwrap().collect();
    assert_eq!(boards.len(), 1, "one turn board for the one GPU");
    // The runtime's mount point for the library sits in the host directory; it is skipped.
    assert!(a.dir.join("libvgpu.so").exists());
    assert_eq!(metric_value(&s, "vgpu_exporter_files", &[]), Some(2.0));

    // `vgpu status` on the host reads each container's file by its host path.
    for (dir, limit) in [(&a.dir, 256 * MIB), (&b.dir, 512 * MIB)] {
        let cache = dir.join(format!(
            "{}-cache.cache",
            &dir.file_name().unwrap().to_str().unwrap()[..36]
        ));
        let mut cmd = vgpu();
        cmd.args(["status", "--json", "--cache", cache.to_str().unwrap()]);
        let out = run(cmd);
        out.assert_success();
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(v["devices"][0]["memory_limit_bytes"], limit);
        assert_eq!(v["devices"][0]["uuid"], GPU);
        assert_eq!(v["processes"].as_array().unwrap().len(), 1);
        assert_eq!(v["processes"][0]["alive"], true);
    }

    // Kill container A: its usage disappears from what the GPU holds (dead, no longer
    // used), B is untouched, and A leaves the turn board.
    a.kill();
    let end = Instant::now() + Duration::from_secs(10);
    let mut s = scrape();
    while (used(&s, &pod_a) != Some(0.0)
        || metric_value(&s, "vgpu_device_turn_containers", &pod_b) != Some(1.0))
        && Instant::now() < end
    {
        std::thread::sleep(Duration::from_millis(200));
        s = scrape();
    }
    assert_eq!(
        used(&s, &pod_a),
        Some(0.0),
        "a killed container holds nothing"
    );
    assert_eq!(
        metric_value(&s, "vgpu_device_dead_processes", &pod_a),
        Some(1.0)
    );
    let mut dead = pod_a.to_vec();
    dead.push(("pid", "1"));
    assert_eq!(metric_value(&s, "vgpu_process_alive", &dead), Some(0.0));
    assert_eq!(used(&s, &pod_b), Some((CTX + 300 * MIB) as f64));
    assert_eq!(
        metric_value(&s, "vgpu_device_turn_containers", &pod_b),
        Some(1.0)
    );
}
