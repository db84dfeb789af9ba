// What host memory for a swap-out costs to create, and how the cost splits over threads
// (docs/swap.md, issue 27). A swap-out's time is creating pinned host memory plus copying
// into it; creating it is the slower of the two on the H200, so this measures what a
// swap-out can do about it: create it on several threads at once, in smaller pieces, or
// another way (cuMemHostAlloc, registering huge-page memory), and what releasing it costs.
//
//   nvcc -O2 -o host_pin_cost gpu-tests/host_pin_cost.cu -lcuda -lpthread
//   ./host_pin_cost [GIB=8] [pageable]
//
// Prints one line per measurement: what, GiB, seconds, GB/s.
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define GIB (1ull << 30)
#define CHECK(x)                                                              \
  do {                                                                        \
    CUresult r_ = (x);                                                        \
    if (r_ != CUDA_SUCCESS) {                                                 \
      const char *s_ = 0;                                                     \
      cuGetErrorName(r_, &s_);                                                \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

static CUcontext ctx;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char *what, double gib, double s) {
  printf("%-44s %6.2f GiB %8.3f s %7.2f GB/s\n", what, gib, s, gib * GIB / s / 1e9);
  fflush(stdout);
}

static CUmemAllocationProp prop_at(CUmemLocationType type, int id) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = type;
  p.location.id = id;
  return p;
}

typedef struct {
  CUmemGenericAllocationHandle *h;
  int n;
  size_t piece;
  int release;
} Job;

static void *create_or_release(void *arg) {
  Job *j = (Job *)arg;
  CHECK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp p = prop_at(CU_MEM_LOCATION_TYPE_HOST, 0);
  for (int i = 0; i < j->n; i++) {
    if (j->release)
      CHECK(cuMemRelease(j->h[i]));
    else
      CHECK(cuMemCreate(&j->h[i], j->piece, &p, 0));
  }
  return 0;
}

// `gib` GiB of host-located VMM memory in pieces of `piece` bytes on `threads` threads; then
// released the same way.
static void host_create(int gib, size_t piece, int threads) {
  int n = (int)((size_t)gib * GIB / piece);
  CUmemGenericAllocationHandle *h = (CUmemGenericAllocationHandle *)calloc(n, sizeof *h);
  pthread_t t[64];
  Job jobs[64];
  char what[96];
  for (int release = 0; release <= 1; release++) {
    double t0 = now();
    int per = n / threads, at = 0;
    for (int k = 0; k < threads; k++) {
      int m = per + (k < n % threads);
      jobs[k] = (Job){h + at, m, piece, release};
      at += m;
      pthread_create(&t[k], 0, create_or_release, &jobs[k]);
    }
    for (int k = 0; k < threads; k++) pthread_join(t[k], 0);
    snprintf(what, sizeof what, "host cuMemCreate %s %zu MiB x %d thr",
             release ? "release" : "create ", piece >> 20, threads);
    report(what, gib, now() - t0);
  }
  free(h);
}

// A device VMM allocation's bytes copied to a host-located one and back through mapped
// addresses, as the hook's swap does (cuMemcpyDtoD between two mappings).
static void vmm_copy(int gib) {
  size_t size = (size_t)gib * GIB;
  CUmemAllocationProp pd = prop_at(CU_MEM_LOCATION_TYPE_DEVICE, 0);
  CUmemAllocationProp ph = prop_at(CU_MEM_LOCATION_TYPE_HOST, 0);
  size_t gran = 0;
  CHECK(cuMemGetAllocationGranularity(&gran, &pd, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle hd, hh;
  CHECK(cuMemCreate(&hd, size, &pd, 0));
  CHECK(cuMemCreate(&hh, size, &ph, 0));
  CUdeviceptr vd, vh;
  CHECK(cuMemAddressReserve(&vd, size, gran, 0, 0));
  CHECK(cuMemAddressReserve(&vh, size, gran, 0, 0));
  CHECK(cuMemMap(vd, size, 0, hd, 0));
  CHECK(cuMemMap(vh, size, 0, hh, 0));
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = 0;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK(cuMemSetAccess(vd, size, &a, 1));
  CHECK(cuMemSetAccess(vh, size, &a, 1));
  CHECK(cuMemsetD8(vd, 7, size));
  CHECK(cuCtxSynchronize());
  for (int rep = 0; rep < 2; rep++) {
    double t0 = now();
    CHECK(cuMemcpyDtoD(vh, vd, size));
    CHECK(cuCtxSynchronize());
    report("copy device -> host mapping (cuMemcpyDtoD)", gib, now() - t0);
    t0 = now();
    CHECK(cuMemcpyDtoD(vd, vh, size));
    CHECK(cuCtxSynchronize());
    report("copy host mapping -> device (cuMemcpyDtoD)", gib, now() - t0);
  }
  CHECK(cuMemUnmap(vd, size));
  CHECK(cuMemUnmap(vh, size));
  CHECK(cuMemAddressFree(vd, size));
  CHECK(cuMemAddressFree(vh, size));
  CHECK(cuMemRelease(hd));
  CHECK(cuMemRelease(hh));
}

static void host_alloc(int gib) {
  void *p;
  double t0 = now();
  CHECK(cuMemHostAlloc(&p, (size_t)gib * GIB, 0));
  report("cuMemHostAlloc", gib, now() - t0);
  t0 = now();
  CHECK(cuMemFreeHost(p));
  report("cuMemFreeHost", gib, now() - t0);
}

static void host_register(int gib, int huge) {
  size_t size = (size_t)gib * GIB;
  double t0 = now();
  void *p = mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    return;
  }
  if (huge) madvise(p, size, MADV_HUGEPAGE);
  CHECK(cuMemHostRegister(p, size, 0));
  report(huge ? "mmap+MADV_HUGEPAGE+cuMemHostRegister" : "mmap+cuMemHostRegister", gib,
         now() - t0);
  t0 = now();
  CHECK(cuMemHostUnregister(p));
  munmap(p, size);
  report(huge ? "  unregister+munmap (huge)" : "  unregister+munmap", gib, now() - t0);
}

// Pageable destinations: the driver's own pageable copy (cuMemcpyDtoH into fresh or
// already-faulted memory), and a ring of pinned staging buffers, one per thread, each
// thread copying its chunks device -> staging (copy engine) then staging -> fresh pageable
// memory (its CPU), and the same way back. Fresh pages fault and are zeroed by the CPU that
// first writes them, so threads spread that cost; pinning serializes (above).
#define STAGE (64ull << 20)
typedef struct {
  CUdeviceptr dev;
  char *host;
  size_t size;
  int id, threads, back;
} Ring;

static void *ring_worker(void *arg) {
  Ring *r = (Ring *)arg;
  CHECK(cuCtxSetCurrent(ctx));
  CUstream s;
  void *stage;
  CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CHECK(cuMemHostAlloc(&stage, STAGE, 0));
  for (size_t off = (size_t)r->id * STAGE; off < r->size; off += (size_t)r->threads * STAGE) {
    size_t n = r->size - off < STAGE ? r->size - off : STAGE;
    if (r->back) {
      memcpy(stage, r->host + off, n);
      CHECK(cuMemcpyHtoDAsync(r->dev + off, stage, n, s));
      CHECK(cuStreamSynchronize(s));
    } else {
      CHECK(cuMemcpyDtoHAsync(stage, r->dev + off, n, s));
      CHECK(cuStreamSynchronize(s));
      memcpy(r->host + off, stage, n);
    }
  }
  CHECK(cuMemFreeHost(stage));
  CHECK(cuStreamDestroy(s));
  return 0;
}

static void pageable(int gib) {
  size_t size = (size_t)gib * GIB;
  CUdeviceptr d;
  CHECK(cuMemAlloc(&d, size));
  CHECK(cuMemsetD8(d, 5, size));
  CHECK(cuCtxSynchronize());
  char what[96];
  for (int huge = 0; huge <= 1; huge++) {
    char *h = (char *)mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (huge) madvise(h, size, MADV_HUGEPAGE);
    double t0 = now();
    CHECK(cuMemcpyDtoH(h, d, size));
    report(huge ? "pageable cuMemcpyDtoH, fresh, huge" : "pageable cuMemcpyDtoH, fresh", gib,
           now() - t0);
    t0 = now();
    CHECK(cuMemcpyDtoH(h, d, size));
    report("  the same again (faulted)", gib, now() - t0);
    t0 = now();
    CHECK(cuMemcpyHtoD(d, h, size));
    report("  pageable cuMemcpyHtoD", gib, now() - t0);
    munmap(h, size);
  }
  int threads[] = {1, 2, 4, 8, 12};
  for (int huge = 0; huge <= 1; huge++)
    for (unsigned i = 0; i < sizeof threads / sizeof *threads; i++) {
      int t = threads[i];
      char *h = (char *)mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (huge) madvise(h, size, MADV_HUGEPAGE);
      pthread_t th[16];
      Ring r[16];
      for (int back = 0; back <= 1; back++) {
        double t0 = now();
        for (int k = 0; k < t; k++) {
          r[k] = (Ring){d, h, size, k, t, back};
          pthread_create(&th[k], 0, ring_worker, &r[k]);
        }
        for (int k = 0; k < t; k++) pthread_join(th[k], 0);
        snprintf(what, sizeof what, "staging ring %s x %d thr%s", back ? "in " : "out", t,
                 huge ? ", huge" : "");
        report(what, gib, now() - t0);
      }
      double t0 = now();
      munmap(h, size);
      report("  munmap", gib, now() - t0);
    }
  CHECK(cuMemFree(d));
}

int main(int argc, char **argv) {
  int gib = argc > 1 ? atoi(argv[1]) : 8;
  CUdevice dev;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cuCtxSetCurrent(ctx));
  if (argc > 2) {  // the pageable measurements only
    pageable(gib);
    return 0;
  }
  host_create(1, GIB, 1);  // warm-up
  host_create(gib, GIB, 1);
  host_create(gib, 64ull << 20, 1);
  host_create(gib, 2ull << 20, 1);
  int threads[] = {2, 4, 8, 16};
  for (unsigned i = 0; i < sizeof threads / sizeof *threads; i++) {
    host_create(gib, GIB, threads[i]);
    host_create(gib, 256ull << 20, threads[i]);
  }
  host_alloc(gib);
  host_register(gib, 0);
  host_register(gib, 1);
  vmm_copy(gib < 4 ? gib : 4);
  pageable(gib);
  return 0;
}
