// A launch-bound "request" as batch-1 inference makes it: K tiny kernels, each after a
// short stretch of host work, then a synchronize and a pause. Prints the median and 90th
// percentile host time to launch one request's kernels (the synchronize not included), so
// that the hook's own cost on the launch path reads as the difference between a bare and a
// hooked run. With --driver-costs it also times the driver calls the SM limiter makes
// (cuEventRecord, cuEventQuery, cuEventElapsedTime) and those it makes before admitting
// each limited launch (cuStreamIsCapturing, the stream's context and device) on this GPU.
//
//   nvcc -O2 -o launch_bound launch_bound.cu -lcuda
//   ./launch_bound SECONDS [--driver-costs]      (defaults: 130 kernels, 25 us host work)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

__global__ void tiny(float *p) {
    if (threadIdx.x == 0 && p) p[blockIdx.x] += 1.0f;
}

static double now_us() {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

static void host_work(double us) {
    double end = now_us() + us;
    while (now_us() < end) {
    }
}

static double pct(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, (size_t)(v.size() * p))];
}

static void driver_costs() {
    CUstream s = 0;
    const int n = 20000;
    std::vector<CUevent> ev(64);
    for (auto &e : ev) cuEventCreate(&e, CU_EVENT_DEFAULT);
    float *d = nullptr;
    cudaMalloc(&d, 4096);
    double t = now_us();
    for (int i = 0; i < n; i++) cuEventRecord(ev[i % 64], s);
    double rec = (now_us() - t) / n;
    cudaDeviceSynchronize();
    // Query of a completed marker, and of one behind queued work.
    t = now_us();
    for (int i = 0; i < n; i++) cuEventQuery(ev[i % 64]);
    double q_done = (now_us() - t) / n;
    for (int i = 0; i < 2000; i++) tiny<<<1, 32>>>(d);
    cuEventRecord(ev[0], s);
    t = now_us();
    int pending = 0;
    for (int i = 0; i < 2000; i++) pending += cuEventQuery(ev[0]) == CUDA_ERROR_NOT_READY;
    double q_pending = (now_us() - t) / 2000;
    cudaDeviceSynchronize();
    float ms;
    t = now_us();
    for (int i = 0; i < n; i++) cuEventElapsedTime(&ms, ev[i % 64], ev[(i + 1) % 64]);
    double el = (now_us() - t) / n;
    t = now_us();
    for (int i = 0; i < n; i++) tiny<<<1, 32>>>(d);
    double launch = (now_us() - t) / n;
    cudaDeviceSynchronize();
    // What the hook asks the driver before admitting every limited launch: whether the
    // stream is capturing, and the stream's device (the current context's, for the null
    // stream; a created stream's context first).
    CUstreamCaptureStatus cap;
    t = now_us();
    for (int i = 0; i < n; i++) cuStreamIsCapturing(s, &cap);
    double capturing = (now_us() - t) / n;
    CUcontext ctx;
    CUdevice dev;
    t = now_us();
    for (int i = 0; i < n; i++) cuCtxGetCurrent(&ctx);
    double cur = (now_us() - t) / n;
    t = now_us();
    for (int i = 0; i < n; i++) cuCtxGetDevice(&dev);
    double getdev = (now_us() - t) / n;
    CUstream made;
    cuStreamCreate(&made, CU_STREAM_NON_BLOCKING);
    t = now_us();
    for (int i = 0; i < n; i++) cuStreamGetCtx(made, &ctx);
    double sctx = (now_us() - t) / n;
    t = now_us();
    for (int i = 0; i < n; i++) cuStreamIsCapturing(made, &cap);
    double capturing_made = (now_us() - t) / n;
    cuStreamDestroy(made);
    printf("driver_costs_us record=%.3f query_done=%.3f query_pending=%.3f (%d of 2000 pending) "
           "elapsed=%.3f launch=%.3f is_capturing=%.3f (created stream %.3f) ctx_get_current=%.3f "
           "ctx_get_device=%.3f stream_get_ctx=%.3f\n",
           rec, q_done, q_pending, pending, el, launch, capturing, capturing_made, cur, getdev, sctx);
    for (auto &e : ev) cuEventDestroy(e);
    cudaFree(d);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 4.0;
    bool costs = argc > 2 && !strcmp(argv[2], "--driver-costs");
    const int kernels = 130;
    const double host_us = 25.0, think_ms = 10.0;
    float *d = nullptr;
    cudaMalloc(&d, 4096);
    cudaDeviceSynchronize();
    if (costs) driver_costs();
    std::vector<double> launch_ms;
    double end = now_us() + seconds * 1e6;
    for (int r = 0; now_us() < end; r++) {
        double t = now_us();
        for (int k = 0; k < kernels; k++) {
            host_work(host_us);
            tiny<<<1, 32>>>(d);
        }
        double host = (now_us() - t) / 1e3;
        cudaDeviceSynchronize();
        if (r >= 20) launch_ms.push_back(host);  // the first requests warm up
        std::this_thread::sleep_for(std::chrono::microseconds((int)(think_ms * 1e3)));
    }
    double floor_ms = kernels * host_us / 1e3;
    printf("requests=%zu kernels=%d host_work_ms=%.3f launch_ms_p50=%.3f p90=%.3f "
           "excess_us_per_launch_p50=%.3f\n",
           launch_ms.size(), kernels, floor_ms, pct(launch_ms, 0.5), pct(launch_ms, 0.9),
           (pct(launch_ms, 0.5) - floor_ms) * 1e3 / kernels);
    return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
