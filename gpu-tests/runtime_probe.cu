// Runtime-API probe for the GPU acceptance harness: what a plain CUDA C++ program sees under
// libvgpu.so. Prints key=value lines.
//   runtime_probe CHUNK_MB
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

__global__ void fill(float *p, size_t n, float v) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

int main(int argc, char **argv) {
    size_t chunk = (argc > 1 ? strtoull(argv[1], nullptr, 10) : 256) << 20;
    size_t free0 = 0, total0 = 0;
    cudaError_t e = cudaMemGetInfo(&free0, &total0);
    printf("rt_meminfo=%d\nrt_free=%zu\nrt_total=%zu\n", (int)e, free0, total0);
    std::vector<void *> v;
    void *p = nullptr;
    while ((e = cudaMalloc(&p, chunk)) == cudaSuccess) v.push_back(p);
    printf("rt_chunks=%zu\nrt_chunk=%zu\nrt_oom_error=%d\nrt_oom_name=%s\n", v.size(), chunk, (int)e, cudaGetErrorName(e));
    cudaGetLastError();
    size_t free1 = 0, total1 = 0;
    cudaMemGetInfo(&free1, &total1);
    printf("rt_free_full=%zu\n", free1);
    int ok = 0;
    if (!v.empty()) {
        size_t n = chunk / sizeof(float);
        fill<<<256, 256>>>((float *)v[0], n, 3.0f);
        e = cudaDeviceSynchronize();
        float back[4] = {0, 0, 0, 0};
        cudaMemcpy(back, (float *)v[0] + n - 4, sizeof back, cudaMemcpyDeviceToHost);
        ok = e == cudaSuccess && back[0] == 3.0f && back[3] == 3.0f;
    }
    printf("rt_kernel_ok=%d\n", ok);
    for (void *q : v) cudaFree(q);
    cudaStream_t s;
    cudaStreamCreate(&s);
    void *a = nullptr;
    cudaError_t ea = cudaMallocAsync(&a, chunk, s);
    cudaError_t ef = ea == cudaSuccess ? cudaFreeAsync(a, s) : ea;
    cudaStreamSynchronize(s);
    printf("rt_async_alloc=%d\nrt_async_free=%d\n", (int)ea, (int)ef);
    // A stream-ordered allocation past the limit fails too.
    cudaError_t eb = cudaMallocAsync(&a, total0 + chunk, s);
    if (eb == cudaSuccess) cudaFreeAsync(a, s);
    cudaStreamSynchronize(s);
    cudaGetLastError();
    printf("rt_async_too_big=%d\n", (int)eb);
    size_t free2 = 0, total2 = 0;
    cudaMemGetInfo(&free2, &total2);
    printf("rt_free_end=%zu\n", free2);
    return 0;
}
