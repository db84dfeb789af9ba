// What the limiter's completion markers cost the work they bracket (docs/sm-limit.md, "What
// measuring costs"): one stream of kernels of a fixed length, launched as fast as the host
// can, with a CUDA event recorded after every `every`-th launch (timing or completion-only
// events) and the oldest unfinished one queried after every launch, as the limiter polls.
// Prints one line per configuration: kernels per second and the ratio to no markers.
//
//   nvcc -O2 -o marker_cost marker_cost.cu
//   ./marker_cost [seconds per configuration, default 1]
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <deque>

__global__ void spin(float *out, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (int i = 0; i < iters; i++) a = a * b + 1e-7f;
  if (a == -1.0f) out[0] = a;
}

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t ck_ = (x);                                                   \
    if (ck_ != cudaSuccess) {                                              \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(ck_));            \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

// Iterations of `spin` (132 blocks of 128 threads) that take about `us` microseconds.
static int calibrate(float *out, cudaStream_t s, double us) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  int iters = 1000;
  for (int k = 0; k < 8; k++) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < 20; i++) spin<<<132, 128, 0, s>>>(out, iters);
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    double per = ms * 1e3 / 20;
    iters = (int)(iters * us / per);
    if (iters < 1) iters = 1;
  }
  return iters;
}

struct Result {
  double per_s, host_us;
};

// `every` 0: no markers. `flags`: cudaEventDefault or cudaEventDisableTiming.
static Result run(float *out, cudaStream_t s, int iters, int every, unsigned flags, double secs) {
  std::deque<cudaEvent_t> idle, flight;
  for (int i = 0; i < 64; i++) {
    cudaEvent_t e;
    CK(cudaEventCreateWithFlags(&e, flags));
    idle.push_back(e);
  }
  CK(cudaStreamSynchronize(s));
  long n = 0;
  double host = 0, t0 = now(), end = t0 + secs;
  while (now() < end) {
    for (int b = 0; b < 64; b++) {
      double h = now();
      spin<<<132, 128, 0, s>>>(out, iters);
      n++;
      if (every && n % every == 0) {
        cudaEvent_t e;
        if (!idle.empty()) {
          e = idle.front();
          idle.pop_front();
        } else {
          e = flight.front();
          flight.pop_front();
          CK(cudaEventSynchronize(e));
        }
        CK(cudaEventRecord(e, s));
        flight.push_back(e);
      }
      if (!flight.empty()) {
        cudaError_t q = cudaEventQuery(flight.front());
        if (q == cudaSuccess) {
          idle.push_back(flight.front());
          flight.pop_front();
        } else if (q != cudaErrorNotReady) {
          CK(q);
        }
      }
      host += now() - h;
    }
  }
  CK(cudaStreamSynchronize(s));
  double wall = now() - t0;
  for (auto e : idle) cudaEventDestroy(e);
  for (auto e : flight) cudaEventDestroy(e);
  return {n / wall, host / n * 1e6};
}

int main(int argc, char **argv) {
  double secs = argc > 1 ? atof(argv[1]) : 1.0;
  float *out;
  CK(cudaMalloc(&out, 4));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double lengths[] = {3, 10, 30, 100};
  const int everies[] = {1, 4, 16};
  for (double us : lengths) {
    int iters = calibrate(out, s, us);
    Result base = run(out, s, iters, 0, cudaEventDefault, secs);
    printf("{\"kernel_us\":%g,\"every\":0,\"timing\":null,\"per_s\":%.0f,\"host_us\":%.2f,\"ratio\":1}\n",
           us, base.per_s, base.host_us);
    for (int every : everies)
      for (int timing = 1; timing >= 0; timing--) {
        Result r = run(out, s, iters, every, timing ? cudaEventDefault : cudaEventDisableTiming, secs);
        printf("{\"kernel_us\":%g,\"every\":%d,\"timing\":%s,\"per_s\":%.0f,\"host_us\":%.2f,\"ratio\":%.4f}\n",
               us, every, timing ? "true" : "false", r.per_s, r.host_us, r.per_s / base.per_s);
        fflush(stdout);
      }
  }
  return 0;
}
