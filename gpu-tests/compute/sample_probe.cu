// What a sample measures on this GPU (docs/sm-limit.md, "What a launch costs"): one kernel
// bracketed by two timing events on a stream with nothing queued, beside a neighbour process.
//
// Prober modes, each --trials times with a host pause between trials (the stream runs dry):
//   open    record start, launch, record end (the limiter's sample on an idle stream);
//   gated   a stream wait on a host word, then start, launch, end; the word is written once
//           the end is recorded (the limiter's gated sample);
//   queued  a 300 µs kernel first, then start, launch, end (a clean sample: queued behind);
//   late    record start, wait 50 µs on the host, launch, end (is the start stamped before the
//           kernel's turn?);
//   empty   gated, start and end with nothing between (what a bracket adds by itself);
//   gated2  gated, two launches of the kernel inside one bracket (span2 − span1 is the kernel's
//           time in the flow; span1 − that is what a bracket adds to one launch).
// For each: the span's percentiles and how often the start event had completed once the launch
// call returned. The neighbour keeps a deep queue of 1 ms kernels (`deep`) or launches 20 µs
// kernels 15 µs apart in steps of 60 with a sync and 1 ms pause (`launchbound`).
//
//   nvcc -O2 -o sample_probe sample_probe.cu -lcuda
//   ./sample_probe --role neighbour --kind deep --seconds 20 &
//   ./sample_probe --role prober --kernel-us 20 --trials 300
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

__global__ void spin_ns(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void host_spin(double s) {
  double t0 = now();
  while (now() - t0 < s) {
  }
}

#define CK(x)                                                                 \
  do {                                                                        \
    cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                  \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

static void neighbour(const char *kind, double seconds) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double end = now() + seconds;
  long kernels = 0;
  if (!strcmp(kind, "deep")) {
    cudaEvent_t ev[2];
    for (auto &e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    int k = 0;
    while (now() < end) {
      for (int i = 0; i < 4; i++) spin_ns<<<1, 32, 0, s>>>(1000000LL);
      kernels += 4;
      CK(cudaEventRecord(ev[k & 1], s));
      if (k > 0) CK(cudaEventSynchronize(ev[(k - 1) & 1]));
      k++;
    }
  } else {
    while (now() < end) {
      for (int i = 0; i < 60; i++) {
        spin_ns<<<1, 32, 0, s>>>(20000LL);
        host_spin(15e-6);
      }
      kernels += 60;
      CK(cudaStreamSynchronize(s));
      usleep(1000);
    }
  }
  CK(cudaStreamSynchronize(s));
  printf("{\"role\":\"neighbour\",\"kind\":\"%s\",\"kernels\":%ld}\n", kind, kernels);
}

struct Result {
  std::vector<double> span_us;
  int start_done = 0;
};

static void prober(double kernel_us, int trials, const char *label) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  volatile unsigned *flag;
  CK(cudaHostAlloc((void **)&flag, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
  *flag = 0;
  CUdeviceptr dflag;
  if (cuMemHostGetDevicePointer(&dflag, (void *)flag, 0) != CUDA_SUCCESS) {
    fprintf(stderr, "no device pointer for the flag\n");
    exit(1);
  }
  unsigned gate = 0;
  long long ns = (long long)(kernel_us * 1000);
  const char *modes[] = {"open", "gated", "queued", "late", "empty", "gated2"};
  const int n_modes = 6;
  Result res[n_modes];
  spin_ns<<<1, 32, 0, s>>>(ns);  // warm up
  CK(cudaStreamSynchronize(s));
  for (int t = 0; t < trials; t++) {
    for (int m = 0; m < n_modes; m++) {
      usleep(300 + (t * 37 + m * 101) % 700);
      bool gated = m == 1 || m == 4 || m == 5;
      if (gated) {
        gate++;
        CUresult r = cuStreamWaitValue32(s, dflag, gate, CU_STREAM_WAIT_VALUE_GEQ);
        if (r != CUDA_SUCCESS) {
          fprintf(stderr, "cuStreamWaitValue32 failed: %d\n", (int)r);
          exit(1);
        }
      }
      if (m == 2) spin_ns<<<1, 32, 0, s>>>(300000LL);
      CK(cudaEventRecord(a, s));
      if (m == 3) host_spin(50e-6);
      if (m != 4) spin_ns<<<1, 32, 0, s>>>(ns);
      if (m == 5) spin_ns<<<1, 32, 0, s>>>(ns);
      bool done = cudaEventQuery(a) == cudaSuccess;
      CK(cudaEventRecord(b, s));
      if (gated) __atomic_store_n(flag, gate, __ATOMIC_RELEASE);
      CK(cudaStreamSynchronize(s));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      res[m].span_us.push_back(ms * 1000.0);
      res[m].start_done += done;
    }
  }
  for (int m = 0; m < n_modes; m++) {
    auto &v = res[m].span_us;
    std::sort(v.begin(), v.end());
    auto q = [&](double p) { return v[std::min(v.size() - 1, (size_t)(p * v.size()))]; };
    printf("{\"role\":\"prober\",\"label\":\"%s\",\"mode\":\"%s\",\"kernel_us\":%.1f,\"trials\":%zu,"
           "\"p10\":%.1f,\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f,\"max\":%.1f,\"start_done_after_call\":%.3f}\n",
           label, modes[m], kernel_us, v.size(), q(0.1), q(0.5), q(0.9), q(0.99), v.back(),
           res[m].start_done / (double)v.size());
  }
}

int main(int argc, char **argv) {
  const char *role = "prober", *kind = "deep", *label = "alone";
  double seconds = 10, kernel_us = 20;
  int trials = 300;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--role")) role = argv[i + 1];
    else if (!strcmp(argv[i], "--kind")) kind = argv[i + 1];
    else if (!strcmp(argv[i], "--label")) label = argv[i + 1];
    else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--kernel-us")) kernel_us = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--trials")) trials = atoi(argv[i + 1]);
  }
  CK(cudaFree(0));
  if (!strcmp(role, "neighbour")) neighbour(kind, seconds);
  else prober(kernel_us, trials, label);
  return 0;
}
