//! End to end: when host-backed memory may move (docs/oversubscription.md, "When a move is
//! safe"), through `libvgpu.so` on a 128 MiB simulated device (16 MiB per context).
//!
//! A move replaces the memory behind an address, so it may only touch memory nothing can be
//! using: a synchronize proves only its own context idle, and a host-backed allocation can be
//! reached from every context of the process on its device. The program queues work that
//! writes a host-backed buffer in one context while another synchronizes. Whether a move
//! there would lose those writes depends on when they run (the driver's unmap does not wait
//! for another context's work), so the test checks the rule itself: the buffer stays where it
//! is until its context is the device's only one, and the writes land. The program pauses at each step (`pause=<step>`) so
//! that the test reads the shared file there. Needs `libvgpu.so` and `libvgpusim.so` built
//! (`cargo xtask test`).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::OnceLock;

use support::{Paused, Standalone};
use vgpu_shm::UsageTable;

mod support;

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 16 * MIB;

const PROGRAM: &str = r#"
#include "standalone.h"

typedef unsigned long long P;
#define CHUNK (16ull << 20)
static CUresult (*cuCtxCreate_v2)(H *, unsigned, int);
static CUresult (*cuCtxDestroy_v2)(H);
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuMemAlloc_v2)(P *, size_t);
static CUresult (*cuMemFree_v2)(P);
static CUresult (*cuMemsetD32_v2)(P, unsigned, size_t);
static CUresult (*cuMemcpyDtoH_v2)(void *, P, size_t);
static unsigned buf[CHUNK / 4];

/* Says where the program is and waits for the test to have looked. */
static void pause_at(const char *step) {
  printf("pause=%s\n", step);
  fflush(stdout);
  char line[16];
  if (!fgets(line, sizeof line, stdin)) exit(4);
}

/* Words of the CHUNK at x that are not v (copied out in the current context). */
static long long unwritten(P x, unsigned v) {
  if (cuMemcpyDtoH_v2(buf, x, CHUNK)) return -1;
  long long n = 0;
  for (P i = 0; i < CHUNK / 4; i++) n += buf[i] != v;
  return n;
}

int main(int argc, char **argv) {
  if (argc < 2) return 1;
  int loaded = load_driver();
  if (loaded) return loaded;
  NEED(cuCtxCreate_v2) NEED(cuCtxDestroy_v2) NEED(cuCtxSynchronize) NEED(cuMemAlloc_v2)
  NEED(cuMemFree_v2) NEED(cuMemsetD32_v2) NEED(cuMemcpyDtoH_v2)
  int dev; H a, b, mod, spin, fill;
  P filler[8], x;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  if (argv[1][0] == 't') { /* two contexts */
    CHECK(cuCtxCreate_v2(&a, 0, dev));
    CHECK(cuCtxCreate_v2(&b, 0, dev));
    /* A fills the device (128 MiB less two 16 MiB contexts). */
    CHECK(cuCtxSetCurrent(a));
    for (int i = 0; i < 6; i++) CHECK(cuMemAlloc_v2(&filler[i], CHUNK));
    /* B's buffer does not fit: host-backed. */
    CHECK(cuCtxSetCurrent(b));
    CHECK(cuModuleLoadData(&mod, "vgpusim-module: spin fill"));
    CHECK(cuModuleGetFunction(&spin, mod, "spin"));
    CHECK(cuModuleGetFunction(&fill, mod, "fill"));
    CHECK(cuMemAlloc_v2(&x, CHUNK));
    CHECK(cuMemsetD32_v2(x, 1, CHUNK / 4));
    CHECK(cuCtxSynchronize());
    pause_at("placed");
    /* Queued in B, running later: spin for 300 ms, then write 7 into every word. */
    unsigned long long ns = 300000000ull, words = CHUNK / 4;
    unsigned seven = 7;
    void *spin_args[] = {&ns}, *fill_args[] = {&x, &seven, &words};
    CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, 0, spin_args, 0));
    CHECK(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, fill_args, 0));
    /* Meanwhile A frees room for the buffer and synchronizes: its own work is finished. */
    CHECK(cuCtxSetCurrent(a));
    CHECK(cuMemFree_v2(filler[0]));
    CHECK(cuCtxSynchronize());
    pause_at("a-synchronized");
    CHECK(cuCtxSetCurrent(b));
    CHECK(cuCtxSynchronize());
    printf("unwritten=%lld\n", unwritten(x, 7));
    pause_at("b-synchronized");
    /* A gone, B is the device's only context: its synchronize may move the buffer. */
    CHECK(cuCtxDestroy_v2(a));
    CHECK(cuCtxSetCurrent(b));
    CHECK(cuCtxSynchronize());
    printf("unwritten_after_move=%lld\n", unwritten(x, 7));
    pause_at("b-alone");
  } else { /* the primary context, as the runtime uses it */
    CHECK(cuDevicePrimaryCtxRetain(&a, dev));
    CHECK(cuCtxSetCurrent(a));
    for (int i = 0; i < 7; i++) CHECK(cuMemAlloc_v2(&filler[i], CHUNK));
    CHECK(cuMemAlloc_v2(&x, CHUNK));
    CHECK(cuMemsetD32_v2(x, 5, CHUNK / 4));
    pause_at("placed");
    CHECK(cuMemFree_v2(filler[0]));
    CHECK(cuCtxSynchronize());
    printf("unwritten_after_move=%lld\n", unwritten(x, 5));
    pause_at("moved");
  }
  printf("end\n");
  return 0;
}
"#;

fn program() -> &'static Standalone {
    static P: OnceLock<Standalone> = OnceLock::new();
    P.get_or_init(|| support::standalone("moverule", "moverule", PROGRAM))
}

/// The program running one scenario, stopped at its pauses.
struct Scenario {
    p: Paused,
    cache: PathBuf,
}

impl Scenario {
    fn start(scenario: &str) -> Scenario {
        let p = program();
        let cache = p.fresh_cache(&format!("{scenario}.cache"));
        let mut cmd = p.hooked(&[scenario], &cache);
        support::small_oversubscribed_device(&mut cmd);
        cmd.stderr(Stdio::inherit());
        Scenario {
            p: Paused::spawn(cmd),
            cache,
        }
    }

    /// Runs to pause `step` and returns the host-backed bytes of device 0 there.
    fn host_bytes_at(&mut self, step: &str) -> u64 {
        self.p.reach(step);
        let host = UsageTable::open_read_only(&self.cache)
            .unwrap()
            .snapshot()
            .devices[0]
            .host;
        self.p.go();
        host
    }

    fn value(&self, key: &str) -> i64 {
        self.p.value(key)
    }

    fn finish(self) {
        self.p.finish();
    }
}

#[test]
fn a_synchronize_never_moves_memory_another_context_can_still_be_writing() {
    let mut p = Scenario::start("two");
    assert_eq!(
        p.host_bytes_at("placed"),
        CHUNK,
        "B's buffer is host-backed"
    );
    // A's synchronize proves only A idle; B's queued fill is still to come.
    let after_a = p.host_bytes_at("a-synchronized");
    let _ = p.host_bytes_at("b-synchronized");
    assert_eq!(
        p.value("unwritten"),
        0,
        "B's queued writes were lost: the buffer moved under them"
    );
    assert_eq!(
        after_a, CHUNK,
        "moved at A's synchronize while another context of the device existed"
    );
    // Once B is the device's only context, its own synchronize moves the buffer, intact.
    assert_eq!(p.host_bytes_at("b-alone"), 0, "moved back once B was alone");
    assert_eq!(p.value("unwritten_after_move"), 0);
    p.finish();
}

#[test]
fn the_primary_contexts_synchronize_still_moves_its_memory_back() {
    let mut p = Scenario::start("primary");
    assert_eq!(p.host_bytes_at("placed"), CHUNK);
    assert_eq!(p.host_bytes_at("moved"), 0, "moved back at the synchronize");
    assert_eq!(p.value("unwritten_after_move"), 0);
    p.finish();
}
