/* The preamble of the standalone SM-limit test programs (tests/sm_limit.rs, tests/sm_power.rs):
   they load the driver with dlopen and resolve each function with NEED. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef void *H;
#define NEED(name) name = dlsym(lib, #name); if (!name) { fprintf(stderr, "no %s\n", #name); return 3; }
#define CHECK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s = %d\n", #x, r_); return 2; } } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
