// What a context switch costs on this GPU, by how it happens (docs/sm-limit.md, "The model").
//
// Two processes (two contexts) run kernels of a fixed length; each prints one JSON line with
// the kernels it completed in the window. Compared with one process alone:
//   deep      both keep deep queues: the GPU preempts at every time slice's end;
//   burst     (with a deep partner) this one enqueues --burst-ms of work every --period-ms;
//   turn      exclusive turns through a shared flag: enqueue --turn-ms, wait for it to drain,
//             hand over; the partner enqueues only then (a switch by yield, plus host latency);
//   turn-solo the same pattern in one process, no partner (the host latency without a switch);
//   handoff   turns where the holder hands over --lead-ms before its queue drains, so the
//             partner's work waits queued behind less than a slice (a yield without host gap).
// Kernels: `spin` (registers only) or `l2` (re-reads a buffer that fits in L2, so a switch
// that costs the cache shows).
//
//   nvcc -O2 -o switch_probe switch_probe.cu -lcuda
//   ./switch_probe --mode deep --kernel spin --seconds 3 [--flag /dev/shm/f --role 0|1]
#include <cuda_runtime.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <vector>

__global__ void spin(float *out, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (int i = 0; i < iters; i++) a = a * b + 1e-7f;
  if (a == -1.0f) out[0] = a;
}

__global__ void l2(const float4 *buf, size_t n, int passes, float *out) {
  float4 s = make_float4(0, 0, 0, 0);
  for (int p = 0; p < passes; p++)
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
      float4 v = buf[i];
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
  if (s.x + s.y + s.z + s.w == -1.0f) out[0] = s.x;
}

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct Opts {
  const char *mode = "deep", *kernel = "spin", *flag = nullptr;
  double seconds = 3, burst_ms = 2, period_ms = 6.67, turn_ms = 4, lead_ms = 0.3, kernel_us = 100;
  int role = 0;
};

struct Gpu {
  Opts o;
  float *out = nullptr;
  float4 *buf = nullptr;
  size_t n = 0;
  int iters = 1000, passes = 1, sms = 0;
  cudaStream_t s;
  long launched = 0;

  void launch() {
    if (!strcmp(o.kernel, "spin"))
      spin<<<sms * 4, 256, 0, s>>>(out, iters);
    else
      l2<<<sms * 4, 256, 0, s>>>(buf, n, passes, out);
    launched++;
  }
  double time_one(int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    launch();
    cudaEventRecord(a, s);
    for (int i = 0; i < reps; i++) launch();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    return ms * 1000.0 / reps;
  }
  // Scale the kernel to about kernel_us.
  void calibrate() {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaMalloc(&out, 64);
    n = (20u << 20) / sizeof(float4);  // 20 MiB: two of them fit in the H200's L2
    cudaMalloc(&buf, n * sizeof(float4));
    cudaMemset(buf, 0, n * sizeof(float4));
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    for (int k = 0; k < 3; k++) {
      double us = time_one(20);
      if (!strcmp(o.kernel, "spin"))
        iters = (int)(iters * o.kernel_us / us);
      else
        passes = passes * o.kernel_us / us < 1 ? 1 : (int)(passes * o.kernel_us / us);
    }
    launched = 0;
  }
};

static volatile int *map_flag(const char *path) {
  int fd = open(path, O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, 4096) != 0) { perror(path); exit(2); }
  void *p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(2); }
  return (volatile int *)p;
}

int main(int argc, char **argv) {
  Opts o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--mode")) o.mode = v;
    else if (!strcmp(k, "--kernel")) o.kernel = v;
    else if (!strcmp(k, "--flag")) o.flag = v;
    else if (!strcmp(k, "--role")) o.role = atoi(v);
    else if (!strcmp(k, "--seconds")) o.seconds = atof(v);
    else if (!strcmp(k, "--burst-ms")) o.burst_ms = atof(v);
    else if (!strcmp(k, "--period-ms")) o.period_ms = atof(v);
    else if (!strcmp(k, "--turn-ms")) o.turn_ms = atof(v);
    else if (!strcmp(k, "--lead-ms")) o.lead_ms = atof(v);
    else if (!strcmp(k, "--kernel-us")) o.kernel_us = atof(v);
    else { fprintf(stderr, "unknown option %s\n", k); return 2; }
  }
  cudaSetDeviceFlags(cudaDeviceScheduleSpin);
  volatile int *flag = o.flag ? map_flag(o.flag) : nullptr;
  // flag[0]: whose turn; flag[1 + role]: calibrated. Role 1 calibrates after role 0 (a kernel
  // timed beside the other's would be long), then both start together.
  if (flag && o.role == 1)
    while (!flag[1]) {}
  Gpu g;
  g.o = o;
  g.calibrate();
  double kus = g.time_one(50);
  g.launched = 0;
  if (flag) {
    flag[1 + o.role] = 1;
    while (!(flag[1] && flag[2])) {}
  }
  const int per_turn = (int)(o.turn_ms * 1000 / kus + 0.5), lead = (int)(o.lead_ms * 1000 / kus + 0.5);
  const int per_burst = (int)(o.burst_ms * 1000 / kus + 0.5);
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  double t0 = now(), end = t0 + o.seconds;
  if (!strcmp(o.mode, "deep")) {
    // Keep about 64 kernels queued.
    std::vector<cudaEvent_t> ring(8);
    for (auto &e : ring) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    long k = 0;
    while (now() < end) {
      cudaEventSynchronize(ring[k % 8]);
      for (int i = 0; i < 8; i++) g.launch();
      cudaEventRecord(ring[k % 8], g.s);
      k++;
    }
  } else if (!strcmp(o.mode, "burst")) {
    double next = t0;
    while (now() < end) {
      while (now() < next) {}
      for (int i = 0; i < per_burst; i++) g.launch();
      next += o.period_ms / 1000;
    }
  } else if (!strcmp(o.mode, "turn") || !strcmp(o.mode, "turn-solo") || !strcmp(o.mode, "handoff")) {
    bool solo = !strcmp(o.mode, "turn-solo"), handoff = !strcmp(o.mode, "handoff");
    while (now() < end) {
      if (!solo)
        while (flag[0] != o.role)
          if (now() > end + 1) break;
      if (now() >= end) { if (!solo) flag[0] = 1 - o.role; break; }
      if (handoff) {
        for (int i = 0; i < per_turn - lead; i++) g.launch();
        cudaEventRecord(ev, g.s);
        for (int i = 0; i < lead; i++) g.launch();
        cudaEventSynchronize(ev);  // `lead` of work still queued
        flag[0] = 1 - o.role;
        cudaStreamSynchronize(g.s);
      } else {
        for (int i = 0; i < per_turn; i++) g.launch();
        cudaStreamSynchronize(g.s);
        if (!solo) flag[0] = 1 - o.role;
      }
    }
  } else {
    fprintf(stderr, "unknown mode %s\n", o.mode);
    return 2;
  }
  cudaStreamSynchronize(g.s);
  double wall = now() - t0;
  printf("{\"mode\":\"%s\",\"kernel\":\"%s\",\"role\":%d,\"kernel_us\":%.2f,\"launched\":%ld,"
         "\"wall_s\":%.4f,\"gpu_s\":%.4f,\"err\":\"%s\"}\n",
         o.mode, o.kernel, o.role, kus, g.launched, wall, g.launched * kus * 1e-6, cudaGetErrorString(cudaGetLastError()));
  return 0;
}
