/* The preamble of the standalone SM-limit test programs (tests/sm_limit.rs, tests/sm_power.rs):
   they load the driver with load_driver (the common functions) and resolve the rest with NEED. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef void *H;
#define NEED(name) name = dlsym(lib, #name); if (!name) { fprintf(stderr, "no %s\n", #name); return 3; }
#define CHECK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s = %d\n", #x, r_); return 2; } } while (0)

/* The driver functions every standalone program uses, resolved by load_driver. */
static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(H *, int);
static CUresult (*cuCtxSetCurrent)(H);
static CUresult (*cuModuleLoadData)(H *, const void *);
static CUresult (*cuModuleGetFunction)(H *, H, const char *);
static CUresult (*cuStreamCreate)(H *, unsigned);
static CUresult (*cuStreamSynchronize)(H);
static CUresult (*cuEventCreate)(H *, unsigned);
static CUresult (*cuEventRecord)(H, H);
static CUresult (*cuEventSynchronize)(H);
static CUresult (*cuLaunchKernel)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, H, void **, void **);
static void *lib; /* libcuda.so.1, for NEED */

/* Opens the driver and resolves the functions above: 0, or 3 after saying what is missing. */
static int load_driver(void) {
  lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 3; }
  NEED(cuInit) NEED(cuDeviceGet) NEED(cuDevicePrimaryCtxRetain) NEED(cuCtxSetCurrent)
  NEED(cuModuleLoadData) NEED(cuModuleGetFunction) NEED(cuStreamCreate) NEED(cuStreamSynchronize)
  NEED(cuEventCreate) NEED(cuEventRecord) NEED(cuEventSynchronize) NEED(cuLaunchKernel)
  return 0;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Device 0's busy percentage as NVML reports it (the simulator: the share of its window,
   VGPU_SIM_UTIL_WINDOW_MS, during which a kernel ran); -1 when NVML cannot say. */
static int nvml_busy_pct(void) {
  void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!nvml) { fprintf(stderr, "%s\n", dlerror()); return -1; }
  int (*nvmlInit_v2)(void) = dlsym(nvml, "nvmlInit_v2");
  int (*nvmlDeviceGetHandleByIndex_v2)(unsigned, H *) = dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
  int (*nvmlDeviceGetUtilizationRates)(H, unsigned *) = dlsym(nvml, "nvmlDeviceGetUtilizationRates");
  if (!nvmlInit_v2 || !nvmlDeviceGetHandleByIndex_v2 || !nvmlDeviceGetUtilizationRates) return -1;
  H nd; unsigned util[2];
  if (nvmlInit_v2() || nvmlDeviceGetHandleByIndex_v2(0, &nd) || nvmlDeviceGetUtilizationRates(nd, util))
    return -1;
  return (int)util[0];
}
