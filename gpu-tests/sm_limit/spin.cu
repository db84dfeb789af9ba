// Compute-bound kernel loop for the SM-limit benchmark.
//
// usage: spin <kernel_us> <seconds> <plain|graph> [iters]
// Calibrates a register-only FMA kernel that fills the whole GPU to about <kernel_us>
// microseconds (timed with events around single launches; skipped when [iters] is given,
// so that runs under different limits execute identical kernels), then launches it back
// to back for <seconds> after a warm-up and prints
//   RESULT kernels_per_s=<f> kernel_us=<f> launches=<n> wall_s=<f> iters=<n>
// With "graph", 10 kernels are captured into a CUDA graph and the graph is launched
// instead (kernels_per_s still counts kernels). The warm-up lasts 0.5 s, or until the
// wall-clock time SPIN_START_AT (seconds since the epoch) when that is set, so that
// concurrent processes measure the same window.
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                     \
    }                                                                              \
  } while (0)

__global__ void spin(float *out, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f, d = blockIdx.x * 1e-4f;
  for (int i = 0; i < iters; ++i) {
    a = fmaf(a, b, c);
    d = fmaf(d, c, b);
    b = fmaf(b, a, -d) * 1e-7f + 1.0001f;
    c = fmaf(c, d, -a) * 1e-7f + 0.9999f;
  }
  if (a + b + c + d == 12345.678f) out[blockIdx.x] = a;  // keeps the loop alive
}

static double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: spin <kernel_us> <seconds> <plain|graph> [iters]\n");
    return 1;
  }
  double target_us = atof(argv[1]);
  double seconds = atof(argv[2]);
  bool graph = argc > 3 && argv[3][0] == 'g';
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int blocks = sms * 8, threads = 256;
  float *out;
  CHECK(cudaMalloc(&out, blocks * sizeof(float)));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // Calibrate: time single launches, scale the iteration count, keep the median.
  int iters = argc > 4 ? atoi(argv[4]) : 1000;
  float ms = 0;
  for (int round = argc > 4 ? 6 : 0; round < 6; ++round) {
    float best = 1e30f;
    for (int k = 0; k < 3; ++k) {
      CHECK(cudaEventRecord(e0, s));
      spin<<<blocks, threads, 0, s>>>(out, iters);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (ms < best) best = ms;
    }
    double scale = target_us / (best * 1000.0);
    if (round >= 2 && scale > 0.97 && scale < 1.03) { ms = best; break; }
    long next = (long)(iters * scale);
    iters = next < 1 ? 1 : (next > 2000000000L ? 2000000000 : (int)next);
    ms = best;
  }
  if (argc > 4) {  // one timed launch for the report
    CHECK(cudaEventRecord(e0, s));
    spin<<<blocks, threads, 0, s>>>(out, iters);
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
  }
  double kernel_us = ms * 1000.0;

  cudaGraphExec_t exec = nullptr;
  const int per_graph = 10;
  if (graph) {
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < per_graph; ++k) spin<<<blocks, threads, 0, s>>>(out, iters);
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
  }
  // Keep about 20 ms of work queued (a real driver would queue ~1000 launches, and the
  // final synchronization would then wait for seconds of unlimited work).
  double launch_us = kernel_us * (graph ? per_graph : 1);
  int depth = (int)(20000.0 / (launch_us > 1 ? launch_us : 1));
  depth = depth < 2 ? 2 : (depth > 512 ? 512 : depth);
  std::vector<cudaEvent_t> ring(depth);
  for (auto &e : ring) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  long launched = 0;
  auto launch = [&]() {
    if (graph) {
      CHECK(cudaGraphLaunch(exec, s));
    } else {
      spin<<<blocks, threads, 0, s>>>(out, iters);
      CHECK(cudaGetLastError());
    }
    CHECK(cudaEventRecord(ring[launched % depth], s));
    ++launched;
    CHECK(cudaEventSynchronize(ring[launched % depth]));
  };
  // Warm up into steady state, then count.
  double t = now_s();
  const char *start_at = getenv("SPIN_START_AT");
  double until_epoch = start_at ? atof(start_at) : 0;
  auto epoch = [] {
    using namespace std::chrono;
    return duration<double>(system_clock::now().time_since_epoch()).count();
  };
  while (now_s() - t < 0.5 || epoch() < until_epoch) launch();
  CHECK(cudaStreamSynchronize(s));
  long n = 0;
  double t0 = now_s();
  while (now_s() - t0 < seconds) {
    launch();
    ++n;
  }
  CHECK(cudaStreamSynchronize(s));
  double wall = now_s() - t0;
  long kernels = graph ? n * per_graph : n;
  printf("RESULT kernels_per_s=%.3f kernel_us=%.1f launches=%ld wall_s=%.3f iters=%d\n",
         kernels / wall, kernel_us, n, wall, iters);
  return 0;
}
