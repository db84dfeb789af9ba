//! End to end: swapping an idle process's movable memory out to host memory and back
//! (docs/swap.md), through `libvgpu.so` on a 128 MiB simulated device (16 MiB per context).
//!
//! The program fills the device, so its buffer is host-backed, then frees room and
//! synchronizes: the buffer moves onto the device (a VMM allocation of the hook's: memory
//! that can move). It then waits at each step (`pause=<step>`) while the test reads the
//! shared file. Idle there, it is swapped out (by `VGPU_IDLE_SWAP` or by a request written
//! into the file, as `vgpu swap-out` writes it); its next copy or launch brings the buffer
//! back, data intact. Needs `libvgpu.so` and `libvgpusim.so` built (`cargo xtask test`).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use support::{Paused, Standalone};
use vgpu_shm::{TableSnapshot, UsageTable};

mod support;

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 16 * MIB;

const PROGRAM: &str = r#"
#include "standalone.h"
#include <pthread.h>
#include <string.h>
#include <unistd.h>

typedef unsigned long long P;
#define CHUNK (16ull << 20)
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuMemAlloc_v2)(P *, size_t);
static CUresult (*cuMemFree_v2)(P);
static CUresult (*cuMemsetD32_v2)(P, unsigned, size_t);
static CUresult (*cuMemcpyDtoH_v2)(void *, P, size_t);
static CUresult (*cuMemsetD32Async)(P, unsigned, size_t, H);
static CUresult (*cuMemsetD16Async)(P, unsigned short, size_t, H); /* touching, not listed */
static CUresult (*cuIpcGetMemHandle)(void *, P);
static CUresult (*cuMemGetAddressRange_v2)(P *, size_t *, P);
static CUresult (*cuPointerGetAttribute)(void *, int, P);
static CUresult (*cuPointerGetAttributes)(unsigned, int *, void **, P);
static CUresult (*cuCtxCreate_v2)(H *, unsigned, int);
static CUresult (*cuCtxDestroy_v2)(H);
static CUresult (*cuMemAddressReserve)(P *, size_t, size_t, P, unsigned long long);
static CUresult (*cuMemAddressFree)(P, size_t);
static CUresult (*cuMemCreate)(P *, size_t, const void *, unsigned long long);
static CUresult (*cuMemRelease)(P);
static CUresult (*cuMemMap)(P, size_t, size_t, P, unsigned long long);
static CUresult (*cuMemUnmap)(P, size_t);
static CUresult (*cuMemSetAccess)(P, size_t, const void *, size_t);
static CUresult (*cuMemRetainAllocationHandle)(P *, void *);
static CUresult (*cuMemExportToShareableHandle)(void *, P, int, unsigned long long);
static CUresult (*cuMemGetAllocationPropertiesFromHandle)(void *, P);
static CUresult (*cuMemImportFromShareableHandle)(P *, void *, int);
static unsigned buf[CHUNK / 4];
static H the_ctx;

/* CUmemAllocationProp (pinned, on device 0) and CUmemAccessDesc (device 0, read-write). */
struct prop { int type, handle_types, loc_type, loc_id; void *win32; unsigned char flags[8]; };
struct access { int loc_type, loc_id; unsigned flags; };

/* Words of the n bytes at x that are not v; -code if the copy failed. */
static long long wrong_words(P x, size_t n, unsigned v) {
  CUresult r = cuMemcpyDtoH_v2(buf, x, n);
  if (r) return -(long long)r;
  long long k = 0;
  for (size_t i = 0; i < n / 4; i++) k += buf[i] != v;
  return k;
}

/* Busy threads: each writes its own 2 MiB buffer, waits a moment, reads it back, 60 times. */
struct worker { P x; int id; long long wrong; };
static void *work(void *arg) {
  struct worker *w = arg;
  static __thread unsigned mine[CHUNK / 32];
  if (cuCtxSetCurrent(the_ctx)) { w->wrong = -1; return 0; }
  for (unsigned k = 1; k <= 60; k++) {
    unsigned v = k * 16 + w->id;
    if (cuMemsetD32_v2(w->x, v, CHUNK / 32)) { w->wrong = -2; return 0; }
    usleep(3000);
    if (cuMemcpyDtoH_v2(mine, w->x, CHUNK / 8)) { w->wrong = -3; return 0; }
    for (unsigned i = 0; i < CHUNK / 32; i++) w->wrong += mine[i] != v;
    usleep(3000);
  }
  return 0;
}

static void pause_at(const char *step) {
  printf("pause=%s\n", step);
  fflush(stdout);
  char line[16];
  if (!fgets(line, sizeof line, stdin)) exit(4);
}

/* Words of the CHUNK at x that are not v; -code if the copy failed. */
static long long unwritten(P x, unsigned v) {
  CUresult r = cuMemcpyDtoH_v2(buf, x, CHUNK);
  if (r) return -(long long)r;
  long long n = 0;
  for (P i = 0; i < CHUNK / 4; i++) n += buf[i] != v;
  return n;
}

int main(int argc, char **argv) {
  if (argc < 2) return 1;
  int loaded = load_driver();
  if (loaded) return loaded;
  NEED(cuCtxSynchronize) NEED(cuMemAlloc_v2) NEED(cuMemFree_v2) NEED(cuMemsetD32_v2)
  NEED(cuMemcpyDtoH_v2) NEED(cuMemsetD32Async)
  int dev; H ctx, mod, fill, ev;
  P filler[8], x;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cuCtxSetCurrent(ctx));
  CHECK(cuModuleLoadData(&mod, "vgpusim-module: fill spin"));
  CHECK(cuModuleGetFunction(&fill, mod, "fill"));
  if (argv[1][0] == 'a') { /* allocate chunks until one fails (at most 4, or aN: N) */
    int n = 0, most = argv[1][1] ? atoi(argv[1] + 1) : 4;
    CUresult r = 0;
    for (; n < most; n++) { P y; if ((r = cuMemAlloc_v2(&y, CHUNK))) break; }
    printf("allocated=%d\nlast=%d\n", n, (int)r);
    return 0;
  }
  if (argv[1][0] == 't') { /* threads at work while swap-outs are asked for */
    the_ctx = ctx;
    struct worker w[3];
    pthread_t t[3];
    for (int i = 0; i < 3; i++) {
      w[i].id = i; w[i].wrong = 0;
      CHECK(cuMemAlloc_v2(&w[i].x, CHUNK / 8));
    }
    printf("working\n");
    fflush(stdout);
    for (int i = 0; i < 3; i++) pthread_create(&t[i], 0, work, &w[i]);
    long long wrong = 0;
    for (int i = 0; i < 3; i++) { pthread_join(t[i], 0); wrong += w[i].wrong; }
    printf("wrong=%lld\n", wrong);
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'b') { /* busy: a long kernel runs while a swap-out is asked for */
    NEED(cuCtxCreate_v2) NEED(cuCtxDestroy_v2)
    H other, spin;
    P y;
    CHECK(cuModuleGetFunction(&spin, mod, "spin"));
    CHECK(cuMemAlloc_v2(&y, CHUNK));
    CHECK(cuMemsetD32_v2(y, 3, CHUNK / 4));
    CHECK(cuCtxCreate_v2(&other, 0, dev)); /* idle, and ended while the kernel runs */
    CHECK(cuCtxSetCurrent(ctx));
    unsigned long long ns = 4000000000ull, words = CHUNK / 4;
    unsigned nine = 9;
    void *sargs[] = {&ns};
    void *fargs[] = {&y, &nine, &words};
    /* fill's first launch, writing nothing, before the spin: under lazy loading (the real
       driver's default) a function's first launch waits for the context, and the fill's
       behind the spin would end only with the spin. */
    unsigned long long none = 0;
    void *noargs[] = {&y, &nine, &none};
    CHECK(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, noargs, 0));
    CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, 0, sargs, 0));
    /* Queued behind the spin: it writes y once the spin ends, so y must not move before. */
    CHECK(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, fargs, 0));
    pause_at("busy");
    double t = now();
    CUresult r = cuCtxDestroy_v2(other);
    printf("destroy=%d\ndestroy_ms=%lld\n", (int)r, (long long)((now() - t) * 1000));
    pause_at("ended");
    printf("unwritten_after_spin=%lld\n", unwritten(y, 9));
    pause_at("back");
    CHECK(cuMemFree_v2(y));
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'n') { /* many small movable allocations */
    enum { N = 24, SMALL = 2 << 20 };
    P y[N];
    for (int i = 0; i < N; i++) {
      CHECK(cuMemAlloc_v2(&y[i], SMALL));
      CHECK(cuMemsetD32_v2(y[i], 100 + i, SMALL / 4));
    }
    CHECK(cuCtxSynchronize());
    pause_at("idle");
    long long u = 0;
    for (int i = 0; i < N; i++) {
      CHECK(cuMemcpyDtoH_v2(buf, y[i], SMALL));
      for (int k = 0; k < SMALL / 4; k++) u += buf[k] != 100u + i;
    }
    printf("unwritten_after_swap=%lld\n", u);
    pause_at("back");
    for (int i = 0; i < N; i++) CHECK(cuMemFree_v2(y[i]));
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'v') { /* the program's own VMM handles, mapped as PyTorch's expandable segments map them */
    NEED(cuMemAddressReserve) NEED(cuMemAddressFree) NEED(cuMemCreate) NEED(cuMemRelease)
    NEED(cuMemMap) NEED(cuMemUnmap) NEED(cuMemSetAccess) NEED(cuMemRetainAllocationHandle)
    unsigned long long (*dev_used)(int) = dlsym(lib, "vgpusim_device_used");
    if (!dev_used) return 3;
    enum { M = 1 << 20 };
    NEED(cuMemExportToShareableHandle) NEED(cuMemGetAllocationPropertiesFromHandle)
    /* a: 16 MiB; b: 8 MiB, released while mapped; c: 4 MiB, mapped whole and its second half
       once more; d: 2 MiB, exported (it must stay); e: 2 MiB with a shareable handle type and
       the GPUDirect RDMA flag, as PyTorch's segments, not exported. */
    size_t sz[5] = {16 * M, 8 * M, 4 * M, 2 * M, 2 * M};
    P h[5], base;
    CHECK(cuMemAddressReserve(&base, 64 * M, 0, 0, 0));
    P va[5] = {base, base + 16 * M, base + 24 * M, base + 32 * M, base + 34 * M}, c2 = base + 28 * M;
    for (int i = 0; i < 5; i++) {
      struct prop pr = {1, i >= 3 ? 1 : 0, 1, 0, 0, {0, i == 4, 0}};
      CHECK(cuMemCreate(&h[i], sz[i], &pr, 0));
      CHECK(cuMemMap(va[i], sz[i], 0, h[i], 0));
    }
    CHECK(cuMemMap(c2, 2 * M, 2 * M, h[2], 0));
    struct access rw = {1, 0, 3};
    CHECK(cuMemSetAccess(base, 30 * M, &rw, 1)); /* a, b, c and c's second half at once */
    CHECK(cuMemSetAccess(va[3], sz[3] + sz[4], &rw, 1));
    for (int i = 0; i < 5; i++) CHECK(cuMemsetD32_v2(va[i], 11 + i, sz[i] / 4));
    int fd = -1;
    CHECK(cuMemExportToShareableHandle(&fd, h[3], 1, 0));
    close(fd);
    CHECK(cuMemRelease(h[1])); /* b lives on through its mapping */
    CHECK(cuCtxSynchronize());
    printf("d=%llu\n", h[3]);
    printf("device_used_before=%llu\n", dev_used(0));
    pause_at("idle");
    /* Swapped out meanwhile: the device has its memory back (no call of ours since). */
    printf("device_used_out=%llu\n", dev_used(0));
    /* The first call that can touch device memory brings everything back, at its addresses. */
    long long u = 0;
    for (int i = 0; i < 5; i++) u += wrong_words(va[i], sz[i], 11 + i);
    u += wrong_words(c2, 2 * M, 13);
    printf("unwritten_after_swap=%lld\n", u);
    printf("device_used_back=%llu\n", dev_used(0));
    P r = 0;
    CHECK(cuMemRetainAllocationHandle(&r, (void *)va[0]));
    printf("retained_is_created=%d\n", r == h[0]);
    CHECK(cuMemRelease(r));
    /* e's properties and its export through the value cuMemCreate answered (the driver's
       handle is another by now). */
    struct prop got = {0};
    CHECK(cuMemGetAllocationPropertiesFromHandle(&got, h[4]));
    printf("e_props_kept=%d\n", got.handle_types == 1 && got.flags[1] == 1 && got.loc_type == 1);
    CHECK(cuMemExportToShareableHandle(&fd, h[4], 1, 0));
    close(fd);
    pause_at("back");
    /* The program's own handle values, as cuMemCreate answered them. */
    CHECK(cuMemUnmap(va[0], sz[0])); CHECK(cuMemRelease(h[0]));
    CHECK(cuMemUnmap(va[1], sz[1])); /* b goes with its last mapping */
    CHECK(cuMemUnmap(va[2], sz[2])); CHECK(cuMemRelease(h[2])); CHECK(cuMemUnmap(c2, 2 * M));
    CHECK(cuMemUnmap(va[3], sz[3])); CHECK(cuMemRelease(h[3]));
    CHECK(cuMemUnmap(va[4], sz[4])); CHECK(cuMemRelease(h[4]));
    printf("released_again=%d\n", (int)cuMemRelease(h[0]));
    CHECK(cuMemAddressFree(base, 64 * M));
    printf("device_used_end=%llu\n", dev_used(0));
    pause_at("freed");
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'w') { /* cycling with the program's own VMM handles: idle, then a copy */
    NEED(cuMemAddressReserve) NEED(cuMemAddressFree) NEED(cuMemCreate) NEED(cuMemRelease)
    NEED(cuMemMap) NEED(cuMemUnmap) NEED(cuMemSetAccess)
    enum { M = 1 << 20 };
    size_t sz[2] = {16 * M, 8 * M};
    P h[2], base;
    CHECK(cuMemAddressReserve(&base, 24 * M, 0, 0, 0));
    P va[2] = {base, base + 16 * M};
    struct prop pr = {1, 1, 1, 0, 0, {0, 1, 0}};
    struct access rw = {1, 0, 3};
    for (int i = 0; i < 2; i++) {
      CHECK(cuMemCreate(&h[i], sz[i], &pr, 0));
      CHECK(cuMemMap(va[i], sz[i], 0, h[i], 0));
    }
    CHECK(cuMemSetAccess(base, 24 * M, &rw, 1));
    for (int i = 0; i < 2; i++) CHECK(cuMemsetD32_v2(va[i], 21 + i, sz[i] / 4));
    CHECK(cuMemRelease(h[1])); /* alive by its mapping only */
    CHECK(cuCtxSynchronize());
    printf("cycling\n");
    fflush(stdout);
    for (int k = 0; k < 40; k++) {
      usleep(60000);
      long long u = wrong_words(va[0], sz[0], 21) + wrong_words(va[1], sz[1], 22);
      if (u) { fprintf(stderr, "unwritten=%lld at cycle %d\n", u, k); return 5; }
    }
    CHECK(cuMemUnmap(va[0], sz[0])); CHECK(cuMemRelease(h[0])); CHECK(cuMemUnmap(va[1], sz[1]));
    CHECK(cuMemAddressFree(base, 24 * M));
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'x') { /* a handle imported from an exported descriptor (another process's memory) */
    NEED(cuMemAddressReserve) NEED(cuMemCreate) NEED(cuMemRelease) NEED(cuMemMap)
    NEED(cuMemUnmap) NEED(cuMemSetAccess) NEED(cuMemExportToShareableHandle)
    NEED(cuMemImportFromShareableHandle)
    enum { M = 1 << 20, N = 3, K = 3 };
    /* Three movable handles of the program's; x, exported (the exporter's memory, which
       the imports map). */
    size_t sz[N] = {6 * M, 4 * M, 2 * M};
    P h[N], va[N], x, xva, im[K], imva[K], base;
    CHECK(cuMemAddressReserve(&base, 32 * M, 0, 0, 0));
    struct prop pr = {1, 0, 1, 0, 0, {0}}, shared = {1, 1, 1, 0, 0, {0}};
    struct access rw = {1, 0, 3};
    for (int i = 0, at = 0; i < N; at += sz[i], i++) va[i] = base + at;
    for (int i = 0; i < N; i++) {
      CHECK(cuMemCreate(&h[i], sz[i], &pr, 0));
      CHECK(cuMemMap(va[i], sz[i], 0, h[i], 0));
      CHECK(cuMemSetAccess(va[i], sz[i], &rw, 1));
      CHECK(cuMemsetD32_v2(va[i], 41 + i, sz[i] / 4));
    }
    xva = base + 12 * M;
    CHECK(cuMemCreate(&x, 2 * M, &shared, 0));
    CHECK(cuMemMap(xva, 2 * M, 0, x, 0));
    CHECK(cuMemSetAccess(xva, 2 * M, &rw, 1));
    CHECK(cuMemsetD32_v2(xva, 77, 2 * M / 4));
    int fd = -1;
    CHECK(cuMemExportToShareableHandle(&fd, x, 1, 0));
    CHECK(cuCtxSynchronize());
    pause_at("idle");
    /* Swapped out and back (this copy); then the descriptor imported, as a second process
       would: the driver may answer with a value a moved handle of ours had. */
    long long u = wrong_words(va[0], sz[0], 41);
    for (int k = 0; k < K; k++) {
      imva[k] = base + 16 * M + 2 * M * k;
      CHECK(cuMemImportFromShareableHandle(&im[k], (void *)(long)fd, 1));
      CHECK(cuMemMap(imva[k], 2 * M, 0, im[k], 0));
      CHECK(cuMemSetAccess(imva[k], 2 * M, &rw, 1));
      u += wrong_words(imva[k], 2 * M, 77);
    }
    int same = 0;
    for (int k = 0; k < K; k++) for (int i = 0; i < N; i++) same += im[k] == h[i];
    printf("unwritten_imports=%lld\nimport_values_of_ours=%d\n", u, same);
    CHECK(cuMemsetD32_v2(imva[0], 88, 2 * M / 4)); /* written through an import */
    CHECK(cuCtxSynchronize());
    pause_at("idle2");
    u = wrong_words(xva, 2 * M, 88);
    for (int k = 0; k < K; k++) u += wrong_words(imva[k], 2 * M, 88);
    for (int i = 0; i < N; i++) u += wrong_words(va[i], sz[i], 41 + i);
    printf("unwritten_after_swap=%lld\n", u);
    int failed = 0;
    for (int k = 0; k < K; k++) failed += cuMemUnmap(imva[k], 2 * M) != 0 || cuMemRelease(im[k]) != 0;
    for (int i = 0; i < N; i++) failed += cuMemUnmap(va[i], sz[i]) != 0 || cuMemRelease(h[i]) != 0;
    failed += cuMemUnmap(xva, 2 * M) != 0 || cuMemRelease(x) != 0;
    close(fd);
    printf("failed_frees=%d\n", failed);
    pause_at("back");
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'r') { /* handle values the driver reuses (VGPU_SIM_REUSE_HANDLES) */
    NEED(cuMemAddressReserve) NEED(cuMemCreate) NEED(cuMemRelease) NEED(cuMemMap)
    NEED(cuMemUnmap) NEED(cuMemSetAccess)
    enum { M = 1 << 20, N = 6 };
    /* Three handles of different sizes (they come back largest first), then, after a swap,
       three more: the driver may answer those with values the first three had. */
    size_t sz[N] = {6 * M, 4 * M, 2 * M, 2 * M, 2 * M, 2 * M};
    P h[N], va[N], base;
    CHECK(cuMemAddressReserve(&base, 32 * M, 0, 0, 0));
    struct prop pr = {1, 0, 1, 0, 0, {0}};
    struct access rw = {1, 0, 3};
    for (int i = 0, at = 0; i < N; at += sz[i], i++) va[i] = base + at;
    for (int i = 0; i < N; i++) {
      if (i == 3) { CHECK(cuCtxSynchronize()); pause_at("idle"); }
      CHECK(cuMemCreate(&h[i], sz[i], &pr, 0));
      CHECK(cuMemMap(va[i], sz[i], 0, h[i], 0));
      CHECK(cuMemSetAccess(va[i], sz[i], &rw, 1));
      CHECK(cuMemsetD32_v2(va[i], 41 + i, sz[i] / 4));
    }
    int same = 0;
    for (int i = 0; i < N; i++) for (int j = 0; j < i; j++) same += h[i] == h[j];
    long long u = 0;
    for (int i = 0; i < N; i++) u += wrong_words(va[i], sz[i], 41 + i);
    printf("same_values=%d\nunwritten_after_swap=%lld\n", same, u);
    int failed = 0;
    for (int i = 0; i < N; i++) failed += cuMemUnmap(va[i], sz[i]) != 0 || cuMemRelease(h[i]) != 0;
    printf("failed_frees=%d\n", failed);
    pause_at("back");
    printf("end\n");
    return 0;
  }
  if (argv[1][0] == 'm') { /* movable: plain allocations, nothing oversubscribed */
    NEED(cuIpcGetMemHandle)
    P y[3];
    char ipc[64];
    for (int i = 0; i < 3; i++) {
      CHECK(cuMemAlloc_v2(&y[i], CHUNK));
      CHECK(cuMemsetD32_v2(y[i], 10 + i, CHUNK / 4));
    }
    printf("ipc=%d\n", (int)cuIpcGetMemHandle(ipc, y[0]));
    CHECK(cuCtxSynchronize());
    pause_at("idle");
    if (argv[1][1] == 'q') { /* mq: the first calls after the swap-out ask about an address */
      NEED(cuMemGetAddressRange_v2) NEED(cuPointerGetAttribute) NEED(cuPointerGetAttributes)
      P qb = 0; size_t qs = 0;
      int ordinal = -1, ordinal2 = -1, attr = 9; /* CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL */
      void *out = &ordinal2;
      printf("range=%d\n", (int)cuMemGetAddressRange_v2(&qb, &qs, y[1] + 4096));
      printf("range_right=%d\n", qb == y[1] && qs == CHUNK);
      printf("attr=%d\n", (int)cuPointerGetAttribute(&ordinal, 9, y[2]));
      printf("attrs=%d\n", (int)cuPointerGetAttributes(1, &attr, &out, y[0]));
      printf("ordinals=%d,%d\n", ordinal, ordinal2);
      pause_at("queried");
    }
    long long u = 0;
    for (int i = 0; i < 3; i++) u += unwritten(y[i], 10 + i);
    printf("unwritten_after_swap=%lld\n", u);
    pause_at("back");
    for (int i = 0; i < 3; i++) CHECK(cuMemFree_v2(y[i]));
    if (argv[1][1] == 'f') pause_at("freed"); /* mf: the test looks once they are freed */
    printf("end\n");
    return 0;
  }
  for (int i = 0; i < 7; i++) CHECK(cuMemAlloc_v2(&filler[i], CHUNK));
  CHECK(cuMemAlloc_v2(&x, CHUNK)); /* host-backed: the device is full */
  CHECK(cuMemsetD32_v2(x, 5, CHUNK / 4));
  CHECK(cuMemFree_v2(filler[0]));
  CHECK(cuCtxSynchronize()); /* moves x onto the device */
  if (argv[1][0] == 'u') { /* resolves a function that touches memory and is not listed */
    NEED(cuMemsetD16Async)
  }
  if (argv[1][0] == 'y') { /* cycling: idle (swapped out), then a copy (swapped in), again */
    printf("cycling\n");
    fflush(stdout);
    for (int i = 0; i < 40; i++) {
      usleep(60000);
      long long u = unwritten(x, 5);
      if (u) { fprintf(stderr, "unwritten=%lld at cycle %d\n", u, i); return 5; }
    }
    unsigned long long (*creations)(void) = dlsym(lib, "vgpusim_host_creations");
    printf("host_creations=%lld\n", creations ? (long long)creations() : -1ll);
    return 0;
  }
  pause_at("resident");
  CHECK(cuEventCreate(&ev, 0));
  CHECK(cuEventRecord(ev, 0));
  pause_at("idle"); /* swapped out here, by the idle time or a request */
  if (argv[1][0] == 'f') { /* the first call after it is one of a family: f:<family> */
    const char *f = argv[1] + 2;
    unsigned long long words = CHUNK / 4;
    unsigned five = 5;
    void *args[] = {&x, &five, &words};
    CUresult r = 1;
    if (!strcmp(f, "launch")) r = cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, args, 0);
    else if (!strcmp(f, "memset")) r = cuMemsetD32Async(x, 5, CHUNK / 4, 0);
    else if (!strcmp(f, "stream")) r = cuStreamSynchronize(0);
    else if (!strcmp(f, "event")) r = cuEventSynchronize(ev);
    else if (!strcmp(f, "context")) r = cuCtxSynchronize();
    printf("first=%d\n", (int)r);
    pause_at("first");
  }
  if (argv[1][0] == 'u') { /* the first call after it: the unlisted one, 16 bytes of 7s */
    printf("first=%d\n", (int)cuMemsetD16Async(x, 7, 8, 0));
    pause_at("first");
  }
  if (argv[1][0] == 'c') { /* crowded: the released room is taken meanwhile */
    printf("refilled=%d\n", (int)cuMemAlloc_v2(&filler[0], CHUNK));
    unsigned long long words = CHUNK / 4;
    unsigned nine = 9;
    void *args[] = {&x, &nine, &words};
    printf("launch_while_full=%d\n", (int)cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, args, 0));
    pause_at("refused");
    CHECK(cuMemFree_v2(filler[0]));
  }
  /* The next call that touches device memory brings x back first. */
  printf("unwritten_after_swap=%lld\n", unwritten(x, 5));
  if (argv[1][0] == 'k') { /* data needs the host memory kept for the next swap-out */
    CUresult r = cuMemAlloc_v2(&filler[0], CHUNK); /* the device is full: host-backed */
    printf("data_alloc=%d\n", (int)r);
    if (!r) { CHECK(cuMemsetD32_v2(filler[0], 6, CHUNK / 4)); printf("data_unwritten=%lld\n", unwritten(filler[0], 6)); }
  }
  unsigned long long words = CHUNK / 4;
  unsigned seven = 7;
  void *args[] = {&x, &seven, &words};
  CHECK(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, 0, args, 0));
  CHECK(cuCtxSynchronize());
  printf("unwritten_after_fill=%lld\n", unwritten(x, 7));
  pause_at("back");
  printf("end\n");
  return 0;
}
"#;

fn program() -> &'static Standalone {
    static P: OnceLock<Standalone> = OnceLock::new();
    P.get_or_init(|| support::standalone("swap", "swap", PROGRAM))
}

/// The program running one scenario, stopped at its pauses (its stderr in a file of its
/// own, the hook's log among it).
struct Scenario {
    p: Paused,
    cache: PathBuf,
    /// Where its stderr goes.
    log: PathBuf,
}

impl std::ops::Deref for Scenario {
    type Target = Paused;
    fn deref(&self) -> &Paused {
        &self.p
    }
}

impl std::ops::DerefMut for Scenario {
    fn deref_mut(&mut self) -> &mut Paused {
        &mut self.p
    }
}

impl Scenario {
    /// Starts `scenario` on a shared file of its own, named `name`.
    fn start(name: &str, scenario: &str, env: &[(&str, &str)]) -> Scenario {
        let p = program();
        let cache = p.fresh_cache(&format!("{name}.cache"));
        let mut cmd = p.hooked(&[scenario], &cache);
        support::small_oversubscribed_device(&mut cmd);
        // No room board unless a test names one: other tests' processes on the simulated GPU
        // must not want this one's memory.
        cmd.env("LIBCUDA_LOG_LEVEL", "3")
            .env("VGPU_TURN_DIR", "off")
            .env_remove("VGPU_IDLE_SWAP")
            .env_remove("VGPU_SWAP_IN_WAIT")
            .env_remove("VGPU_SWAP_KEEP_HOST");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let log = cache.with_extension("log");
        cmd.stderr(std::fs::File::create(&log).unwrap());
        Scenario {
            p: Paused::spawn(cmd),
            cache,
            log,
        }
    }

    /// What it wrote to stderr so far.
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn table(&self) -> UsageTable {
        UsageTable::open_existing(&self.cache).unwrap()
    }

    fn snapshot(&self) -> TableSnapshot {
        UsageTable::open_read_only(&self.cache).unwrap().snapshot()
    }

    /// Waits up to `within` for the program's slot to say swapped out (or not).
    fn wait_swapped(&self, want: bool, within: Duration) -> TableSnapshot {
        let start = Instant::now();
        loop {
            let snap = self.snapshot();
            if snap
                .processes
                .first()
                .is_some_and(|p| p.swapped_out == want)
            {
                return snap;
            }
            assert!(
                start.elapsed() < within,
                "not swapped {} within {within:?}: {snap:?}\n{}\n{}",
                if want { "out" } else { "in" },
                self.out,
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `within` for the hook's log to say `text`.
    fn wait_logged(&self, text: &str, within: Duration) {
        let start = Instant::now();
        while !self.stderr().contains(text) {
            assert!(
                start.elapsed() < within,
                "no {text:?} in the log within {within:?}:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn finish(self) {
        self.p.finish();
    }

    /// Waits up to 15 s for `n` staged allocations to be in pinned host memory (the
    /// `vgpu-swap` thread's background pinning, docs/swap.md "Pageable staging").
    fn wait_settled(&self, n: usize) {
        let start = Instant::now();
        while self
            .stderr()
            .matches("staged bytes into pinned host memory")
            .count()
            < n
        {
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "not {n} staged allocations pinned:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Lets the program read its memory back after a swap (a gated call brings it in first),
    /// checks that nothing was lost, and lets it end.
    fn back_intact(mut self) {
        self.go();
        self.reach("back");
        assert_eq!(
            self.value("unwritten_after_swap"),
            0,
            "data lost in the swap"
        );
        self.go();
        self.finish();
    }

    /// Waits for the idle swap-out and checks that the host memory it filled had all been
    /// pinned before it (its log line says none was pinned for it): the log.
    fn swapped_into_memory_pinned_ahead(&self) -> String {
        self.wait_swapped(true, Duration::from_secs(10));
        let log = self.stderr();
        assert!(
            log.contains(", 0 of them into host memory pinned for it"),
            "the swap-out pinned host memory itself:\n{log}"
        );
        log
    }
}

/// Data bytes of the program once its buffer is on the device: six fillers and the buffer.
const RESIDENT_DATA: u64 = 7 * CHUNK;

/// Runs to `idle`; `check`: the buffer is on the device at `resident` (not for an idle
/// trigger, which may already have swapped it out by the time the test looks).
fn resident(p: &mut Scenario, check: bool) {
    p.reach("resident");
    if check {
        let snap = p.snapshot();
        assert_eq!(snap.devices[0].host, 0, "the buffer moved onto the device");
        assert_eq!(snap.devices[0].data, RESIDENT_DATA);
        assert!(!snap.processes[0].swapped_out);
    }
    p.go();
    p.reach("idle");
}

#[test]
fn an_idle_process_is_swapped_out_and_its_next_copy_brings_everything_back_intact() {
    let mut p = Scenario::start("idle", "plain", &[("VGPU_IDLE_SWAP", "200ms")]);
    resident(&mut p, false);
    // Idle (waiting on its stdin, no call): swapped out, its device bytes now host bytes.
    let out = p.wait_swapped(true, Duration::from_secs(10));
    assert_eq!(out.devices[0].host, CHUNK, "the buffer is in host memory");
    assert_eq!(
        out.devices[0].data,
        RESIDENT_DATA - CHUNK,
        "its device memory was given back"
    );
    p.go();
    p.reach("back");
    let back = p.snapshot();
    assert_eq!(back.devices[0].host, 0, "everything came back: {back:?}");
    assert!(!back.processes[0].swapped_out);
    assert_eq!(back.devices[0].data, RESIDENT_DATA);
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    assert_eq!(
        p.value("unwritten_after_fill"),
        0,
        "the launch missed the buffer"
    );
    p.go();
    p.finish();
}

#[test]
fn an_idle_process_pins_the_host_memory_it_needs_before_its_swap_out() {
    let mut p = Scenario::start("ahead", "plain", &[("VGPU_IDLE_SWAP", "600ms")]);
    resident(&mut p, false);
    let log = p.swapped_into_memory_pinned_ahead();
    let ahead = log.find("pinned 16777216 bytes of host memory ahead of a swap-out");
    assert!(ahead.is_some() && ahead < log.find("swapped out 16777216 bytes"));
    p.back_intact();
}

#[test]
fn many_small_allocations_are_all_pinned_ahead_of_the_swap_out() {
    // 24 movable allocations of 2 MiB (PyTorch's small segments), a tick of 100 ms and half a
    // second between the pinning's start and the swap-out: a step pins what it can in its
    // tick, not one allocation each.
    let mut p = Scenario::start(
        "many",
        "n",
        &[("VGPU_IDLE_SWAP", "1s"), ("VGPU_SWAP_MOVABLE", "1")],
    );
    p.reach("idle");
    let log = p.swapped_into_memory_pinned_ahead();
    assert!(log.contains("swapped out 50331648 bytes"), "{log}");
    p.back_intact();
}

#[test]
fn host_memory_kept_for_a_swap_out_gives_way_to_the_program_s_data() {
    // The host lets the process pin 24 MiB: the 16 MiB kept after the swap-in and a new
    // 16 MiB host-backed allocation do not both fit, and the data must win.
    let mut p = Scenario::start(
        "gives-way",
        "k",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SIM_HOST_PINNED_LIMIT", "24m"),
        ],
    );
    resident(&mut p, false);
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    assert_eq!(p.value("data_alloc"), 0, "{}", p.stderr());
    assert_eq!(p.value("data_unwritten"), 0);
    assert_eq!(
        kept(&p.snapshot()),
        (Some(0), Some(0)),
        "the kept memory went"
    );
    p.go();
    p.finish();
}

/// What a snapshot says of the pinned host memory kept for swap-outs (docs/swap.md, "Host
/// memory"): the first process's figure and the file's.
fn kept(snap: &TableSnapshot) -> (Option<u64>, Option<u64>) {
    (
        snap.processes.first().and_then(|p| p.kept_host),
        snap.kept_host,
    )
}

/// The host memory kept between swaps is in the shared file, exactly: none before the first
/// swap, none while it holds the swapped data (the host class counts that), the buffer's size
/// once a swap-in emptied and kept it, and none once the process is gone.
#[test]
fn host_memory_kept_between_swaps_is_in_the_shared_file() {
    let mut p = Scenario::start("kept", "plain", &[("VGPU_IDLE_SWAP", "manual")]);
    resident(&mut p, false);
    assert_eq!(kept(&p.snapshot()), (Some(0), Some(0)));
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    // Staged (nothing was pinned), then pinned in the background: it holds the data.
    p.wait_settled(1);
    let out = p.snapshot();
    assert_eq!(
        (out.devices[0].host, kept(&out)),
        (CHUNK, (Some(0), Some(0))),
        "while it holds the data, it is the host class"
    );
    p.go();
    p.reach("back");
    let back = p.snapshot();
    assert_eq!(
        (back.devices[0].host, kept(&back)),
        (0, (Some(CHUNK), Some(CHUNK))),
        "emptied by the swap-in and kept: {}",
        p.stderr()
    );
    let cache = p.cache.clone();
    p.go();
    p.finish();
    let gone = UsageTable::open_read_only(&cache).unwrap().snapshot();
    assert_eq!(kept(&gone), (None, Some(0)), "{gone:?}");
}

#[test]
fn without_keeping_host_memory_none_is_in_the_shared_file() {
    let mut p = Scenario::start(
        "kept-off",
        "plain",
        &[("VGPU_IDLE_SWAP", "manual"), ("VGPU_SWAP_KEEP_HOST", "0")],
    );
    resident(&mut p, false);
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    p.go();
    p.reach("back");
    assert_eq!(kept(&p.snapshot()), (Some(0), Some(0)), "{}", p.stderr());
    p.go();
    p.finish();
}

/// Freeing the allocations gives their kept host memory back, and the file says so.
#[test]
fn freed_allocations_take_their_kept_host_memory_out_of_the_shared_file() {
    let mut p = Scenario::start(
        "kept-freed",
        "mf",
        &[("VGPU_IDLE_SWAP", "manual"), ("VGPU_SWAP_MOVABLE", "1")],
    );
    p.reach("idle");
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    p.wait_settled(3);
    p.go();
    p.reach("back");
    assert_eq!(kept(&p.snapshot()), (Some(3 * CHUNK), Some(3 * CHUNK)));
    p.go();
    p.reach("freed");
    assert_eq!(kept(&p.snapshot()), (Some(0), Some(0)), "{}", p.stderr());
    p.go();
    p.finish();
}

/// Host memory pinned ahead of an idle swap-out is kept memory until the swap-out fills it.
#[test]
fn host_memory_pinned_ahead_is_in_the_shared_file_until_the_swap_out_fills_it() {
    // Pinned after half of the 2 s, swapped out after all of it: a second to look.
    let mut p = Scenario::start("kept-ahead", "plain", &[("VGPU_IDLE_SWAP", "2s")]);
    resident(&mut p, false);
    p.wait_logged(
        "pinned 16777216 bytes of host memory ahead of a swap-out",
        Duration::from_secs(10),
    );
    let ahead = p.snapshot();
    assert!(!ahead.processes[0].swapped_out, "looked too late");
    assert_eq!(kept(&ahead), (Some(CHUNK), Some(CHUNK)));
    p.swapped_into_memory_pinned_ahead();
    assert_eq!(kept(&p.snapshot()), (Some(0), Some(0)));
    p.go();
    p.reach("back");
    assert_eq!(kept(&p.snapshot()), (Some(CHUNK), Some(CHUNK)));
    p.go();
    p.finish();
}

#[test]
fn a_less_urgent_process_offers_its_memory_and_swaps_out_for_a_more_urgent_want() {
    use vgpu_shm::{RoomBoard, RoomKind, RoomRecord, monotonic_ns, room_file_name};
    const GPU: &str = "GPU-5a1e5130-0000-4000-8000-0000000000bb";
    let dir = std::env::temp_dir().join(format!("vgpu-rooms-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut p = Scenario::start(
        "yield",
        "plain",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("CUDA_TASK_PRIORITY", "1"),
            ("VGPU_TURN_DIR", dir.to_str().unwrap()),
            ("VGPU_SIM_UUIDS", GPU),
        ],
    );
    resident(&mut p, false);
    // Its offer: the buffer's 16 MiB, within a second or so.
    let path = dir.join(room_file_name(GPU));
    let start = Instant::now();
    let offered = loop {
        let offers: Vec<RoomRecord> = RoomBoard::open_or_create(&path)
            .map(|b| b.records(monotonic_ns()))
            .unwrap_or_default();
        if let Some(o) = offers.iter().find(|r| r.kind == RoomKind::Offer) {
            break *o;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no offer:\n{}",
            p.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!((offered.priority, offered.bytes), (1, CHUNK));
    assert!(
        !p.snapshot().processes[0].swapped_out,
        "nobody wanted it yet"
    );
    // A more urgent container wants room on that GPU: the idle process swaps out.
    RoomBoard::open_or_create(&path)
        .unwrap()
        .post(RoomRecord {
            key: 42,
            kind: RoomKind::Want,
            priority: 0,
            bytes: CHUNK,
            stamp_ns: monotonic_ns(),
        })
        .unwrap();
    p.wait_swapped(true, Duration::from_secs(5));
    assert!(
        p.stderr()
            .contains("(a container of priority 0 needs room on device 0)"),
        "{}",
        p.stderr()
    );
    p.back_intact();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_urgent_allocation_gets_the_room_an_idle_less_urgent_process_gives_by_swapping_out() {
    // Two processes on one simulated 128 MiB GPU whose memory they share
    // (`VGPU_SIM_SHARED_MEM`): the giver (priority 1, swapping, three movable 16 MiB
    // buffers and its context: 64 MiB) idles; the taker (priority 0, no host backing, its
    // context 16 MiB) finds room for three chunks, and its fourth is made once the giver
    // swapped out for it.
    let (stdout, log, _) = urgent_beside_a_giver("trip", &[], 4);
    assert!(stdout.contains("allocated=4"), "{stdout}\n{log}");
    assert!(log.contains("room made for 16777216 bytes"), "{log}");
}

#[test]
fn an_urgent_allocation_keeps_waiting_while_a_giver_swaps_out_longer_than_an_offer_counts() {
    // The same pair, but the giver's swap-out stages (or pins) its host memory at 12 MB/s: its
    // three buffers leave the device one by one over about 4 s, longer than an offer counts
    // on the board (3 s). The taker wants all three: each of its allocations beyond the room
    // waits for the next buffer to leave. Without the giver saying it still gives while it
    // moves, the third found no offer and failed at once (the H200 did the same with 24 GiB
    // pinned in 6.6 s: `swap_torch.py --priority`).
    let (stdout, log, giver) = urgent_beside_a_giver(
        "slow",
        &[
            ("VGPU_SIM_HOST_PIN_MBPS", "12"),
            ("VGPU_SIM_PAGEABLE_MBPS", "12"),
        ],
        6,
    );
    assert!(
        stdout.contains("allocated=6"),
        "{stdout}\ntaker:\n{log}\ngiver:\n{giver}"
    );
    assert_eq!(
        log.matches("room made for 16777216 bytes").count(),
        3,
        "{log}"
    );
}

/// The giver (`giver_extra` added to its environment) and a taker that allocates up to
/// `chunks` chunks: the taker's stdout and log and the giver's log, once the giver swapped
/// out and came back intact.
fn urgent_beside_a_giver(
    tag: &str,
    giver_extra: &[(&str, &str)],
    chunks: u32,
) -> (String, String, String) {
    const GPU: &str = "GPU-5a1e5130-0000-4000-8000-0000000000cc";
    let dir = std::env::temp_dir().join(format!("vgpu-rooms-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let shared = dir.join("sim-memory");
    let common = [
        ("VGPU_TURN_DIR", dir.to_str().unwrap()),
        ("VGPU_SIM_UUIDS", GPU),
        ("VGPU_SIM_SHARED_MEM", shared.to_str().unwrap()),
    ];
    let mut giver_env = vec![
        ("VGPU_IDLE_SWAP", "manual"),
        ("VGPU_SWAP_MOVABLE", "1"),
        ("CUDA_TASK_PRIORITY", "1"),
    ];
    giver_env.extend(common);
    giver_env.extend(giver_extra);
    let mut giver = Scenario::start(&format!("giver-{tag}"), "m", &giver_env);
    giver.reach("idle");
    // Its offer is on the board before the taker starts.
    let board = dir.join(vgpu_shm::room_file_name(GPU));
    let start = Instant::now();
    while !vgpu_shm::RoomBoard::open_or_create(&board)
        .map(|b| !b.records(vgpu_shm::monotonic_ns()).is_empty())
        .unwrap_or(false)
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no offer:\n{}",
            giver.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let p = program();
    let cache = p.fresh_cache(&format!("taker-{tag}.cache"));
    let mode = format!("a{chunks}");
    let mut taker = p.hooked(&[&mode], &cache);
    taker
        .env("CUDA_DEVICE_MEMORY_LIMIT", "256m")
        .env("VGPU_SIM_TOTAL_MEM", "128m")
        .env("VGPU_SIM_CTX_OVERHEAD", "16m")
        .env("VGPU_SIM_MODULE_OVERHEAD", "0")
        .env("VGPU_RECONCILE_MS", "off")
        .env("CUDA_MODULE_LOADING", "EAGER")
        .env("CUDA_TASK_PRIORITY", "0")
        .env("VGPU_SWAP_IN_WAIT", "5s")
        .env("LIBCUDA_LOG_LEVEL", "3")
        .env_remove("CUDA_OVERSUBSCRIBE")
        .env_remove("VGPU_HOST_SPILL")
        .envs(common);
    let out = taker.output().unwrap();
    let (stdout, log) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{out:?}");
    let snap = giver.wait_swapped(true, Duration::from_secs(10));
    assert_eq!(
        snap.devices[0].host,
        3 * CHUNK,
        "the giver's buffers are in host memory\n{stdout}\n{log}\n{}",
        giver.stderr()
    );
    // The taker has ended: the giver's next call brings its buffers back, intact.
    let giver_log = giver.stderr();
    giver.back_intact();
    let _ = std::fs::remove_dir_all(&dir);
    (stdout, log, giver_log)
}

#[test]
fn the_first_call_of_every_gated_family_brings_the_memory_back_before_it_runs() {
    for family in ["launch", "memset", "stream", "event", "context"] {
        let mut p = Scenario::start(
            &format!("family-{family}"),
            &format!("f:{family}"),
            &[("VGPU_IDLE_SWAP", "manual")],
        );
        resident(&mut p, true);
        assert!(p.table().request_swap_out().is_some());
        p.wait_swapped(true, Duration::from_secs(10));
        p.go();
        p.reach("first");
        assert_eq!(p.value("first"), 0, "{family}");
        let snap = p.snapshot();
        assert!(!snap.processes[0].swapped_out, "{family}: still out");
        assert_eq!(snap.devices[0].host, 0, "{family}: not all back");
        assert_eq!(snap.devices[0].data, RESIDENT_DATA, "{family}");
        p.go();
        p.reach("back");
        assert_eq!(p.value("unwritten_after_swap"), 0, "{family}: data lost");
        p.go();
        p.finish();
    }
}

#[test]
fn plain_allocations_made_movable_are_swapped_out_and_refuse_ipc() {
    let mut p = Scenario::start(
        "movable",
        "m",
        &[("VGPU_IDLE_SWAP", "manual"), ("VGPU_SWAP_MOVABLE", "1")],
    );
    p.reach("idle");
    assert_ne!(
        p.value("ipc"),
        0,
        "movable memory has no IPC handle: refused, not a handle to the wrong memory"
    );
    assert!(p.stderr().contains("VGPU_SWAP_MOVABLE=0"), "{}", p.stderr());
    let before = p.snapshot();
    assert_eq!(before.devices[0].data, 3 * CHUNK);
    assert_eq!(before.devices[0].host, 0, "nothing oversubscribed");
    assert!(p.table().request_swap_out().is_some());
    let out = p.wait_swapped(true, Duration::from_secs(10));
    assert_eq!((out.devices[0].data, out.devices[0].host), (0, 3 * CHUNK));
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    let back = p.snapshot();
    assert_eq!((back.devices[0].data, back.devices[0].host), (3 * CHUNK, 0));
    p.go();
    p.finish();
    // Without the switch the same program's memory cannot move: nothing is swapped.
    let mut p = Scenario::start("not-movable", "m", &[("VGPU_IDLE_SWAP", "manual")]);
    p.reach("idle");
    assert_eq!(p.value("ipc"), 0, "plain memory keeps its IPC handle");
    assert!(p.table().request_swap_out().is_some());
    p.wait_logged(
        "no device memory of this process can move",
        Duration::from_secs(10),
    );
    assert_eq!(p.snapshot().devices[0].host, 0);
    p.go();
    p.reach("back");
    p.go();
    p.finish();
    // The switch without swapping (`VGPU_IDLE_SWAP` unset) changes nothing: the memory
    // could never move, so it keeps its IPC handle.
    let mut p = Scenario::start("movable-unused", "m", &[("VGPU_SWAP_MOVABLE", "1")]);
    p.reach("idle");
    assert_eq!(p.value("ipc"), 0, "{}", p.stderr());
    p.go();
    p.reach("back");
    p.go();
    p.finish();
}

#[test]
fn a_context_ends_at_once_while_a_swap_out_waits_for_a_busy_context() {
    // Issue 27: a swap-out synchronizes every context before it moves anything. One of them
    // runs a 4 s kernel; meanwhile the program destroys another, idle one. That must not
    // wait for the busy context (the hook never hangs the program), and nothing may move
    // while the kernel and the fill queued behind it can still use the memory.
    let mut p = Scenario::start(
        "busy",
        "b",
        &[("VGPU_IDLE_SWAP", "manual"), ("VGPU_SWAP_MOVABLE", "1")],
    );
    p.reach("busy");
    assert!(p.table().request_swap_out().is_some());
    // The swapper looks every 100 ms: by now it waits on the busy context.
    std::thread::sleep(Duration::from_millis(600));
    p.go();
    p.reach("ended");
    assert_eq!(p.value("destroy"), 0);
    let took = p.value("destroy_ms");
    assert!(
        took < 2000,
        "ending an idle context waited {took} ms for a swap-out\n{}",
        p.stderr()
    );
    let snap = p.snapshot();
    assert!(
        !snap.processes[0].swapped_out && snap.devices[0].host == 0,
        "memory moved while a kernel could use it: {snap:?}"
    );
    // The swap-out gives up on the busy context, and says so, while the kernel still runs.
    p.wait_logged("a context still has work after", Duration::from_secs(2));
    assert!(!p.snapshot().processes[0].swapped_out);
    p.go();
    p.reach("back");
    assert_eq!(
        p.value("unwritten_after_spin"),
        0,
        "the fill's write was lost"
    );
    p.go();
    p.finish();
}

#[test]
fn threads_at_work_never_lose_a_write_to_swaps_asked_for_all_the_time() {
    let mut p = Scenario::start(
        "threads",
        "t",
        &[("VGPU_IDLE_SWAP", "manual"), ("VGPU_SWAP_MOVABLE", "1")],
    );
    p.line("working");
    let table = p.table();
    // Ask every 5 ms while three threads write and read their buffers.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) && p.running() {
        table.request_swap_out();
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = p.end();
    assert!(st.success(), "{}\n{}", p.out, p.stderr());
    assert_eq!(
        p.value("wrong"),
        0,
        "a write was lost or a read saw old data"
    );
    let log = p.stderr();
    let outs = log.matches("swapped out").count();
    let ins = log.matches("swapped back in after").count();
    // Whether a swap-out finds a quiet moment is timing; what it must never do is break the
    // data. Most runs swap many times; none may swap without coming back.
    assert!(ins + 1 >= outs, "{outs} out, {ins} in:\n{log}");
    eprintln!("threads: {outs} swap-outs, {ins} swap-ins");
}

#[test]
fn a_request_in_the_shared_file_swaps_out_a_manual_process() {
    let mut p = Scenario::start("manual", "plain", &[("VGPU_IDLE_SWAP", "manual")]);
    resident(&mut p, true);
    // Not idle-triggered: nothing moves by itself.
    std::thread::sleep(Duration::from_millis(400));
    assert!(!p.snapshot().processes[0].swapped_out, "swapped unasked");
    assert!(p.table().request_swap_out().is_some());
    let out = p.wait_swapped(true, Duration::from_secs(10));
    assert_eq!(out.devices[0].host, CHUNK);
    p.go();
    p.reach("back");
    assert_eq!(p.snapshot().devices[0].host, 0);
    assert_eq!(p.value("unwritten_after_swap"), 0);
    assert_eq!(p.value("unwritten_after_fill"), 0);
    p.go();
    p.finish();
}

/// Where the hook has slots for unlisted functions (x86-64 Linux), such a function is gated
/// like a listed one: the process is swapped out, and its call through the pointer it
/// resolved brings the memory back first.
#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn an_unlisted_function_that_can_touch_device_memory_is_gated_by_its_slot() {
    let mut p = Scenario::start("unlisted", "u", &[("VGPU_IDLE_SWAP", "manual")]);
    resident(&mut p, true);
    assert!(p.table().request_swap_out().is_some());
    let out = p.wait_swapped(true, Duration::from_secs(10));
    assert_eq!(out.devices[0].host, CHUNK, "swapped out, not refused");
    p.go();
    p.reach("first");
    assert_eq!(
        p.value("first"),
        0,
        "the memset ran on memory that was back"
    );
    let snap = p.snapshot();
    assert!(!snap.processes[0].swapped_out);
    assert_eq!(snap.devices[0].host, 0);
    assert_eq!(snap.devices[0].data, RESIDENT_DATA);
    p.go();
    p.reach("back");
    assert_eq!(
        p.value("unwritten_after_swap"),
        4,
        "the memset's 16 bytes changed, nothing else"
    );
    p.go();
    p.finish();
}

/// Without slots (other architectures), a process that resolved an unlisted function that
/// can touch device memory is refused.
#[test]
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn a_process_that_resolved_an_ungated_function_is_never_swapped_out() {
    let mut p = Scenario::start("uncovered", "u", &[("VGPU_IDLE_SWAP", "manual")]);
    resident(&mut p, true);
    assert!(p.table().request_swap_out().is_some());
    p.wait_logged("not swapping out", Duration::from_secs(10));
    assert!(
        p.stderr().contains("resolved cuMemsetD16Async"),
        "the refusal names the function: {}",
        p.stderr()
    );
    let snap = p.snapshot();
    assert!(!snap.processes[0].swapped_out);
    assert_eq!(snap.devices[0].host, 0);
    p.go();
    p.reach("back");
    p.go();
    p.finish();
}

#[test]
fn without_the_switch_nothing_is_swapped_and_requests_are_ignored() {
    let mut p = Scenario::start("off", "plain", &[]);
    resident(&mut p, true);
    assert!(p.table().request_swap_out().is_some());
    std::thread::sleep(Duration::from_millis(500));
    let snap = p.snapshot();
    assert!(!snap.processes[0].swapped_out);
    assert_eq!(snap.devices[0].host, 0);
    p.go();
    p.reach("back");
    p.go();
    p.finish();
}

#[test]
fn a_swap_in_without_room_waits_then_fails_cleanly_and_the_data_survives() {
    let mut p = Scenario::start(
        "crowded",
        "crowded",
        &[("VGPU_IDLE_SWAP", "200ms"), ("VGPU_SWAP_IN_WAIT", "300ms")],
    );
    resident(&mut p, false);
    p.wait_swapped(true, Duration::from_secs(10));
    p.go();
    p.reach("refused");
    // The room the swap-out released went to a new allocation, on the device.
    assert_eq!(p.value("refilled"), 0);
    assert_eq!(
        p.value("launch_while_full"),
        2,
        "a launch with no room to swap in is CUDA_ERROR_OUT_OF_MEMORY"
    );
    let snap = p.snapshot();
    assert!(snap.processes[0].swapped_out, "still out");
    assert_eq!(snap.devices[0].host, CHUNK, "still whole in host memory");
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    assert_eq!(p.value("unwritten_after_fill"), 0);
    assert_eq!(p.snapshot().devices[0].host, 0);
    p.go();
    p.finish();
}

#[test]
fn a_process_killed_at_any_point_of_its_swaps_leaves_the_table_exact() {
    // Swapped out every 60 ms of idleness and back on the next copy, killed at instants
    // spread over the cycle: out, in, between, or in the middle of a move.
    for (k, at_ms) in [37u64, 101, 163, 229, 307, 401, 499, 613]
        .into_iter()
        .enumerate()
    {
        let mut p = Scenario::start(
            &format!("kill{k}"),
            "y",
            &[("VGPU_IDLE_SWAP", "20ms"), ("LIBCUDA_LOG_LEVEL", "0")],
        );
        p.line("cycling");
        std::thread::sleep(Duration::from_millis(at_ms));
        p.kill();
        // A writable look sweeps the dead process: nothing of it may stay counted.
        let snap = p.table().snapshot();
        assert!(snap.processes.is_empty(), "{snap:?}");
        let d = &snap.devices[0];
        assert_eq!(
            (d.used, d.data, d.context, d.host),
            (0, 0, 0, 0),
            "killed after {at_ms} ms: {d:?}"
        );
    }
}

#[test]
fn swapping_cycles_keep_the_data_whole_and_pin_host_memory_once() {
    let (outs, creations) = cycle(&[]);
    // x's first home (host-backed: the device was full) and the first swap-out's: every later
    // swap-out finds the host memory its swap-in kept.
    assert_eq!(
        creations, 2,
        "{outs} swap-outs pinned host memory {creations} times"
    );
}

#[test]
fn without_keeping_host_memory_every_swap_out_stages_and_pins_nothing() {
    let (outs, creations) = cycle(&[("VGPU_SWAP_KEEP_HOST", "0")]);
    // x's first home only (host-backed: the device was full): with no pinned memory kept,
    // every swap-out stages in pageable memory and nothing is pinned in the background
    // (before pageable staging, every swap-out pinned afresh).
    assert_eq!(
        creations, 1,
        "{outs} swap-outs pinned host memory {creations} times"
    );
}

/// The cycling program (40 idle spells, each ended by a copy) under `VGPU_IDLE_SWAP=20ms`:
/// the swap-outs the hook logged (at least this many: the log's rate limit folds some) and
/// the host allocations the driver made.
fn cycle(env: &[(&str, &str)]) -> (usize, i64) {
    let p = program();
    let cache = p.fresh_cache("cycles.cache");
    let mut cmd = p.hooked(&["y"], &cache);
    support::small_oversubscribed_device(&mut cmd);
    let out = cmd
        .env("VGPU_IDLE_SWAP", "20ms")
        .env("LIBCUDA_LOG_LEVEL", "3")
        .env("VGPU_TURN_DIR", "off")
        .env_remove("VGPU_SWAP_KEEP_HOST")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    let outs = err.matches("swapped out 16777216 bytes").count();
    let ins = err.matches("swapped back in after").count();
    assert!(
        outs >= 10,
        "only {outs} swap-outs in 40 idle spells:\n{err}"
    );
    assert!(ins >= outs - 1, "{outs} out, {ins} in:\n{err}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let creations = stdout
        .lines()
        .find_map(|l| l.strip_prefix("host_creations="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no count of host allocations: {stdout}"));
    (outs, creations)
}

#[test]
fn the_program_s_own_vmm_handles_move_and_keep_their_values() {
    const M: u64 = MIB;
    let mut p = Scenario::start("program-vmm", "v", &[("VGPU_IDLE_SWAP", "manual")]);
    p.reach("idle");
    let before = p.snapshot();
    assert_eq!(before.devices[0].data, 32 * M, "five handles charged");
    assert_eq!(before.devices[0].host, 0);
    assert!(p.table().request_swap_out().is_some());
    let out = p.wait_swapped(true, Duration::from_secs(10));
    // a, b, c and e moved (30 MiB); d, exported, stayed and is named.
    assert_eq!(
        (out.devices[0].data, out.devices[0].host),
        (2 * M, 30 * M),
        "{}",
        p.stderr()
    );
    let d = format!("{:#x}", p.value("d"));
    assert!(
        p.stderr().contains(&format!(
            "the program's VMM handle {d} (2097152 bytes) stays on device 0: it was exported"
        )),
        "{}",
        p.stderr()
    );
    p.go();
    p.reach("back");
    assert_eq!(
        p.value("device_used_before") - p.value("device_used_out"),
        30 * M as i64,
        "the device got the moved memory back"
    );
    assert_eq!(
        p.value("device_used_back"),
        p.value("device_used_before"),
        "and gave it again at the swap-in"
    );
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    assert_eq!(
        p.value("retained_is_created"),
        1,
        "a retain answers the value cuMemCreate did"
    );
    assert_eq!(
        p.value("e_props_kept"),
        1,
        "the handle made at the swap-in has the program's properties"
    );
    let back = p.snapshot();
    assert!(!back.processes[0].swapped_out);
    assert_eq!((back.devices[0].data, back.devices[0].host), (32 * M, 0));
    assert_eq!(
        kept(&back),
        (Some(30 * M), Some(30 * M)),
        "the emptied host memory"
    );
    p.go();
    p.reach("freed");
    assert_eq!(
        kept(&p.snapshot()),
        (Some(0), Some(0)),
        "released with the handles"
    );
    assert_ne!(p.value("released_again"), 0, "a second release is refused");
    assert_eq!(
        p.value("device_used_before") - p.value("device_used_end"),
        32 * M as i64,
        "every handle's memory went back to the device"
    );
    let end = p.snapshot();
    assert_eq!(
        (end.devices[0].data, end.devices[0].host),
        (0, 0),
        "{end:?}"
    );
    p.go();
    p.finish();
}

#[test]
fn the_program_s_own_vmm_handles_are_pinned_ahead_of_an_idle_swap_out() {
    let mut p = Scenario::start("program-vmm-idle", "v", &[("VGPU_IDLE_SWAP", "600ms")]);
    p.reach("idle");
    p.swapped_into_memory_pinned_ahead();
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    p.go();
    p.reach("freed");
    let end = p.snapshot();
    assert_eq!(
        (end.devices[0].data, end.devices[0].host),
        (0, 0),
        "{end:?}"
    );
    p.go();
    p.finish();
}

#[test]
fn the_program_s_own_vmm_handles_survive_swap_cycles_and_kills() {
    // Forty idle spells, each swapped out (24 MiB, one handle released while mapped) and
    // brought back by the next copy, data checked every time.
    let p = program();
    let cache = p.fresh_cache("program-vmm-cycles.cache");
    let mut cmd = p.hooked(&["w"], &cache);
    support::small_oversubscribed_device(&mut cmd);
    let out = cmd
        .env("VGPU_IDLE_SWAP", "20ms")
        .env("LIBCUDA_LOG_LEVEL", "3")
        .env("VGPU_TURN_DIR", "off")
        .env_remove("VGPU_SWAP_KEEP_HOST")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    let outs = err.matches("swapped out 25165824 bytes").count();
    assert!(
        outs >= 10,
        "only {outs} swap-outs in 40 idle spells:\n{err}"
    );
    let snap = UsageTable::open_read_only(&cache).unwrap().snapshot();
    let d = &snap.devices[0];
    assert_eq!((d.data, d.host), (0, 0), "{d:?}");
    // Killed at instants spread over the cycles: nothing of it stays counted.
    for (k, at_ms) in [41u64, 113, 199, 283, 367, 457].into_iter().enumerate() {
        let mut p = Scenario::start(
            &format!("program-vmm-kill{k}"),
            "w",
            &[("VGPU_IDLE_SWAP", "20ms"), ("LIBCUDA_LOG_LEVEL", "0")],
        );
        p.line("cycling");
        std::thread::sleep(Duration::from_millis(at_ms));
        p.kill();
        let snap = p.table().snapshot();
        assert!(snap.processes.is_empty(), "{snap:?}");
        let d = &snap.devices[0];
        assert_eq!(
            (d.used, d.data, d.context, d.host),
            (0, 0, 0, 0),
            "killed after {at_ms} ms: {d:?}"
        );
    }
}

#[test]
fn a_driver_that_reuses_handle_values_never_makes_one_value_name_two_allocations() {
    let mut p = Scenario::start(
        "program-vmm-reuse",
        "r",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_KEEP_HOST", "0"),
            ("VGPU_SIM_REUSE_HANDLES", "1"),
        ],
    );
    p.reach("idle");
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    p.go();
    p.reach("back");
    assert!(
        p.stderr()
            .contains("the value of a moved handle of the program's"),
        "the driver never answered a moved handle's value: the test proves nothing\n{}",
        p.stderr()
    );
    assert_eq!(p.value("same_values"), 0, "two handles share a value");
    assert_eq!(
        p.value("unwritten_after_swap"),
        0,
        "a handle's data was overwritten"
    );
    assert_eq!(p.value("failed_frees"), 0, "{}", p.stderr());
    let end = p.snapshot();
    assert_eq!(
        (end.devices[0].data, end.devices[0].host),
        (0, 0),
        "{end:?}"
    );
    p.go();
    p.finish();
}

#[test]
fn an_imported_handle_stays_where_its_exporter_put_it_and_is_not_charged_here() {
    // Imported after a swap-out and back, under a driver that reuses handle values: an
    // import may get a moved handle's old value (which values are free depends on the order
    // the handles moved in: run until one did). The imported memory is the exporter's: never
    // moved, released or charged by this process's swap.
    let mut exercised = false;
    for attempt in 0..8 {
        let mut p = Scenario::start(
            &format!("program-vmm-import{attempt}"),
            "x",
            &[
                ("VGPU_IDLE_SWAP", "manual"),
                ("VGPU_SWAP_KEEP_HOST", "0"),
                ("VGPU_SIM_REUSE_HANDLES", "1"),
            ],
        );
        p.reach("idle");
        assert!(p.table().request_swap_out().is_some());
        p.wait_swapped(true, Duration::from_secs(10));
        p.go();
        p.reach("idle2");
        assert_eq!(
            p.value("unwritten_imports"),
            0,
            "an import maps other memory than the exporter's\n{}",
            p.stderr()
        );
        assert_eq!(
            p.value("import_values_of_ours"),
            0,
            "an import answered with a value of the program's own handle"
        );
        let before = p.snapshot();
        // The program's 12 MiB and the exported 2 MiB; the imports add nothing.
        assert_eq!(before.devices[0].data, 14 * MIB, "{before:?}");
        assert!(p.table().request_swap_out().is_some());
        p.wait_swapped(true, Duration::from_secs(10));
        let out = p.snapshot();
        assert_eq!(
            (out.devices[0].data, out.devices[0].host),
            (2 * MIB, 12 * MIB),
            "{out:?}"
        );
        assert!(
            p.stderr().contains("stays on device 0: it was imported"),
            "the swap-out does not name the imported handle\n{}",
            p.stderr()
        );
        p.go();
        p.reach("back");
        assert_eq!(
            p.value("unwritten_after_swap"),
            0,
            "memory was overwritten\n{}",
            p.stderr()
        );
        assert_eq!(p.value("failed_frees"), 0, "{}", p.stderr());
        let end = p.snapshot();
        assert_eq!(
            (end.devices[0].data, end.devices[0].host),
            (0, 0),
            "{end:?}"
        );
        exercised = p.stderr().contains("cuMemImportFromShareableHandle with");
        p.go();
        p.finish();
        if exercised {
            break;
        }
    }
    assert!(
        exercised,
        "no import was answered with a moved handle's value: the test proves less"
    );
}

#[test]
fn a_program_handle_whose_move_fails_stays_on_the_device_intact() {
    // The program maps six times (five handles, one twice); the swap-out's 7th cuMemMap maps
    // the first handle's host memory at its staging address, the 8th maps it at the handle's
    // own address; its 2nd cuMemUnmap unmaps the handle's own address (the 1st, the staging
    // one). Either refused, the handle must be back on its device memory, intact, and the
    // others move.
    for (k, fault) in ["cuMemMap:8:2", "cuMemUnmap:2:2"].into_iter().enumerate() {
        let mut p = Scenario::start(
            &format!("program-vmm-fault{k}"),
            "v",
            &[("VGPU_IDLE_SWAP", "manual"), ("VGPU_SIM_FAULTS", fault)],
        );
        p.reach("idle");
        assert!(p.table().request_swap_out().is_some());
        let out = p.wait_swapped(true, Duration::from_secs(10));
        let (data, host) = (out.devices[0].data, out.devices[0].host);
        assert_eq!(data + host, 32 * MIB, "{fault}: {out:?}");
        assert!(
            data > 2 * MIB && host > 0,
            "{fault}: one more handle stayed: {out:?}"
        );
        let log = p.stderr();
        assert!(
            log.contains("failed (error 2); it stays on device 0")
                && !log.contains("could not map the program's memory again"),
            "{fault}: {log}"
        );
        p.go();
        p.reach("back");
        assert_eq!(p.value("unwritten_after_swap"), 0, "{fault}: data lost");
        assert_eq!(
            p.value("device_used_back"),
            p.value("device_used_before"),
            "{fault}: {}",
            p.stderr()
        );
        p.go();
        p.reach("freed");
        let end = p.snapshot();
        assert_eq!(
            (end.devices[0].data, end.devices[0].host),
            (0, 0),
            "{fault}: {end:?}"
        );
        p.go();
        p.finish();
    }
}

/// Waits up to `within` for the first process's slot to say `kept` bytes of host memory kept
/// for swap-outs.
fn wait_kept(p: &Scenario, kept_bytes: u64, within: Duration) -> TableSnapshot {
    let start = Instant::now();
    loop {
        let snap = p.snapshot();
        if kept(&snap).0 == Some(kept_bytes) {
            return snap;
        }
        assert!(
            start.elapsed() < within,
            "not {kept_bytes} bytes kept within {within:?}: {snap:?}\n{}",
            p.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_swap_out_with_no_pinned_memory_at_hand_stages_and_releases_the_device_at_once() {
    // Pinning 48 MiB at 24 MB/s takes 2 s: a swap-out that pinned would be that slow. Staged
    // in pageable memory, the device is free at once, and the bytes are the host class.
    let mut p = Scenario::start(
        "staged",
        "m",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_MOVABLE", "1"),
            ("VGPU_SIM_HOST_PIN_MBPS", "24"),
        ],
    );
    p.reach("idle");
    let asked = Instant::now();
    assert!(p.table().request_swap_out().is_some());
    let out = p.wait_swapped(true, Duration::from_secs(10));
    let took = asked.elapsed();
    assert_eq!((out.devices[0].data, out.devices[0].host), (0, 3 * CHUNK));
    assert!(
        took < Duration::from_millis(1500),
        "the swap-out took {took:?}: it pinned\n{}",
        p.stderr()
    );
    let log = p.stderr();
    assert!(
        log.contains("swapped out 50331648 bytes")
            && log.contains(", 0 of them into host memory pinned for it, 50331648 staged"),
        "{log}"
    );
    // Left alone, the process gets its staged bytes pinned in the background (kept memory
    // while empty, then the host class's home): nothing kept once they are in.
    p.wait_settled(3);
    let settled = p.snapshot();
    assert_eq!(kept(&settled), (Some(0), Some(0)), "{settled:?}");
    assert_eq!(settled.devices[0].host, 3 * CHUNK, "still the host class");
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    // Its swap-in kept the pinned memory: the next swap-out pins nothing and stages nothing.
    let back = wait_kept(&p, 3 * CHUNK, Duration::from_secs(5));
    assert_eq!((back.devices[0].data, back.devices[0].host), (3 * CHUNK, 0));
    p.go();
    p.finish();
}

#[test]
fn a_wake_before_the_background_pinning_takes_the_staged_bytes_straight_back() {
    // Pinning at 2 MB/s: 8 s per allocation, so the wake comes while the first pins. It must
    // not wait for it, and the data comes back from pageable memory.
    let mut p = Scenario::start(
        "staged-wake",
        "m",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_MOVABLE", "1"),
            ("VGPU_SIM_HOST_PIN_MBPS", "2"),
        ],
    );
    p.reach("idle");
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(300));
    let woke = Instant::now();
    p.go();
    p.reach("back");
    let took = woke.elapsed();
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    assert!(
        took < Duration::from_millis(2000),
        "the wake waited {took:?} for a pinning\n{}",
        p.stderr()
    );
    let back = p.snapshot();
    assert_eq!((back.devices[0].data, back.devices[0].host), (3 * CHUNK, 0));
    assert!(!back.processes[0].swapped_out);
    p.go();
    p.finish();
}

#[test]
fn staged_bytes_stay_staged_where_the_host_refuses_to_pin_and_still_come_back() {
    // The host pins at most 8 MiB: today's swap-out could move none of the three 16 MiB
    // allocations. Staged, they leave the device; the background pinning is refused and they
    // stay in pageable memory, whole, until the swap-in.
    let mut p = Scenario::start(
        "staged-refused",
        "m",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_MOVABLE", "1"),
            ("VGPU_SIM_HOST_PINNED_LIMIT", "8m"),
        ],
    );
    p.reach("idle");
    assert!(p.table().request_swap_out().is_some());
    let out = p.wait_swapped(true, Duration::from_secs(10));
    assert_eq!((out.devices[0].data, out.devices[0].host), (0, 3 * CHUNK));
    std::thread::sleep(Duration::from_millis(500));
    let still = p.snapshot();
    assert_eq!(
        kept(&still),
        (Some(0), Some(0)),
        "nothing pinned: {still:?}"
    );
    assert_eq!(still.devices[0].host, 3 * CHUNK);
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    let back = p.snapshot();
    assert_eq!((back.devices[0].data, back.devices[0].host), (3 * CHUNK, 0));
    p.go();
    p.finish();
}

#[test]
fn a_process_killed_while_staging_or_pinning_its_staged_bytes_leaves_the_table_exact() {
    // Staging is at once on the simulator; the background pinning of 48 MiB at 24 MB/s runs
    // for 2 s, an allocation at a time: kills land before, between and inside those steps.
    for (k, at_ms) in [0u64, 5, 40, 300, 700, 1100, 1500, 2300]
        .into_iter()
        .enumerate()
    {
        let mut p = Scenario::start(
            &format!("staged-kill{k}"),
            "m",
            &[
                ("VGPU_IDLE_SWAP", "manual"),
                ("VGPU_SWAP_MOVABLE", "1"),
                ("VGPU_SIM_HOST_PIN_MBPS", "24"),
                ("LIBCUDA_LOG_LEVEL", "0"),
            ],
        );
        p.reach("idle");
        assert!(p.table().request_swap_out().is_some());
        std::thread::sleep(Duration::from_millis(at_ms));
        p.kill();
        let snap = p.table().snapshot();
        assert!(snap.processes.is_empty(), "{snap:?}");
        let d = &snap.devices[0];
        assert_eq!(
            (d.used, d.data, d.context, d.host),
            (0, 0, 0, 0),
            "killed after {at_ms} ms: {d:?}"
        );
        assert_eq!(snap.kept_host, Some(0), "killed after {at_ms} ms");
    }
}

#[test]
fn a_pointer_query_of_a_staged_allocation_brings_it_back_and_answers_as_for_resident_memory() {
    // Staged, the address maps nothing (the driver would answer "not found"): a range or
    // attribute query of it passes the gate as a touching call does.
    let mut p = Scenario::start(
        "staged-query",
        "mq",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_MOVABLE", "1"),
            ("VGPU_SIM_HOST_PIN_MBPS", "2"),
        ],
    );
    p.reach("idle");
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    p.go();
    p.reach("queried");
    let log = p.stderr();
    assert_eq!(
        (p.value("range"), p.value("range_right")),
        (0, 1),
        "cuMemGetAddressRange of a staged allocation\n{log}"
    );
    assert_eq!(p.value("attr"), 0, "cuPointerGetAttribute\n{log}");
    assert_eq!(p.value("attrs"), 0, "cuPointerGetAttributes\n{log}");
    assert!(p.out.contains("ordinals=0,0"), "{}", p.out);
    assert!(!p.snapshot().processes[0].swapped_out, "brought back");
    p.back_intact();
}

#[test]
fn a_staged_swap_in_the_driver_refuses_leaves_it_staged_whole_and_the_next_call_brings_it() {
    // The first copy back from pageable memory fails (`VGPU_SIM_FAULTS`), and the call that
    // needed it may not wait (`VGPU_SWAP_IN_WAIT=0`): that call fails with out-of-memory, the
    // allocation stays staged and charged as host bytes, and the next call brings it back.
    let mut p = Scenario::start(
        "staged-refused-in",
        "mq",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_MOVABLE", "1"),
            ("VGPU_SIM_HOST_PIN_MBPS", "2"),
            ("VGPU_SWAP_IN_WAIT", "0ms"),
            ("VGPU_SIM_FAULTS", "cuMemcpyHtoD_v2:1:999"),
        ],
    );
    p.reach("idle");
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    p.go();
    p.reach("queried");
    let log = p.stderr();
    assert_eq!(p.value("range"), 2, "out of memory\n{log}");
    assert!(log.contains("cannot swap 16777216 bytes back in"), "{log}");
    assert_eq!((p.value("attr"), p.value("attrs")), (0, 0), "{log}");
    let back = p.snapshot();
    assert_eq!((back.devices[0].data, back.devices[0].host), (3 * CHUNK, 0));
    assert!(!back.processes[0].swapped_out);
    p.back_intact();
}

#[test]
fn a_staged_swap_in_without_room_waits_then_fails_cleanly_and_the_data_survives() {
    // As `a_swap_in_without_room_waits_then_fails_cleanly_and_the_data_survives`, the buffer
    // staged (`manual`: nothing pinned ahead; pinning too slow to finish meanwhile).
    let mut p = Scenario::start(
        "staged-crowded",
        "crowded",
        &[
            ("VGPU_IDLE_SWAP", "manual"),
            ("VGPU_SWAP_IN_WAIT", "300ms"),
            ("VGPU_SIM_HOST_PIN_MBPS", "2"),
        ],
    );
    resident(&mut p, false);
    assert!(p.table().request_swap_out().is_some());
    p.wait_swapped(true, Duration::from_secs(10));
    assert!(p.stderr().contains("16777216 staged"), "{}", p.stderr());
    p.go();
    p.reach("refused");
    assert_eq!(p.value("refilled"), 0);
    assert_eq!(p.value("launch_while_full"), 2, "{}", p.stderr());
    let snap = p.snapshot();
    assert!(snap.processes[0].swapped_out, "still out");
    assert_eq!(snap.devices[0].host, CHUNK, "still whole in host memory");
    p.go();
    p.reach("back");
    assert_eq!(p.value("unwritten_after_swap"), 0, "data lost in the swap");
    assert_eq!(p.value("unwritten_after_fill"), 0);
    assert_eq!(p.snapshot().devices[0].host, 0);
    p.go();
    p.finish();
}
