//! End to end: host-backed memory (`CUDA_OVERSUBSCRIBE`, `VGPU_HOST_SPILL`; Issue 16) through
//! `libvgpu.so` on a physically small simulated device (128 MiB, a 16 MiB context).
//!
//! A program allocates past what the device (or its limit) can hold, writes a pattern into
//! every allocation, and then follows commands on stdin: free some, synchronize (where
//! host-backed allocations move back onto the device), verify every pattern. The test reads
//! the shared file meanwhile: device-resident usage, host-backed bytes, and after a SIGKILL
//! that both return. Needs `libvgpu.so` and `libvgpusim.so` built (`cargo xtask test`).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use support::Standalone;
use vgpu_shm::{TableSnapshot, UsageTable};

mod support;

const MIB: u64 = 1 << 20;
const PHYSICAL: u64 = 128 * MIB;
const CONTEXT: u64 = 16 * MIB;
const CHUNK: u64 = 16 * MIB;

const PROGRAM: &str = r#"
#include "standalone.h"
#include <string.h>

typedef unsigned long long P;
typedef struct { int type, id; } Loc;
typedef struct { int type, handles; Loc loc; void *win32; unsigned char flags[8]; } Prop;
typedef struct { Loc loc; unsigned flags; } Access;

#define MAXN 64
static P ptr[MAXN], size[MAXN];
static int live[MAXN];
static unsigned *buf;

CUresult (*cuMemAlloc_v2)(P *, size_t);
CUresult (*cuMemAllocPitch_v2)(P *, size_t *, size_t, size_t, unsigned);
CUresult (*cuMemFree_v2)(P);
CUresult (*cuMemsetD32_v2)(P, unsigned, size_t);
CUresult (*cuMemcpyDtoH_v2)(void *, P, size_t);
CUresult (*cuCtxSynchronize)(void);
CUresult (*cuCtxSynchronize_v2)(H);
CUresult (*cuMemGetInfo_v2)(size_t *, size_t *);
CUresult (*cuMemCreate)(P *, size_t, const Prop *, unsigned long long);
CUresult (*cuMemAddressReserve)(P *, size_t, size_t, P, unsigned long long);
CUresult (*cuMemMap)(P, size_t, size_t, P, unsigned long long);
CUresult (*cuMemSetAccess)(P, size_t, const Access *, size_t);
CUresult (*cuCtxDestroy_v2)(H);
CUresult (*cuDeviceGetAttribute)(int *, int, int);
typedef struct { size_t w, h; int format; unsigned channels; } ArrayDesc;
CUresult (*cuArrayCreate_v2)(P *, const ArrayDesc *);
CUresult (*cuMemGetAllocationGranularity)(size_t *, const Prop *, int);
CUresult (*cuMemAllocAsync)(P *, size_t, H);

/* A device allocation the VMM way (cuMemCreate on device 0, mapped at a reserved address). */
static CUresult vmm_alloc(P *out, size_t n) {
  Prop prop; memset(&prop, 0, sizeof prop);
  prop.type = 1; prop.loc.type = 1; prop.loc.id = 0;
  P h; CUresult r = cuMemCreate(&h, n, &prop, 0);
  if (r) return r;
  if ((r = cuMemAddressReserve(out, n, 0, 0, 0))) return r;
  if ((r = cuMemMap(*out, n, 0, h, 0))) return r;
  Access a = { { 1, 0 }, 3 };
  return cuMemSetAccess(*out, n, &a, 1);
}

/* A device allocation as PyTorch's expandable segments make one: the segment's properties
   (POSIX file-descriptor handles, the GPUDirect RDMA flag when the device supports it), one
   address range reserved up front for every segment, then per segment cuMemCreate, cuMemMap
   and cuMemSetAccess. */
static CUresult torch_alloc(P *out, size_t n, int i) {
  static P base;
  Prop prop; memset(&prop, 0, sizeof prop);
  prop.type = 1; prop.handles = 1; prop.loc.type = 1; prop.loc.id = 0;
  int rdma = 0;
  CUresult r = cuDeviceGetAttribute(&rdma, 110, 0);
  if (r) return r;
  prop.flags[1] = rdma ? 1 : 0;
  size_t gran = 0;
  if ((r = cuMemGetAllocationGranularity(&gran, &prop, 0))) return r;
  if (!gran || n % gran) return 1;
  if (!base && (r = cuMemAddressReserve(&base, n * MAXN, 0, 0, 0))) return r;
  P h;
  if ((r = cuMemCreate(&h, n, &prop, 0))) return r;
  *out = base + (P)i * n;
  if ((r = cuMemMap(*out, n, 0, h, 0))) return r;
  Access a = { { 1, 0 }, 3 };
  return cuMemSetAccess(*out, n, &a, 1);
}

/* Every word of allocation i is i + 1. */
static int intact(int i) {
  if (cuMemcpyDtoH_v2(buf, ptr[i], size[i])) return 0;
  for (P w = 0; w < size[i] / 4; w++) if (buf[w] != (unsigned)i + 1) return 0;
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 4) return 1;
  const char *how = argv[1];
  int n = atoi(argv[2]);
  P bytes = strtoull(argv[3], 0, 0);
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 3; }
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(int *, int);
  CUresult (*cuCtxCreate_v2)(H *, unsigned, int);
  NEED(cuInit); NEED(cuDeviceGet); NEED(cuCtxCreate_v2); NEED(cuMemAlloc_v2); NEED(cuMemFree_v2);
  NEED(cuMemAllocPitch_v2); NEED(cuMemsetD32_v2); NEED(cuMemcpyDtoH_v2); NEED(cuCtxSynchronize);
  NEED(cuMemGetInfo_v2); NEED(cuMemCreate); NEED(cuMemAddressReserve); NEED(cuMemMap);
  NEED(cuMemSetAccess); NEED(cuCtxDestroy_v2); NEED(cuCtxSynchronize_v2);
  NEED(cuDeviceGetAttribute); NEED(cuMemGetAllocationGranularity); NEED(cuArrayCreate_v2);
  NEED(cuMemAllocAsync);
  int dev; H ctx;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuCtxCreate_v2(&ctx, 0, dev));
  buf = malloc(bytes);
  int ok = 0; CUresult last = 0;
  for (int i = 0; i < n && i < MAXN; i++) {
    size_t pitch = 0;
    if (!strcmp(how, "pitch")) last = cuMemAllocPitch_v2(&ptr[i], &pitch, bytes / 256, 256, 4);
    else if (!strcmp(how, "vmm")) last = vmm_alloc(&ptr[i], bytes);
    else if (!strcmp(how, "torch")) last = torch_alloc(&ptr[i], bytes, i);
    else if (!strcmp(how, "async")) last = cuMemAllocAsync(&ptr[i], bytes, 0); /* the device's pool */
    else if (!strcmp(how, "array")) { /* bytes of 1-channel floats, 4096 to a row */
      ArrayDesc d = { 4096, bytes / 4 / 4096, 0x20, 1 };
      if (!(last = cuArrayCreate_v2(&ptr[i], &d))) { ok++; continue; } /* not checked later */
    }
    else last = cuMemAlloc_v2(&ptr[i], bytes);
    if (last) break;
    size[i] = pitch ? pitch * 256 : bytes;
    CHECK(cuMemsetD32_v2(ptr[i], (unsigned)i + 1, size[i] / 4));
    live[i] = 1; ok++;
  }
  size_t f, t;
  CHECK(cuMemGetInfo_v2(&f, &t));
  printf("allocated=%d\nlast=%d\nfree=%llu\ntotal=%llu\n", ok, last, (P)f, (P)t);
  printf("ready\n");
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    int k;
    if (sscanf(line, "free %d", &k) == 1 && k >= 0 && k < ok && live[k]) {
      CHECK(cuMemFree_v2(ptr[k])); live[k] = 0;
    } else if (!strncmp(line, "sync", 4)) {
      /* "sync2": CUDA 13's context-argument variant (NULL = the current context). */
      CHECK(line[4] == '2' ? cuCtxSynchronize_v2(0) : cuCtxSynchronize());
      int good = 0, bad = 0;
      for (int i = 0; i < ok; i++) if (live[i]) { if (intact(i)) good++; else bad++; }
      CHECK(cuMemGetInfo_v2(&f, &t));
      printf("intact=%d\nbad=%d\nfree=%llu\n", good, bad, (P)f);
    } else if (!strncmp(line, "destroy", 7)) {
      CHECK(cuCtxDestroy_v2(ctx));
    } else if (!strncmp(line, "exit", 4)) {
      break;
    }
    printf("done\n");
    fflush(stdout);
  }
  return 0;
}
"#;

fn program() -> &'static Standalone {
    static P: OnceLock<Standalone> = OnceLock::new();
    P.get_or_init(|| support::standalone("oversub", "oversub", PROGRAM))
}

/// The program running under the hook, driven line by line.
struct Running {
    /// The usage file's tag, naming the case in failure messages.
    tag: String,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    cache: PathBuf,
}

/// The program with `args` on the usage file named after `tag` (as it is) under `limit`, on
/// the small device, with `vars`; and that file's path.
fn command(tag: &str, limit: &str, vars: &[(&str, &str)], args: &[&str]) -> (Command, PathBuf) {
    let e = program();
    let cache = e.dir.join(format!("{tag}.cache"));
    let mut cmd = Command::new(&e.program);
    vgpu_testkit::clear_runner_settings(&mut cmd);
    cmd.args(args)
        .env("LD_PRELOAD", &e.hook)
        .env("LD_LIBRARY_PATH", &e.dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache)
        .env("VGPU_SIM_TOTAL_MEM", "128m")
        .env("VGPU_SIM_CTX_OVERHEAD", "16m")
        .env("VGPU_SIM_MODULE_OVERHEAD", "0")
        .env("VGPU_SIM_HOST_PINNED_LIMIT", "4g")
        .env("VGPU_RECONCILE_MS", "off");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    (cmd, cache)
}

impl Running {
    /// Starts the program on a fresh usage file named after `tag`.
    fn start(tag: &str, limit: &str, vars: &[(&str, &str)], args: &[&str]) -> (Running, String) {
        program().fresh_cache(&format!("{tag}.cache"));
        Self::join(tag, limit, vars, args)
    }

    /// Starts the program on the usage file named after `tag`, as it is.
    fn join(tag: &str, limit: &str, vars: &[(&str, &str)], args: &[&str]) -> (Running, String) {
        let (mut cmd, cache) = command(tag, limit, vars, args);
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = cmd.spawn().expect("start the program");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut r = Running {
            tag: tag.to_owned(),
            child,
            stdin,
            stdout,
            cache,
        };
        let out = r.until("ready");
        (r, out)
    }

    fn until(&mut self, marker: &str) -> String {
        let mut all = String::new();
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the program ended before `{marker}`:\n{all}");
            all.push_str(&line);
            if line.trim() == marker {
                return all;
            }
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        self.until("done")
    }

    /// Frees allocations `ks`.
    fn free(&mut self, ks: std::ops::Range<usize>) {
        for k in ks {
            self.cmd(&format!("free {k}"));
        }
    }

    /// Synchronizes with `sync` (`cuCtxSynchronize`) or `sync2` (`cuCtxSynchronize_v2`),
    /// then checks that `intact` live allocations kept their pattern and none lost it.
    #[track_caller]
    fn sync_expecting_intact(&mut self, sync: &str, intact: u64) {
        let out = self.cmd(sync);
        assert_eq!(
            (value(&out, "intact"), value(&out, "bad")),
            (intact, 0),
            "{}: {out}",
            self.tag
        );
    }

    /// [`Self::sync_expecting_intact`], then checks where the memory is: (device-resident,
    /// host-backed) bytes, `why` saying what that means.
    #[track_caller]
    fn sync_expecting(&mut self, sync: &str, intact: u64, device_host: (u64, u64), why: &str) {
        self.sync_expecting_intact(sync, intact);
        assert_eq!(usage(&self.table()), device_host, "{}: {why}", self.tag);
    }

    fn table(&self) -> TableSnapshot {
        UsageTable::open_read_only(&self.cache).unwrap().snapshot()
    }

    fn finish(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let st = self.child.wait().unwrap();
        assert!(st.success(), "{st:?}");
    }
}

fn value(out: &str, key: &str) -> u64 {
    out.lines()
        .rev()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in\n{out}"))
        .trim()
        .parse()
        .unwrap()
}

/// (device-resident bytes, host-backed bytes) of device 0.
fn usage(t: &TableSnapshot) -> (u64, u64) {
    (t.devices[0].used, t.devices[0].host)
}

const OVERSUBSCRIBE: &[(&str, &str)] = &[("CUDA_OVERSUBSCRIBE", "true")];

/// Twelve 16 MiB allocations by `cuMemAlloc`.
const TWELVE_CHUNKS: &[&str] = &["alloc", "12", "16777216"];

/// Twelve chunks under a 256 MiB limit with oversubscription on and the `extra` settings
/// (with none: 7 fit on the device beside the context, 5 are host-backed).
fn oversubscribed(tag: &str, extra: &[(&str, &str)]) -> (Running, String) {
    let vars = [OVERSUBSCRIBE, extra].concat();
    Running::start(tag, "256m", &vars, TWELVE_CHUNKS)
}

/// Twelve chunks oversubscribed, then freed in two steps with a synchronize by `sync` (`sync`:
/// `cuCtxSynchronize`, `sync2`: `cuCtxSynchronize_v2`) between: host-backed chunks move back
/// as room frees up, intact, and everything is given back at the end.
fn host_backed_chunks_move_back_at(sync: &str) {
    // A 256 MiB limit on a 128 MiB device: 7 chunks fit beside the context, 5 are host-backed.
    let (mut p, out) = oversubscribed(&format!("oversub-{sync}"), &[]);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    let (device, host) = usage(&p.table());
    assert_eq!(device, CONTEXT + 7 * CHUNK);
    assert!(device <= PHYSICAL);
    assert_eq!(host, 5 * CHUNK);
    // The view: a device as large as the limit, everything held counted.
    assert_eq!(value(&out, "total"), 256 * MIB);
    assert_eq!(value(&out, "free"), 256 * MIB - CONTEXT - 12 * CHUNK);
    p.sync_expecting(
        sync,
        12,
        (CONTEXT + 7 * CHUNK, 5 * CHUNK),
        "no room: nothing moved",
    );
    // Three device chunks freed: three host-backed ones move back at the next sync, intact.
    p.free(0..3);
    p.sync_expecting(
        sync,
        9,
        (CONTEXT + 7 * CHUNK, 2 * CHUNK),
        "three host-backed chunks moved back",
    );
    // Freed, host-backed or moved: everything given back.
    p.free(3..12);
    assert_eq!(usage(&p.table()), (CONTEXT, 0), "{sync}");
    p.finish();
}

#[test]
fn with_oversubscription_allocations_past_the_device_are_host_backed_and_come_back() {
    host_backed_chunks_move_back_at("sync");
}

#[test]
fn cuda_13s_context_synchronize_moves_memory_back_too() {
    // CUDA 13's runtime may synchronize through cuCtxSynchronize_v2 (with CUDA 13 a PyTorch
    // loop's host-backed memory came back at torch.cuda.synchronize only once this was a
    // sync point): it is the same sync point.
    host_backed_chunks_move_back_at("sync2");
}

#[test]
fn without_host_backing_the_full_device_refuses() {
    let (p, out) = Running::start("off", "256m", &[], TWELVE_CHUNKS);
    assert_eq!(value(&out, "allocated"), 7, "{out}");
    assert_eq!(value(&out, "last"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(usage(&p.table()), (CONTEXT + 7 * CHUNK, 0));
    p.finish();
}

/// The simulated GPU's UUID in the room tests (`VGPU_SIM_UUIDS`), so the test can find its
/// room board.
const ROOM_GPU: &str = "GPU-5a1e5130-0000-4000-8000-0000000000aa";

/// The program under `CUDA_TASK_PRIORITY=0` allocating twelve 16 MiB chunks on the 128 MiB
/// device (no host backing), its room board in a fresh `dir`: its output and its log.
fn urgent_allocations(tag: &str, dir: &std::path::Path) -> (String, String) {
    program().fresh_cache(&format!("{tag}.cache"));
    let vars = [
        ("CUDA_TASK_PRIORITY", "0"),
        ("VGPU_TURN_DIR", dir.to_str().unwrap()),
        ("VGPU_SIM_UUIDS", ROOM_GPU),
        ("VGPU_SWAP_IN_WAIT", "300ms"),
        ("LIBCUDA_LOG_LEVEL", "3"),
    ];
    let (mut cmd, _) = command(tag, "256m", &vars, TWELVE_CHUNKS);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_urgent_allocation_without_room_asks_less_urgent_containers_that_offer_and_waits_bounded() {
    use vgpu_shm::{RoomBoard, RoomKind, RoomRecord, monotonic_ns, room_file_name};
    let dir = program().dir.join("rooms-offered");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A less urgent container offers 64 MiB (its process is not here: the simulated GPU of
    // this process never gains the room, so the wait runs out and the allocation fails).
    let mut board = RoomBoard::open_or_create(dir.join(room_file_name(ROOM_GPU))).unwrap();
    board
        .post(RoomRecord {
            key: 77,
            kind: RoomKind::Offer,
            priority: 1,
            bytes: 64 << 20,
            stamp_ns: monotonic_ns(),
        })
        .unwrap();
    let (out, log) = urgent_allocations("room-offered", &dir);
    assert_eq!(value(&out, "allocated"), 7, "{out}");
    assert!(
        log.contains("1 less urgent container(s) offer to swap out: waiting up to 300 ms")
            && log.contains("no room made for 16777216 bytes after"),
        "{log}"
    );
    // The want was withdrawn after the wait: only the offer is left.
    let left = board.records(monotonic_ns());
    assert!(left.iter().all(|r| r.kind == RoomKind::Offer), "{left:?}");
    // Nobody offering: no wait at all.
    let dir = program().dir.join("rooms-empty");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (out, log) = urgent_allocations("room-empty", &dir);
    assert_eq!(value(&out, "allocated"), 7, "{out}");
    assert!(!log.contains("offer to swap out"), "{log}");
}

#[test]
fn host_spill_goes_past_the_limit_into_host_memory_only() {
    // A 64 MiB limit: 3 chunks beside the context; VGPU_HOST_SPILL=64m takes 4 more, no
    // further; the device-resident part never passes the limit.
    let spill = &[("VGPU_HOST_SPILL", "64m")];
    let (mut p, out) = Running::start("spill", "64m", spill, &["alloc", "10", "16777216"]);
    assert_eq!(value(&out, "allocated"), 7, "{out}");
    assert_eq!(value(&out, "last"), 2);
    assert_eq!(usage(&p.table()), (CONTEXT + 3 * CHUNK, 4 * CHUNK));
    // Spill is not advertised: the view is the device limit's.
    assert_eq!(value(&out, "total"), 64 * MIB);
    assert_eq!(value(&out, "free"), 0);
    p.cmd("free 0");
    p.sync_expecting(
        "sync",
        6,
        (CONTEXT + 3 * CHUNK, 3 * CHUNK),
        "one moved back",
    );
    p.finish();
    let (p, out) = Running::start("nospill", "64m", &[], &["alloc", "10", "16777216"]);
    assert_eq!(value(&out, "allocated"), 3, "{out}");
    p.finish();
}

#[test]
fn pitched_and_vmm_allocations_are_host_backed_too() {
    for how in ["pitch", "vmm"] {
        let (mut p, out) = Running::start(
            &format!("{how}-o"),
            "256m",
            OVERSUBSCRIBE,
            &[how, "12", "16777216"],
        );
        assert_eq!(value(&out, "allocated"), 12, "{how}: {out}");
        let (device, host) = usage(&p.table());
        assert!(
            device <= PHYSICAL && host >= 5 * CHUNK,
            "{how}: {device} {host}"
        );
        // The tag (`pitch-o`, `vmm-o`) names the case.
        p.sync_expecting_intact("sync", 12);
        p.finish();
    }
}

#[test]
fn stream_ordered_allocations_are_host_backed_too_and_keep_the_reserve() {
    // PyTorch's `backend:cudaMallocAsync` allocates from the device's pool: past the device
    // (or into the reserve) its allocations are host-backed as cuMemAlloc's are.
    let (mut p, out) = Running::start("async", "256m", OVERSUBSCRIBE, &["async", "12", "16777216"]);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    let (device, host) = usage(&p.table());
    assert!(device <= PHYSICAL && host >= 5 * CHUNK, "{device} {host}");
    p.sync_expecting_intact("sync", 12);
    p.finish();
    let vars = &[
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_DEVICE_RESERVE", "48m"),
    ];
    let (mut p, out) = Running::start("async-reserve", "256m", vars, &["async", "8", "16777216"]);
    assert_eq!(value(&out, "allocated"), 8, "{out}");
    // With VGPU_DEVICE_RESERVE=48m only 4 chunks go on the device (without the reserve's
    // check the pool took all 112 MiB the context left: the test failed first).
    assert_eq!(
        usage(&p.table()),
        (CONTEXT + 4 * CHUNK, 4 * CHUNK),
        "the reserve stays free on the stream-ordered path too"
    );
    p.sync_expecting_intact("sync", 8);
    p.finish();
}

#[test]
fn pytorchs_expandable_segments_are_host_backed_and_keep_the_reserve() {
    // PyTorch's segments ask for POSIX fd handles and, where the device allows it, the
    // GPUDirect RDMA flag (the simulator allows both and, like the H200, refuses both for host
    // memory): the hook's host-located stand-in must not inherit what host memory cannot
    // give. With VGPU_DEVICE_RESERVE=48m only 4 chunks go on the device, as for cuMemAlloc.
    let vars = &[
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_DEVICE_RESERVE", "48m"),
    ];
    let (mut p, out) = Running::start("torch-reserve", "256m", vars, &["torch", "8", "16777216"]);
    assert_eq!(value(&out, "allocated"), 8, "{out}");
    assert_eq!(
        usage(&p.table()),
        (CONTEXT + 4 * CHUNK, 4 * CHUNK),
        "the reserve stays free on the VMM path too"
    );
    p.sync_expecting_intact("sync", 8);
    p.finish();
    // Without a reserve the device fills first, then the rest is host-backed.
    let (mut p, out) = Running::start("torch", "256m", OVERSUBSCRIBE, &["torch", "12", "16777216"]);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    assert_eq!(usage(&p.table()), (CONTEXT + 7 * CHUNK, 5 * CHUNK));
    p.sync_expecting_intact("sync", 12);
    p.finish();
}

#[test]
fn a_driver_that_cannot_share_host_memory_still_gets_it_unshared() {
    // The 9th cuMemCreate is the first host-located one (7 fit on the device, the 8th finds
    // it full): refused with a code other than the H200's (801, not supported), the hook
    // still makes the handle without the program's shareable handle types.
    let vars = &[
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_SIM_FAULTS", "cuMemCreate:9:801"),
    ];
    let (mut p, out) = Running::start("torch-unshared", "256m", vars, &["torch", "12", "16777216"]);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    assert_eq!(usage(&p.table()), (CONTEXT + 7 * CHUNK, 5 * CHUNK));
    p.sync_expecting_intact("sync", 12);
    p.finish();
}

#[test]
fn a_pitched_allocation_keeps_the_reserve_too() {
    let vars = &[
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_DEVICE_RESERVE", "48m"),
    ];
    let (mut p, out) = Running::start("pitch-reserve", "256m", vars, &["pitch", "8", "16777216"]);
    assert_eq!(value(&out, "allocated"), 8, "{out}");
    assert_eq!(usage(&p.table()), (CONTEXT + 4 * CHUNK, 4 * CHUNK));
    p.sync_expecting_intact("sync", 8);
    p.finish();
}

#[test]
fn an_array_that_would_break_the_reserve_is_refused() {
    // Arrays cannot be host-backed: past the reserve they get a clean out-of-memory.
    let vars = &[
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_DEVICE_RESERVE", "48m"),
    ];
    let (p, out) = Running::start("array-reserve", "256m", vars, &["array", "8", "16777216"]);
    assert_eq!(value(&out, "allocated"), 4, "{out}");
    assert_eq!(value(&out, "last"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(usage(&p.table()), (CONTEXT + 4 * CHUNK, 0));
    p.finish();
}

#[test]
fn a_killed_process_gives_back_its_host_backed_memory() {
    let (mut p, out) = oversubscribed("kill", &[]);
    assert_eq!(value(&out, "allocated"), 12);
    assert_eq!(usage(&p.table()).1, 5 * CHUNK);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    // The next one to attach sweeps the dead process away: device and host usage both.
    let t = UsageTable::open_existing(&p.cache).unwrap();
    assert_eq!(usage(&t.snapshot()), (0, 0));
}

#[test]
fn when_the_host_refuses_to_pin_the_allocation_fails_cleanly() {
    // The host lets the process pin 32 MiB (RLIMIT_MEMLOCK or the cgroup, as the simulator
    // models it): two chunks are host-backed, the next allocation is a clean out-of-memory.
    let (mut p, out) = oversubscribed("pinlimit", &[("VGPU_SIM_HOST_PINNED_LIMIT", "32m")]);
    assert_eq!(value(&out, "allocated"), 9, "{out}");
    assert_eq!(value(&out, "last"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(
        usage(&p.table()),
        (CONTEXT + 7 * CHUNK, 2 * CHUNK),
        "nothing charged for it"
    );
    p.sync_expecting_intact("sync", 9);
    p.finish();
}

#[test]
fn the_device_reserve_stays_free() {
    // VGPU_DEVICE_RESERVE=48m on the 128 MiB device: 4 chunks fit beside the context (64 MiB
    // free would become 48), the rest is host-backed; a move back keeps the reserve too.
    let vars = &[
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_DEVICE_RESERVE", "48m"),
    ];
    let (mut p, out) = Running::start("reserve", "256m", vars, &["alloc", "8", "16777216"]);
    assert_eq!(value(&out, "allocated"), 8, "{out}");
    assert_eq!(usage(&p.table()), (CONTEXT + 4 * CHUNK, 4 * CHUNK));
    p.cmd("free 0");
    p.sync_expecting(
        "sync",
        7,
        (CONTEXT + 4 * CHUNK, 3 * CHUNK),
        "one moved back",
    );
    p.finish();
    // Without host backing the reserve means nothing: the device fills as before.
    let (p, out) = Running::start(
        "reserve-off",
        "256m",
        &[("VGPU_DEVICE_RESERVE", "48m")],
        &["alloc", "8", "16777216"],
    );
    assert_eq!(value(&out, "allocated"), 7, "{out}");
    p.finish();
}

#[test]
fn a_move_that_fails_leaves_the_allocation_in_host_memory_intact() {
    // The first device-to-device copy of a move fails (the simulator's fault injection): the
    // allocation stays host-backed with its data, the move's device charge is given back, and
    // the next synchronize moves it.
    let (mut p, out) = oversubscribed("failmove", &[("VGPU_SIM_FAULTS", "cuMemcpyDtoD_v2:1:2")]);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    p.cmd("free 0");
    p.sync_expecting(
        "sync",
        11,
        (CONTEXT + 6 * CHUNK, 5 * CHUNK),
        "nothing moved, nothing left charged by the failed move",
    );
    p.sync_expecting("sync", 11, (CONTEXT + 7 * CHUNK, 4 * CHUNK), "moved now");
    p.finish();
}

#[test]
fn destroying_the_context_frees_its_host_backed_allocations() {
    let (mut p, out) = oversubscribed("destroy", &[]);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    assert_eq!(usage(&p.table()).1, 5 * CHUNK);
    p.cmd("destroy");
    assert_eq!(
        usage(&p.table()),
        (0, 0),
        "as cuMemAlloc memory, gone with its context"
    );
    p.finish();
}

#[test]
fn host_backed_bytes_are_charged_on_the_gpu_not_the_ordinal() {
    // Two simulated GPUs; the file is made by a process that sees both, then a process that
    // sees only the second (its ordinal 0) oversubscribes: its host-backed bytes are the
    // second GPU's (file index 1), as its device memory is.
    let two = &[
        ("VGPU_SIM_DEVICE_COUNT", "2"),
        ("CUDA_OVERSUBSCRIBE", "true"),
    ];
    let (first, _) = Running::start("gpus", "256m", two, &["alloc", "1", "16777216"]);
    let second_only = &[
        ("VGPU_SIM_DEVICE_COUNT", "2"),
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("CUDA_VISIBLE_DEVICES", "1"),
    ];
    let (second, out) = Running::join("gpus", "256m", second_only, TWELVE_CHUNKS);
    assert_eq!(value(&out, "allocated"), 12, "{out}");
    let t = second.table();
    assert_eq!(t.devices[1].host, 5 * CHUNK, "on the second GPU");
    assert_eq!(t.devices[0].host, 0);
    second.finish();
    first.finish();
}

#[test]
fn a_process_joining_with_another_host_policy_gets_the_file_s() {
    // The file is made with a 32 MiB spill. Like a differing limit, a differing policy in a
    // joining process changes it for nobody, that process included, and is said once.
    let made_with = vgpu_shm::HostPolicy {
        spill: 32 * MIB,
        oversubscribe: false,
    };
    let spill = &[("VGPU_HOST_SPILL", "32m")];
    let (first, _) = Running::start("policy", "64m", spill, &["alloc", "1", "16777216"]);
    // Beside the first process's context and chunk, the joiner's context leaves one chunk on
    // the device; the file's 32 MiB spill takes two more (its own 1 GiB with
    // oversubscription would take all ten).
    let greedy = &[("VGPU_HOST_SPILL", "1g"), ("CUDA_OVERSUBSCRIBE", "true")];
    let (mut cmd, cache) = command("policy", "64m", greedy, &["alloc", "10", "16777216"]);
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(value(&stdout, "allocated"), 3, "{stdout}{stderr}");
    let said = stderr
        .matches("host memory policy in force differs")
        .count();
    assert_eq!(said, 1, "said once:\n{stderr}");
    let t = UsageTable::open_read_only(&cache).unwrap().snapshot();
    assert_eq!(
        t.devices[0].host_policy, made_with,
        "the file keeps its policy"
    );
    // A process joining with none gets the file's spill too.
    let (mut cmd, _) = command("policy", "64m", &[], &["alloc", "10", "16777216"]);
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(value(&stdout, "allocated"), 3, "{stdout}");
    first.finish();
}
