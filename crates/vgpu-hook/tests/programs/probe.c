/* probe: one test program, many scenarios (argv[1]), for the hook's integration tests and the
 * GPU acceptance harness. It reaches the driver the way VGPU_VIA says:
 *   link      symbols bound by the dynamic linker (program linked with -lcuda)   [default]
 *   dlsym     dlopen("libcuda.so.1") + dlsym
 *   procaddr  only cuGetProcAddress_v2 is linked; everything else comes from it
 *   ptsz      like procaddr, with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 * NVML always comes from dlopen("libnvidia-ml.so.1").
 * Output is "key=value" lines; the caller decides what is right. Exit status 0 unless the
 * program itself could not run (bad arguments, a setup call failing). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_min.h"

/* symbol, cuGetProcAddress base name, requested version */
#define API_LIST(X)                                                \
    X(cuInit, "cuInit", 12000)                                     \
    X(cuDriverGetVersion, "cuDriverGetVersion", 12000)             \
    X(cuGetErrorName, "cuGetErrorName", 12000)                     \
    X(cuDeviceGet, "cuDeviceGet", 12000)                           \
    X(cuDeviceGetCount, "cuDeviceGetCount", 12000)                 \
    X(cuDeviceGetName, "cuDeviceGetName", 12000)                   \
    X(cuDeviceGetUuid, "cuDeviceGetUuid", 12000)                   \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 12000)              \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 12000) \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 12000) \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 12000) \
    X(cuCtxCreate_v2, "cuCtxCreate", 11000)                        \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 12000)                      \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", 12000)                   \
    X(cuCtxSynchronize, "cuCtxSynchronize", 12000)                 \
    X(cuMemAlloc_v2, "cuMemAlloc", 12000)                          \
    X(cuMemFree_v2, "cuMemFree", 12000)                            \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 12000)                \
    X(cuMemAllocManaged, "cuMemAllocManaged", 12000)               \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 12000)                      \
    X(cuMemGetAddressRange_v2, "cuMemGetAddressRange", 12000)      \
    X(cuPointerGetAttribute, "cuPointerGetAttribute", 12000)       \
    X(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 12000)                      \
    X(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 12000)                      \
    X(cuMemsetD8_v2, "cuMemsetD8", 12000)                          \
    X(cuMemCreate, "cuMemCreate", 12000)                           \
    X(cuMemRelease, "cuMemRelease", 12000)                         \
    X(cuMemAddressReserve, "cuMemAddressReserve", 12000)           \
    X(cuMemAddressFree, "cuMemAddressFree", 12000)                 \
    X(cuMemMap, "cuMemMap", 12000)                                 \
    X(cuMemUnmap, "cuMemUnmap", 12000)                             \
    X(cuMemSetAccess, "cuMemSetAccess", 12000)                     \
    X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 12000) \
    X(cuMemAllocAsync, "cuMemAllocAsync", 12000)                   \
    X(cuMemFreeAsync, "cuMemFreeAsync", 12000)                     \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 12000)   \
    X(cuMemPoolCreate, "cuMemPoolCreate", 12000)                   \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", 12000)                 \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 12000)                   \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 12000)       \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 12000)       \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 12000) \
    X(cuArrayCreate_v2, "cuArrayCreate", 12000)                    \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 12000)                \
    X(cuArrayDestroy, "cuArrayDestroy", 12000)                     \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 12000)     \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 12000)   \
    X(cuIpcGetMemHandle, "cuIpcGetMemHandle", 12000)               \
    X(cuStreamCreate, "cuStreamCreate", 12000)                     \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 12000)                \
    X(cuStreamSynchronize, "cuStreamSynchronize", 12000)           \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 12000)      \
    X(cuStreamEndCapture, "cuStreamEndCapture", 12000)             \
    X(cuEventCreate, "cuEventCreate", 12000)                       \
    X(cuEventRecord, "cuEventRecord", 12000)                       \
    X(cuEventSynchronize, "cuEventSynchronize", 12000)             \
    X(cuEventElapsedTime, "cuEventElapsedTime", 12000)             \
    X(cuEventDestroy_v2, "cuEventDestroy", 12000)                  \
    X(cuModuleLoadData, "cuModuleLoadData", 12000)                 \
    X(cuModuleGetFunction, "cuModuleGetFunction", 12000)           \
    X(cuModuleUnload, "cuModuleUnload", 12000)                     \
    X(cuLibraryLoadData, "cuLibraryLoadData", 12000)               \
    X(cuLibraryGetModule, "cuLibraryGetModule", 12000)             \
    X(cuLibraryUnload, "cuLibraryUnload", 12000)                   \
    X(cuLaunchKernel, "cuLaunchKernel", 12000)                     \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 12000)                 \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 12000) \
    X(cuGraphCreate, "cuGraphCreate", 12000)                       \
    X(cuGraphAddKernelNode_v2, "cuGraphAddKernelNode", 12000)      \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 12000)     \
    X(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode", 12000)       \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 12000) \
    X(cuGraphLaunch, "cuGraphLaunch", 12000)                       \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 12000)             \
    X(cuGraphDestroy, "cuGraphDestroy", 12000)                     \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 12000)

static struct {
#define FIELD(sym, base, ver) __typeof__(&sym) sym;
    API_LIST(FIELD)
#undef FIELD
} A;

static struct {
    nvmlReturn_t (*Init)(void);
    nvmlReturn_t (*GetCount)(unsigned *);
    nvmlReturn_t (*GetHandleByIndex)(unsigned, nvmlDevice_t *);
    nvmlReturn_t (*GetMemoryInfo)(nvmlDevice_t, nvmlMemory_t *);
    nvmlReturn_t (*GetMemoryInfo_v2)(nvmlDevice_t, nvmlMemory_v2_t *);
    nvmlReturn_t (*GetUUID)(nvmlDevice_t, char *, unsigned);
    nvmlReturn_t (*GetProcs)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *);
} N;

static const char *via = "link";

static void die(const char *what) {
    fprintf(stderr, "probe: %s\n", what);
    exit(2);
}

static void load_api(void) {
    const char *v = getenv("VGPU_VIA");
    if (v && *v) via = v;
    if (!strcmp(via, "link")) {
#define LINK(sym, base, ver) A.sym = &sym;
        API_LIST(LINK)
#undef LINK
    } else if (!strcmp(via, "dlsym")) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!h) die(dlerror());
#define DLSYM(sym, base, ver) A.sym = (__typeof__(&sym))dlsym(h, #sym); if (!A.sym) die("dlsym " #sym);
        API_LIST(DLSYM)
#undef DLSYM
    } else if (!strcmp(via, "procaddr") || !strcmp(via, "ptsz")) {
        unsigned long long flags = strcmp(via, "ptsz") ? 0 : CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
        int st = 0;
#define PROC(sym, base, ver)                                                           \
    if (cuGetProcAddress_v2(base, (void **)&A.sym, ver, flags, &st) != 0 || !A.sym) \
        die("cuGetProcAddress " base);
        API_LIST(PROC)
#undef PROC
    } else {
        die("VGPU_VIA must be link, dlsym, procaddr or ptsz");
    }
    void *n = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (n) {
        N.Init = dlsym(n, "nvmlInit_v2");
        N.GetCount = dlsym(n, "nvmlDeviceGetCount_v2");
        N.GetHandleByIndex = dlsym(n, "nvmlDeviceGetHandleByIndex_v2");
        N.GetMemoryInfo = dlsym(n, "nvmlDeviceGetMemoryInfo");
        N.GetMemoryInfo_v2 = dlsym(n, "nvmlDeviceGetMemoryInfo_v2");
        N.GetUUID = dlsym(n, "nvmlDeviceGetUUID");
        N.GetProcs = dlsym(n, "nvmlDeviceGetComputeRunningProcesses_v3");
    }
}

#define MIB (1024ull * 1024ull)

static void must(CUresult r, const char *what) {
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "probe: %s failed: %d\n", what, r);
        printf("setup_error=%s:%d\n", what, r);
        exit(3);
    }
}

static CUcontext ctx_on(int ordinal) {
    CUdevice d;
    CUcontext c;
    must(A.cuDeviceGet(&d, ordinal), "cuDeviceGet");
    must(A.cuDevicePrimaryCtxRetain(&c, d), "cuDevicePrimaryCtxRetain");
    must(A.cuCtxSetCurrent(c), "cuCtxSetCurrent");
    return c;
}

static size_t used_now(void) {
    size_t f = 0, t = 0;
    if (A.cuMemGetInfo_v2(&f, &t) != 0) return (size_t)-1;
    return t - f;
}

static nvmlMemory_t nvml_mem(unsigned idx) {
    nvmlDevice_t d;
    nvmlMemory_t m = {0, 0, 0};
    if (!N.GetHandleByIndex || N.GetHandleByIndex(idx, &d) || N.GetMemoryInfo(d, &m)) m.total = m.used = 0;
    return m;
}

/* ---------- info ---------- */

static int cmd_info(void) {
    int n = 0, ver = 0;
    printf("init=%d\n", A.cuInit(0));
    A.cuDriverGetVersion(&ver);
    printf("driver_version=%d\n", ver);
    printf("count_rc=%d\n", A.cuDeviceGetCount(&n));
    printf("count=%d\n", n);
    for (int i = 0; i < n; i++) {
        CUdevice d;
        size_t tm = 0, fr = 0, to = 0;
        CUuuid u;
        A.cuDeviceGet(&d, i);
        int r1 = A.cuDeviceTotalMem_v2(&tm, d);
        A.cuDeviceGetUuid(&u, d);
        ctx_on(i);
        int r2 = A.cuMemGetInfo_v2(&fr, &to);
        printf("dev%d_total_mem=%zu\ndev%d_total_mem_rc=%d\ndev%d_free=%zu\ndev%d_total=%zu\ndev%d_meminfo_rc=%d\n", i, tm, i,
               r1, i, fr, i, to, i, r2);
        printf("dev%d_uuid=GPU-", i);
        for (int k = 0; k < 16; k++) {
            printf("%02x", (unsigned char)u.bytes[k]);
            if (k == 3 || k == 5 || k == 7 || k == 9) printf("-");
        }
        printf("\n");
    }
    if (N.Init && N.Init() == 0) {
        unsigned c = 0;
        N.GetCount(&c);
        printf("nvml_count=%u\n", c);
        for (unsigned i = 0; i < c; i++) {
            nvmlDevice_t d;
            nvmlMemory_t m;
            nvmlMemory_v2_t m2;
            char uuid[96];
            N.GetHandleByIndex(i, &d);
            int r = N.GetMemoryInfo(d, &m);
            memset(&m2, 0, sizeof m2);
            m2.version = nvmlMemory_v2;
            int r2 = N.GetMemoryInfo_v2 ? N.GetMemoryInfo_v2(d, &m2) : -1;
            N.GetUUID(d, uuid, sizeof uuid);
            printf("nvml%u_rc=%d\nnvml%u_total=%llu\nnvml%u_used=%llu\nnvml%u_free=%llu\n", i, r, i, m.total, i, m.used, i,
                   m.free);
            printf("nvml%u_v2_rc=%d\nnvml%u_v2_total=%llu\nnvml%u_v2_used=%llu\nnvml%u_v2_free=%llu\nnvml%u_uuid=%s\n", i, r2,
                   i, m2.total, i, m2.used, i, m2.free, i, uuid);
            nvmlProcessInfo_t procs[64];
            unsigned np = 64;
            if (N.GetProcs && N.GetProcs(d, &np, procs) == 0)
                for (unsigned k = 0; k < np; k++)
                    printf("nvml%u_proc=%u:%llu\n", i, procs[k].pid, procs[k].usedGpuMemory);
        }
    }
    return 0;
}

/* ---------- one allocation path, counted and released ---------- */

typedef struct {
    CUdeviceptr p;
    size_t pitch;
    CUmemGenericAllocationHandle h;
    size_t mapped;
    CUarray arr;
    CUmipmappedArray mip;
    CUstream s;
    CUmemoryPool pool;
    CUcontext ctx;
    CUgraph g;
    CUgraphExec e;
} held_t;

/* Zeroes `props` and asks for pinned memory on device 0; `kind` is the member that names the
 * allocation type (`type` in CUmemAllocationProp, `allocType` in CUmemPoolProps). */
#define PINNED_ON_DEVICE0(props, kind)                       \
    do {                                                     \
        memset(&(props), 0, sizeof(props));                  \
        (props).kind = CU_MEM_ALLOCATION_TYPE_PINNED;        \
        (props).location.type = CU_MEM_LOCATION_TYPE_DEVICE; \
        (props).location.id = 0;                             \
    } while (0)

static CUresult take(const char *path, size_t size, held_t *h) {
    memset(h, 0, sizeof *h);
    if (!strcmp(path, "alloc")) return A.cuMemAlloc_v2(&h->p, size);
    if (!strcmp(path, "alloc_freeasync")) {
        must(A.cuStreamCreate(&h->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        return A.cuMemAlloc_v2(&h->p, size);
    }
    if (!strcmp(path, "pitch")) return A.cuMemAllocPitch_v2(&h->p, &h->pitch, size / 256, 256, 4);
    if (!strcmp(path, "managed")) return A.cuMemAllocManaged(&h->p, size, CU_MEM_ATTACH_GLOBAL);
    if (!strcmp(path, "vmm")) {
        CUmemAllocationProp prop;
        PINNED_ON_DEVICE0(prop, type);
        size_t g = 0;
        must(A.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity");
        size_t n = (size + g - 1) / g * g;
        CUresult r = A.cuMemCreate(&h->h, n, &prop, 0);
        if (r) return r;
        must(A.cuMemAddressReserve(&h->p, n, 0, 0, 0), "cuMemAddressReserve");
        must(A.cuMemMap(h->p, n, 0, h->h, 0), "cuMemMap");
        CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        must(A.cuMemSetAccess(h->p, n, &acc, 1), "cuMemSetAccess");
        h->mapped = n;
        return 0;
    }
    if (!strcmp(path, "async") || !strcmp(path, "async_memfree")) {
        must(A.cuStreamCreate(&h->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        CUresult r = A.cuMemAllocAsync(&h->p, size, h->s);
        A.cuStreamSynchronize(h->s);
        return r;
    }
    if (!strcmp(path, "pool")) {
        CUmemPoolProps pp;
        PINNED_ON_DEVICE0(pp, allocType);
        must(A.cuMemPoolCreate(&h->pool, &pp), "cuMemPoolCreate");
        must(A.cuStreamCreate(&h->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        CUresult r = A.cuMemAllocFromPoolAsync(&h->p, size, h->pool, h->s);
        A.cuStreamSynchronize(h->s);
        return r;
    }
    if (!strcmp(path, "array")) {
        CUDA_ARRAY_DESCRIPTOR d = {size / 16 / 1024, 1024, CU_AD_FORMAT_FLOAT, 4};
        return A.cuArrayCreate_v2(&h->arr, &d);
    }
    if (!strcmp(path, "array3d")) {
        CUDA_ARRAY3D_DESCRIPTOR d = {size / 4 / 256 / 64, 256, 64, CU_AD_FORMAT_UNSIGNED_INT8, 4, 0};
        return A.cuArray3DCreate_v2(&h->arr, &d);
    }
    if (!strcmp(path, "mipmap")) {
        CUDA_ARRAY3D_DESCRIPTOR d = {size / 4 / 4096, 4096, 0, CU_AD_FORMAT_FLOAT, 1, 0};
        return A.cuMipmappedArrayCreate(&h->mip, &d, 3);
    }
    if (!strcmp(path, "ctx")) {
        CUdevice dev;
        A.cuDeviceGet(&dev, 0);
        CUresult r = A.cuCtxCreate_v2(&h->ctx, 0, dev);
        return r;
    }
    if (!strcmp(path, "capture_async")) {
        /* A stream-ordered allocation captured into a graph becomes a graph memory node. */
        must(A.cuStreamCreate(&h->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        const char *mode = getenv("VGPU_CAPTURE_MODE"); /* 0 global (default), 1 thread-local, 2 relaxed */
        must(A.cuStreamBeginCapture_v2(h->s, mode ? atoi(mode) : CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
        CUresult r = A.cuMemAllocAsync(&h->p, size, h->s);
        must(A.cuStreamEndCapture(h->s, &h->g), "cuStreamEndCapture");
        if (r) return r;
        must(A.cuGraphInstantiateWithFlags(&h->e, h->g, 0), "cuGraphInstantiate");
        r = A.cuGraphLaunch(h->e, h->s);
        A.cuStreamSynchronize(h->s);
        return r;
    }
    if (!strcmp(path, "graph")) {
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUgraphNode n;
        memset(&p, 0, sizeof p);
        PINNED_ON_DEVICE0(p.poolProps, allocType);
        p.bytesize = size;
        must(A.cuStreamCreate(&h->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        must(A.cuGraphCreate(&h->g, 0), "cuGraphCreate");
        must(A.cuGraphAddMemAllocNode(&n, h->g, NULL, 0, &p), "cuGraphAddMemAllocNode");
        h->p = p.dptr;
        must(A.cuGraphInstantiateWithFlags(&h->e, h->g, 0), "cuGraphInstantiate");
        CUresult r = A.cuGraphLaunch(h->e, h->s);
        A.cuStreamSynchronize(h->s);
        return r;
    }
    die("unknown path");
    return 1;
}

static CUresult give(const char *path, held_t *h) {
    CUresult r = 0;
    if (!strcmp(path, "alloc") || !strcmp(path, "pitch") || !strcmp(path, "managed"))
        r = A.cuMemFree_v2(h->p);
    else if (!strcmp(path, "async_memfree")) {
        /* Stream-ordered memory freed by the plain cuMemFree; the pool gives it back to the
         * device at the next synchronization. */
        r = A.cuMemFree_v2(h->p);
        if (!r) r = A.cuCtxSynchronize();
    }
    else if (!strcmp(path, "vmm")) {
        r = A.cuMemUnmap(h->p, h->mapped);
        if (!r) r = A.cuMemRelease(h->h);
        if (!r) r = A.cuMemAddressFree(h->p, h->mapped);
    } else if (!strcmp(path, "async") || !strcmp(path, "alloc_freeasync")) {
        r = A.cuMemFreeAsync(h->p, h->s);
        if (!r) r = A.cuStreamSynchronize(h->s);
    } else if (!strcmp(path, "pool")) {
        r = A.cuMemFreeAsync(h->p, h->s);
        if (!r) r = A.cuStreamSynchronize(h->s);
        if (!r) r = A.cuMemPoolTrimTo(h->pool, 0);
        if (!r) r = A.cuMemPoolDestroy(h->pool);
    } else if (!strcmp(path, "array") || !strcmp(path, "array3d"))
        r = A.cuArrayDestroy(h->arr);
    else if (!strcmp(path, "mipmap"))
        r = A.cuMipmappedArrayDestroy(h->mip);
    else if (!strcmp(path, "ctx")) {
        r = A.cuCtxDestroy_v2(h->ctx);
        ctx_on(0);
    } else if (!strcmp(path, "capture_async")) {
        r = A.cuMemFreeAsync(h->p, h->s);
        if (!r) r = A.cuStreamSynchronize(h->s);
        if (!r) r = A.cuDeviceGraphMemTrim(0);
        A.cuGraphExecDestroy(h->e);
        A.cuGraphDestroy(h->g);
    } else if (!strcmp(path, "graph")) {
        CUgraph g2;
        CUgraphNode n;
        CUgraphExec e2;
        must(A.cuGraphCreate(&g2, 0), "cuGraphCreate");
        must(A.cuGraphAddMemFreeNode(&n, g2, NULL, 0, h->p), "cuGraphAddMemFreeNode");
        must(A.cuGraphInstantiateWithFlags(&e2, g2, 0), "cuGraphInstantiate");
        r = A.cuGraphLaunch(e2, h->s);
        if (!r) r = A.cuStreamSynchronize(h->s);
        if (!r) r = A.cuDeviceGraphMemTrim(0);
        A.cuGraphExecDestroy(e2);
        A.cuGraphDestroy(g2);
        A.cuGraphExecDestroy(h->e);
        A.cuGraphDestroy(h->g);
    }
    if (h->s && strcmp(path, "graph") && strcmp(path, "capture_async")) A.cuStreamDestroy_v2(h->s);
    return r;
}

/* counted PATH SIZE PROBE: take SIZE by PATH; a PROBE-byte cuMemAlloc must then fail if the
 * limit is SIZE+PROBE-ish; give it back; the probe must then succeed. */
static int cmd_counted(const char *path, size_t size, size_t probe) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    size_t before = used_now();
    held_t h;
    CUresult r = take(path, size, &h);
    size_t held = used_now();
    CUdeviceptr q = 0;
    CUresult p1 = A.cuMemAlloc_v2(&q, probe);
    if (!p1) A.cuMemFree_v2(q);
    CUresult f = r ? -1 : give(path, &h);
    size_t after = used_now();
    CUresult p2 = A.cuMemAlloc_v2(&q, probe);
    if (!p2) A.cuMemFree_v2(q);
    printf("path=%s\ntake=%d\nprobe_held=%d\ngive=%d\nprobe_after=%d\n", path, r, p1, f, p2);
    printf("used_before=%zu\nused_held=%zu\nused_after=%zu\n", before, held, after);
    return 0;
}

/* After everything was freed, the whole device (the view's total less what was in use at the
 * start, i.e. the context) can be allocated at once:
 * nothing leaked, and whatever the hook keeps warm gives way under pressure. */
static void full_alloc(size_t base_used) {
    size_t f = 0, t = 0;
    A.cuMemGetInfo_v2(&f, &t);
    /* Whole 2 MiB pages: a direct allocation is charged at the driver's granularity. */
    t = (t - base_used) & ~(size_t)(2 * MIB - 1);
    CUdeviceptr p;
    CUresult r = A.cuMemAlloc_v2(&p, t);
    if (!r) A.cuMemFree_v2(p);
    printf("full_alloc=%d\nfull_alloc_size=%zu\n", r, t);
}

/* ---------- threads ---------- */

static CUcontext g_ctx;
static int g_iters;
static volatile int g_errors;

static void *worker(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg * 2654435761u;
    A.cuCtxSetCurrent(g_ctx);
    CUdeviceptr live[8];
    int nlive = 0;
    for (int i = 0; i < g_iters; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t sz = (seed >> 8) % 3 == 0 ? (size_t)(1 + (seed >> 4) % (4 * MIB)) : (size_t)(1 + (seed >> 4) % 65536);
        CUdeviceptr p;
        CUresult r = A.cuMemAlloc_v2(&p, sz);
        if (r == 0) {
            live[nlive++] = p;
        } else if (r != CUDA_ERROR_OUT_OF_MEMORY) {
            __sync_fetch_and_add(&g_errors, 1);
        }
        if (nlive == 8 || (seed & 1)) {
            while (nlive > 0)
                if (A.cuMemFree_v2(live[--nlive])) __sync_fetch_and_add(&g_errors, 1);
        }
    }
    while (nlive > 0)
        if (A.cuMemFree_v2(live[--nlive])) __sync_fetch_and_add(&g_errors, 1);
    return NULL;
}

static int cmd_threads(int n, int iters) {
    must(A.cuInit(0), "cuInit");
    g_ctx = ctx_on(0);
    g_iters = iters;
    size_t before = used_now();
    pthread_t t[256];
    if (n > 256) n = 256;
    for (int i = 0; i < n; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    printf("threads=%d\nerrors=%d\nused_before=%zu\nused_after=%zu\n", n, g_errors, before, used_now());
    full_alloc(before);
    return 0;
}

/* ---------- hold (several processes sharing one limit) ---------- */

static int cmd_hold(size_t size) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUdeviceptr p = 0;
    CUresult r = A.cuMemAlloc_v2(&p, size);
    /* What NVML says this process uses on device 0 (before "hold=" so a reader has it). */
    if (N.Init && N.Init() == 0) {
        nvmlDevice_t d;
        nvmlProcessInfo_t procs[64];
        unsigned np = 64;
        if (N.GetHandleByIndex(0, &d) == 0 && N.GetProcs && N.GetProcs(d, &np, procs) == 0)
            for (unsigned k = 0; k < np; k++)
                if (procs[k].pid == (unsigned)getpid()) printf("nvml_self_used=%llu\n", procs[k].usedGpuMemory);
    }
    printf("used=%zu\nhold=%d\n", used_now(), r);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) {
    }
    if (!r) A.cuMemFree_v2(p);
    printf("released\nused=%zu\n", used_now());
    return 0;
}

/* ---------- try: one allocation, report ---------- */

static int cmd_try(size_t size) {
    CUresult ri = A.cuInit(0);
    printf("init=%d\n", ri);
    if (ri) return 0;
    ctx_on(0);
    CUdeviceptr p = 0;
    CUresult r = A.cuMemAlloc_v2(&p, size);
    const char *name = NULL;
    CUresult rn = A.cuGetErrorName(r, &name);
    printf("alloc=%d\nname_rc=%d\nname=%s\nused=%zu\n", r, rn, name ? name : "(null)", used_now());
    if (!r) A.cuMemFree_v2(p);
    return 0;
}

/* ---------- fork ---------- */

static int cmd_fork(size_t size, const char *self) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUdeviceptr p;
    must(A.cuMemAlloc_v2(&p, size), "cuMemAlloc");
    size_t before = used_now();
    pid_t c = fork();
    if (c == 0) _exit(0); /* a child that never touches CUDA and exits */
    int st;
    waitpid(c, &st, 0);
    size_t after_child = used_now();
    /* A child that execs a fresh program using the same shared file. */
    c = fork();
    if (c == 0) {
        execl(self, self, "try", "1048576", (char *)NULL);
        _exit(127);
    }
    waitpid(c, &st, 0);
    size_t after_exec = used_now();
    printf("used_before=%zu\nused_after_child=%zu\nused_after_exec_child=%zu\nexec_status=%d\n", before, after_child,
           after_exec, WEXITSTATUS(st));
    A.cuMemFree_v2(p);
    printf("used_end=%zu\n", used_now());
    return 0;
}

/* ---------- fork after NVML (issue 12 defect 1) ---------- */

/* What a forked worker does with CUDA: initialize, allocate `size`, write and read it back,
 * then ask for twice the limit's worth (`over`, refused under the hook). Prints each step's
 * code with the prefix "child_"; returns the first failing code (0 = all worked). */
static int fork_child_uses_cuda(size_t size, size_t over) {
    CUdevice d;
    CUcontext c;
    CUdeviceptr p = 0, q = 0;
    unsigned char back[64];
    int r = A.cuInit(0);
    printf("child_init=%d\n", r);
    if (!r) printf("child_get=%d\n", r = A.cuDeviceGet(&d, 0));
    if (!r) printf("child_retain=%d\n", r = A.cuDevicePrimaryCtxRetain(&c, d));
    if (!r) printf("child_set=%d\n", r = A.cuCtxSetCurrent(c));
    if (!r) printf("child_alloc=%d\n", r = A.cuMemAlloc_v2(&p, size));
    if (!r) printf("child_memset=%d\n", r = A.cuMemsetD8_v2(p, 0x5a, sizeof back));
    if (!r) printf("child_copy=%d\n", r = A.cuMemcpyDtoH_v2(back, p, sizeof back));
    if (!r) printf("child_data_ok=%d\n", back[0] == 0x5a && back[63] == 0x5a);
    if (!r && over) {
        int o = A.cuMemAlloc_v2(&q, over);
        printf("child_over=%d\n", o);
        if (!o) A.cuMemFree_v2(q);
    }
    if (!r) A.cuMemFree_v2(p);
    fflush(stdout);
    return r;
}

/* The parent does `mode` first, then forks a worker (fork_child_uses_cuda):
 *   none    nothing
 *   nvml    what monitoring code and GPU-picking launchers do: nvmlInit, count, handle by
 *           index, memory info (both versions), UUID, the process list
 *   cuinit  cuInit (the real driver's rule: the child cannot use CUDA then)
 * With VGPU_VIA=procaddr the parent has already called cuGetProcAddress (load_api). */
static int cmd_fork_after(const char *mode, size_t size, size_t over) {
    if (!strcmp(mode, "nvml")) {
        if (!N.Init) die("fork_after nvml: no NVML");
        unsigned n = 0;
        nvmlDevice_t d;
        nvmlMemory_t m;
        nvmlMemory_v2_t m2;
        char uuid[96];
        nvmlProcessInfo_t procs[16];
        unsigned np = 16;
        printf("parent_nvml_init=%d\n", N.Init());
        printf("parent_nvml_count=%d\n", N.GetCount(&n));
        printf("parent_nvml_handle=%d\n", N.GetHandleByIndex(0, &d));
        printf("parent_nvml_meminfo=%d\n", N.GetMemoryInfo(d, &m));
        memset(&m2, 0, sizeof m2);
        m2.version = nvmlMemory_v2;
        if (N.GetMemoryInfo_v2) printf("parent_nvml_meminfo_v2=%d\n", N.GetMemoryInfo_v2(d, &m2));
        printf("parent_nvml_uuid=%d\n", N.GetUUID(d, uuid, sizeof uuid));
        if (N.GetProcs) printf("parent_nvml_procs=%d\n", N.GetProcs(d, &np, procs));
        printf("parent_nvml_total=%llu\n", m.total);
    } else if (!strcmp(mode, "cuinit")) {
        printf("parent_init=%d\n", A.cuInit(0));
    } else if (strcmp(mode, "none")) {
        die("fork_after: mode must be none, nvml or cuinit");
    }
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) _exit(fork_child_uses_cuda(size, over) & 0xff);
    int st = 0;
    waitpid(c, &st, 0);
    printf("child_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
    return 0;
}

/* ---------- everything that takes device memory (issue 12 defect 6) ---------- */

/* Each way a program takes device memory, whatever cuInit answered (a program may ignore
 * it): the primary context, a created context, a module, a library, an allocation. */
static int cmd_takes(void) {
    CUdevice d = 0;
    CUcontext primary = NULL, created = NULL;
    CUmodule m = NULL;
    CUlibrary lib = NULL;
    CUdeviceptr p = 0;
    printf("init=%d\n", A.cuInit(0));
    printf("get=%d\n", A.cuDeviceGet(&d, 0));
    int r = A.cuDevicePrimaryCtxRetain(&primary, d);
    printf("retain=%d\n", r);
    printf("create=%d\n", A.cuCtxCreate_v2(&created, 0, d));
    if (!r) A.cuCtxSetCurrent(primary);
    printf("module=%d\n", A.cuModuleLoadData(&m, VGPU_TEST_PTX));
    printf("library=%d\n", A.cuLibraryLoadData(&lib, VGPU_TEST_PTX, NULL, NULL, 0, NULL, NULL, 0));
    printf("alloc=%d\n", A.cuMemAlloc_v2(&p, 4 * MIB));
    return 0;
}

/* ---------- a reset primary context (issue 12 defect 7) ---------- */

/* Retain the primary context, reset it (what cudaDeviceReset does), retain it anew: the
 * new context's memory is charged like the first one's. Then tries to allocate `size`. */
static int cmd_reset(size_t size) {
    must(A.cuInit(0), "cuInit");
    CUdevice d;
    CUcontext c;
    must(A.cuDeviceGet(&d, 0), "cuDeviceGet");
    ctx_on(0);
    printf("used_first=%zu\n", used_now());
    printf("reset=%d\n", A.cuDevicePrimaryCtxReset_v2(d));
    must(A.cuDevicePrimaryCtxRetain(&c, d), "cuDevicePrimaryCtxRetain again");
    must(A.cuCtxSetCurrent(c), "cuCtxSetCurrent");
    printf("used_again=%zu\n", used_now());
    CUdeviceptr p = 0;
    CUresult r = A.cuMemAlloc_v2(&p, size);
    printf("alloc=%d\n", r);
    if (!r) A.cuMemFree_v2(p);
    /* The retain count is now 2 (first retain, second retain): release both. */
    A.cuDevicePrimaryCtxRelease_v2(d);
    A.cuDevicePrimaryCtxRelease_v2(d);
    return 0;
}

/* ---------- allocate on request (issue 12 defect 8) ---------- */

/* Allocates `first`, prints "first=<code>" and "ready=1", then allocates `second` after
 * a line on stdin, prints "second=<code>" and "done=1", and exits after one more line.
 * Calls no view (cuMemGetInfo, NVML) in between. */
static int cmd_two_steps(size_t first, size_t second) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUdeviceptr p = 0, q = 0;
    char line[64];
    printf("first=%d\nready=1\n", A.cuMemAlloc_v2(&p, first));
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 0;
    printf("second=%d\ndone=1\n", A.cuMemAlloc_v2(&q, second));
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) {
    }
    return 0;
}

/* ---------- ranges and IPC ---------- */

static int cmd_range(void) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    size_t base_used = used_now();
    CUdeviceptr a, b, big;
    must(A.cuMemAlloc_v2(&a, 1000), "cuMemAlloc a");
    must(A.cuMemAlloc_v2(&b, 3000), "cuMemAlloc b");
    must(A.cuMemAlloc_v2(&big, 64 * MIB), "cuMemAlloc big");
    CUdeviceptr base = 0;
    size_t sz = 0;
    CUresult r = A.cuMemGetAddressRange_v2(&base, &sz, b + 10);
    printf("range_rc=%d\nrange_base_off=%lld\nrange_size=%zu\n", r, (long long)(base - b), sz);
    CUdeviceptr start = 0;
    size_t asz = 0;
    CUresult r1 = A.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, b + 10);
    CUresult r2 = A.cuPointerGetAttribute(&asz, CU_POINTER_ATTRIBUTE_RANGE_SIZE, b + 10);
    printf("attr_rc=%d,%d\nattr_start_off=%lld\nattr_size=%zu\n", r1, r2, (long long)(start - b), asz);
    unsigned char buf[3000], back[3000];
    for (int i = 0; i < 3000; i++) buf[i] = (unsigned char)i;
    must(A.cuMemsetD8_v2(a, 0x5a, 1000), "memset a");
    must(A.cuMemcpyHtoD_v2(b, buf, 3000), "HtoD");
    must(A.cuMemcpyDtoH_v2(back, b, 3000), "DtoH");
    unsigned char a0 = 0;
    must(A.cuMemcpyDtoH_v2(&a0, a + 999, 1), "DtoH a");
    printf("copy_ok=%d\nneighbour_ok=%d\n", !memcmp(buf, back, 3000), a0 == 0x5a);
    CUipcMemHandle h;
    printf("ipc_small=%d\n", A.cuIpcGetMemHandle(&h, b));
    printf("ipc_big=%d\n", A.cuIpcGetMemHandle(&h, big));
    A.cuMemFree_v2(a);
    A.cuMemFree_v2(b);
    A.cuMemFree_v2(big);
    printf("double_free_small=%d\n", A.cuMemFree_v2(a));
    printf("double_free_big=%d\n", A.cuMemFree_v2(big));
    printf("interior_free=%d\n", A.cuMemFree_v2(b + 16));
    printf("used_end=%zu\n", used_now());
    full_alloc(base_used);
    return 0;
}

/* ---------- devices (CUDA_VISIBLE_DEVICES) ---------- */

static int cmd_devices(size_t size) {
    must(A.cuInit(0), "cuInit");
    int n = 0;
    A.cuDeviceGetCount(&n);
    printf("count=%d\n", n);
    CUdeviceptr p[16];
    for (int i = 0; i < n && i < 16; i++) {
        ctx_on(i);
        size_t tm = 0;
        CUdevice d;
        A.cuDeviceGet(&d, i);
        A.cuDeviceTotalMem_v2(&tm, d);
        CUresult r = A.cuMemAlloc_v2(&p[i], size * (i + 1));
        printf("dev%d_total_mem=%zu\ndev%d_alloc=%d\ndev%d_used=%zu\n", i, tm, i, r, i, used_now());
    }
    unsigned c = 0;
    if (N.Init && N.Init() == 0 && N.GetCount(&c) == 0)
        for (unsigned i = 0; i < c; i++) {
            nvmlMemory_t m = nvml_mem(i);
            printf("nvml%u_used=%llu\nnvml%u_total=%llu\n", i, m.used, i, m.total);
        }
    return 0;
}

/* ---------- kernels ---------- */

static CUmodule g_mod;
static CUfunction f_spin, f_fill;

/* Initialized, a context current on device 0, the test module's kernels loaded: ready to
 * launch. */
static void launch_ready(void) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    must(A.cuModuleLoadData(&g_mod, VGPU_TEST_PTX), "cuModuleLoadData");
    must(A.cuModuleGetFunction(&f_spin, g_mod, "spin"), "get spin");
    must(A.cuModuleGetFunction(&f_fill, g_mod, "fill"), "get fill");
}

static int cmd_launch(int n) {
    launch_ready();
    CUstream s;
    must(A.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUdeviceptr buf;
    unsigned long long count = 1024;
    must(A.cuMemAlloc_v2(&buf, count * 4), "cuMemAlloc");
    unsigned val = 0xC0FFEE;
    void *fargs[] = {&buf, &val, &count};
    printf("fill=%d\n", A.cuLaunchKernel(f_fill, 4, 1, 1, 256, 1, 1, 0, s, fargs, NULL));
    A.cuStreamSynchronize(s);
    unsigned host[1024];
    A.cuMemcpyDtoH_v2(host, buf, sizeof host);
    int ok = 1;
    for (int i = 0; i < 1024; i++) ok &= host[i] == val;
    printf("fill_ok=%d\n", ok);
    unsigned long long ns = 0;
    void *sargs[] = {&ns};
    CUevent e0, e1;
    A.cuEventCreate(&e0, 0);
    A.cuEventCreate(&e1, 0);
    A.cuEventRecord(e0, s);
    int bad = 0;
    for (int i = 0; i < n; i++) bad += A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, s, sargs, NULL) != 0;
    A.cuEventRecord(e1, s);
    A.cuEventSynchronize(e1);
    float ms = 0;
    A.cuEventElapsedTime(&ms, e0, e1);
    printf("launches=%d\nlaunch_errors=%d\nlaunch_ms=%.3f\n", n, bad, ms);
    ns = 20000000; /* 20 ms */
    A.cuEventRecord(e0, s);
    A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, s, sargs, NULL);
    A.cuEventRecord(e1, s);
    A.cuEventSynchronize(e1);
    A.cuEventElapsedTime(&ms, e0, e1);
    printf("spin20_ms=%.3f\n", ms);
    ns = 0;
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 32;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;
    printf("launch_ex=%d\n", A.cuLaunchKernelEx(&cfg, f_spin, sargs, NULL));
    printf("launch_coop=%d\n", A.cuLaunchCooperativeKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, s, sargs));
    printf("launch_default_stream=%d\n", A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, NULL, sargs, NULL));
    CUgraph g;
    CUgraphExec ge;
    CUresult rc = A.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    for (int i = 0; i < 4; i++) A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, s, sargs, NULL);
    CUresult re = A.cuStreamEndCapture(s, &g);
    CUresult ri = A.cuGraphInstantiateWithFlags(&ge, g, 0);
    CUresult rl = A.cuGraphLaunch(ge, s);
    A.cuStreamSynchronize(s);
    printf("graph=%d,%d,%d,%d\n", rc, re, ri, rl);
    /* A constructed graph: one kernel node writing a new value. */
    CUgraph g2;
    CUgraphNode node;
    CUgraphExec ge2;
    unsigned val2 = 0xBEEF;
    void *fargs2[] = {&buf, &val2, &count};
    CUDA_KERNEL_NODE_PARAMS kp;
    memset(&kp, 0, sizeof kp);
    kp.func = f_fill;
    kp.gridDimX = 4;
    kp.gridDimY = kp.gridDimZ = 1;
    kp.blockDimX = 256;
    kp.blockDimY = kp.blockDimZ = 1;
    kp.kernelParams = fargs2;
    CUresult g0 = A.cuGraphCreate(&g2, 0);
    CUresult g1 = A.cuGraphAddKernelNode_v2(&node, g2, NULL, 0, &kp);
    CUresult gi = A.cuGraphInstantiateWithFlags(&ge2, g2, 0);
    CUresult gl = A.cuGraphLaunch(ge2, s);
    A.cuStreamSynchronize(s);
    A.cuMemcpyDtoH_v2(host, buf, sizeof host);
    ok = 1;
    for (int i = 0; i < 1024; i++) ok &= host[i] == val2;
    printf("graph_node=%d,%d,%d,%d\ngraph_node_ok=%d\n", g0, g1, gi, gl, ok);
    A.cuCtxSynchronize();
    A.cuMemFree_v2(buf);
    return 0;
}

static double now_us(void);

/* ---------- module code: charged, limited, released; hot paths make no NVML query ---------- */

/* What NVML's process list says this process uses on device 0 (-1: not listed). */
static long long nvml_self_used(void) {
    nvmlDevice_t d;
    nvmlProcessInfo_t procs[64];
    unsigned np = 64;
    if (!N.Init || N.Init() != 0 || N.GetHandleByIndex(0, &d) != 0 || !N.GetProcs || N.GetProcs(d, &np, procs) != 0)
        return -1;
    for (unsigned k = 0; k < np; k++)
        if (procs[k].pid == (unsigned)getpid()) return (long long)procs[k].usedGpuMemory;
    return -1;
}

/* NVML queries made so far (the simulator counts them; -1 on a real driver). */
static long long nvml_queries(void) {
    unsigned long long (*q)(void) = (unsigned long long (*)(void))dlsym(RTLD_DEFAULT, "vgpusim_nvml_queries");
    return q ? (long long)q() : -1;
}

static CUresult try_alloc(size_t size) {
    CUdeviceptr p = 0;
    CUresult r = A.cuMemAlloc_v2(&p, size);
    if (!r) A.cuMemFree_v2(p);
    return r;
}

/* Waits for a line on stdin when VGPU_HOLD is set (the test reads the shared file meanwhile). */
static void hold_here(const char *marker) {
    printf("%s=1\n", marker);
    fflush(stdout);
    if (getenv("VGPU_HOLD")) {
        char line[64];
        if (!fgets(line, sizeof line, stdin)) {
        }
    }
}

/* code API SIZE: load the test module (API module or library), try a SIZE allocation before
 * and after its first launch (lazy loading puts the code on the device then), unload it and
 * try again; usage (cuMemGetInfo) at each step. */
/* The module image: VGPU_PTX_FILE's text when set (a GPU test adds a large global), else the
 * built-in test PTX. */
static const char *code_image(void) {
    const char *path = getenv("VGPU_PTX_FILE");
    if (!path || !*path) return VGPU_TEST_PTX;
    FILE *f = fopen(path, "rb");
    if (!f) die("VGPU_PTX_FILE cannot be opened");
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

static int cmd_code(const char *api, size_t size) {
    const char *image = code_image();
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    printf("used_ctx=%zu\n", used_now());
    hold_here("ctx_ready");
    CUlibrary lib = NULL;
    CUresult r;
    if (!strcmp(api, "library")) {
        r = A.cuLibraryLoadData(&lib, image, NULL, NULL, 0, NULL, NULL, 0);
        if (!r) must(A.cuLibraryGetModule(&g_mod, lib), "cuLibraryGetModule");
    } else {
        r = A.cuModuleLoadData(&g_mod, image);
    }
    printf("load=%d\nused_loaded=%zu\n", r, used_now());
    if (r) return 0;
    printf("alloc_loaded=%d\n", try_alloc(size));
    must(A.cuModuleGetFunction(&f_spin, g_mod, "spin"), "get spin");
    unsigned long long ns = 0;
    void *sargs[] = {&ns};
    printf("launch=%d\n", A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, NULL, sargs, NULL));
    A.cuCtxSynchronize();
    printf("used_launched=%zu\n", used_now());
    printf("alloc_launched=%d\n", try_alloc(size));
    printf("nvml_self_used=%lld\n", nvml_self_used());
    hold_here("loaded");
    r = lib ? A.cuLibraryUnload(lib) : A.cuModuleUnload(g_mod);
    printf("unload=%d\nused_unloaded=%zu\nalloc_unloaded=%d\n", r, used_now(), try_alloc(size));
    return 0;
}

/* hot N: N sub-allocated alloc+free pairs and N launches make no NVML query; then N direct
 * (4 MiB) pairs, which may reconcile at most once per VGPU_RECONCILE_MS. */
static int cmd_hot(int n) {
    launch_ready();
    unsigned long long ns = 0;
    void *sargs[] = {&ns};
    must(A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, NULL, sargs, NULL), "first launch");
    A.cuCtxSynchronize();
    must(try_alloc(1024), "warm sub-allocation");
    CUdeviceptr keep;
    must(A.cuMemAlloc_v2(&keep, 1024), "keep a region"); /* so no pair creates or frees one */
    long long q0 = nvml_queries();
    int bad = 0;
    for (int i = 0; i < n; i++) {
        bad += try_alloc(1024) != 0;
        bad += A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, NULL, sargs, NULL) != 0;
    }
    A.cuCtxSynchronize();
    long long q1 = nvml_queries();
    double t0 = now_us();
    for (int i = 0; i < n; i++) bad += try_alloc(4 * MIB) != 0;
    double ms = (now_us() - t0) / 1e3;
    long long q2 = nvml_queries();
    printf("hot_errors=%d\nnvml_hot=%lld\nnvml_direct=%lld\ndirect_ms=%.3f\n", bad, q1 - q0, q2 - q1, ms);
    A.cuMemFree_v2(keep);
    return 0;
}

/* ---------- benchmarks (for callgrind and the GPU bench) ---------- */

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* bench_alloc N SIZE: N alloc+free pairs of SIZE; prints microseconds per pair. */
static int cmd_bench_alloc(int n, size_t size) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUdeviceptr p;
    for (int i = 0; i < 10; i++) {
        must(A.cuMemAlloc_v2(&p, size), "warm alloc");
        A.cuMemFree_v2(p);
    }
    double t0 = now_us();
    for (int i = 0; i < n; i++) {
        A.cuMemAlloc_v2(&p, size);
        A.cuMemFree_v2(p);
    }
    printf("pair_us=%.3f\n", (now_us() - t0) / n);
    return 0;
}

/* bench_small N SIZE: N live allocations of SIZE, then freed; microseconds per alloc, per free. */
static int cmd_bench_small(int n, size_t size) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUdeviceptr *v = calloc((size_t)n, sizeof *v);
    double t0 = now_us();
    int fails = 0;
    for (int i = 0; i < n; i++) fails += A.cuMemAlloc_v2(&v[i], size) != 0;
    double t1 = now_us();
    for (int i = 0; i < n; i++) A.cuMemFree_v2(v[i]);
    double t2 = now_us();
    printf("alloc_us=%.3f\nfree_us=%.3f\nfails=%d\n", (t1 - t0) / n, (t2 - t1) / n, fails);
    return 0;
}

/* bench_free_live LIVE N SIZE: with LIVE other allocations alive, N alloc+free pairs. */
static int cmd_bench_free_live(int live, int n, size_t size) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUdeviceptr *v = calloc((size_t)live + 1, sizeof *v);
    for (int i = 0; i < live; i++) must(A.cuMemAlloc_v2(&v[i], size), "live alloc");
    CUdeviceptr p;
    double tf = 0;
    for (int i = 0; i < n; i++) {
        must(A.cuMemAlloc_v2(&p, size), "alloc");
        double t0 = now_us();
        A.cuMemFree_v2(p);
        tf += now_us() - t0;
    }
    printf("live=%d\nfree_us=%.3f\n", live, tf / n);
    for (int i = 0; i < live; i++) A.cuMemFree_v2(v[i]);
    return 0;
}

/* bench_launch N [IDS [THRASH_KB]]: N launches of an empty spin kernel; microseconds per
 * launch call (host side). IDS > 1 cycles the grid through IDS sizes (that many launch
 * identities, as a model's kernels are); THRASH_KB > 0 writes that much memory between two
 * launches, as a framework's host code does, so the launch path runs with cold caches. With
 * either, only the launch calls are timed. */
static int cmd_bench_launch(int n, int ids, int thrash_kb) {
    launch_ready();
    CUstream s;
    must(A.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    unsigned long long ns = 0;
    void *args[] = {&ns};
    for (int i = 0; i < 100; i++) A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, s, args, NULL);
    A.cuStreamSynchronize(s);
    if (ids <= 1 && thrash_kb <= 0) {
        double t0 = now_us();
        for (int i = 0; i < n; i++) A.cuLaunchKernel(f_spin, 1, 1, 1, 32, 1, 1, 0, s, args, NULL);
        double t1 = now_us();
        A.cuStreamSynchronize(s);
        printf("launch_us=%.3f\n", (t1 - t0) / n);
        return 0;
    }
    if (ids < 1) ids = 1;
    size_t bytes = (size_t)(thrash_kb > 0 ? thrash_kb : 0) * 1024;
    volatile unsigned char *junk = bytes ? malloc(bytes) : NULL;
    if (bytes && !junk) die("malloc");
    double in_calls = 0;
    for (int i = 0; i < n; i++) {
        for (size_t b = 0; b < bytes; b += 64) junk[b] = (unsigned char)(junk[b] + i);
        double t0 = now_us();
        A.cuLaunchKernel(f_spin, 1 + (unsigned)(i % ids), 1, 1, 32, 1, 1, 0, s, args, NULL);
        in_calls += now_us() - t0;
    }
    A.cuStreamSynchronize(s);
    free((void *)junk);
    printf("launch_us=%.3f\n", in_calls / n);
    return 0;
}

/* ---------- leak: take memory by every path and exit without giving it back ---------- */

static int cmd_leak(size_t size) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    const char *paths[] = {"alloc", "pitch", "managed", "vmm", "async", "array", "mipmap"};
    for (unsigned i = 0; i < sizeof paths / sizeof *paths; i++) {
        held_t h;
        printf("leak_%s=%d\n", paths[i], take(paths[i], size, &h));
    }
    CUdeviceptr small;
    printf("leak_small=%d\n", A.cuMemAlloc_v2(&small, 100));
    printf("used=%zu\n", used_now());
    fflush(stdout);
    return 0;
}

/* ---------- exit: leave the shared table at a normal exit ---------- */

/* Takes `size` bytes (direct) and a small sub-allocation, prints what it holds. */
static void take_and_report(size_t size) {
    must(A.cuInit(0), "cuInit");
    g_ctx = ctx_on(0);
    CUdeviceptr big, small;
    must(A.cuMemAlloc_v2(&big, size), "cuMemAlloc big");
    must(A.cuMemAlloc_v2(&small, 1000), "cuMemAlloc small");
    printf("pid=%d\nused=%zu\n", (int)getpid(), used_now());
    fflush(stdout);
}

static volatile long g_loops;
static volatile int g_alloc_errors;

/* Allocates and frees 4 MiB (a direct allocation: a reservation in the shared file) forever. */
static void *alloc_forever(void *arg) {
    (void)arg;
    A.cuCtxSetCurrent(g_ctx);
    for (;;) {
        CUdeviceptr p;
        CUresult r = A.cuMemAlloc_v2(&p, 4 * MIB);
        if (r == 0) {
            if (A.cuMemFree_v2(p)) g_alloc_errors++;
        } else if (r != CUDA_ERROR_OUT_OF_MEMORY) {
            g_alloc_errors++;
        }
        g_loops++;
    }
    return NULL;
}

static void *exit_now(void *arg) {
    (void)arg;
    printf("exiting_loops=%ld\nalloc_errors=%d\n", g_loops, g_alloc_errors);
    fflush(stdout);
    exit(0);
}

static void *hold_briefly(void *arg) {
    (void)arg;
    A.cuCtxSetCurrent(g_ctx);
    CUdeviceptr p;
    printf("thread_alloc=%d\n", A.cuMemAlloc_v2(&p, 2 * MIB));
    fflush(stdout);
    usleep(50000);
    return NULL;
}

/* how: "return" from main; "thread": exit() from a new thread while another allocates;
 * "pthread_exit": main calls pthread_exit and the last thread's end exits the process;
 * "fork": a child calls exit() (the parent keeps its usage and waits for a line on stdin). */
static int cmd_exit(const char *how, size_t size) {
    take_and_report(size);
    if (!strcmp(how, "return")) return 0;
    if (!strcmp(how, "thread")) {
        pthread_t a, b;
        pthread_create(&a, NULL, alloc_forever, NULL);
        while (g_loops < 200) usleep(1000);
        pthread_create(&b, NULL, exit_now, NULL);
        pthread_join(b, NULL); /* never returns: the process exits */
        return 4;
    }
    if (!strcmp(how, "pthread_exit")) {
        pthread_t a;
        pthread_create(&a, NULL, hold_briefly, NULL);
        pthread_exit(NULL);
    }
    if (!strcmp(how, "fork")) {
        pid_t c = fork();
        if (c == 0) exit(0); /* a normal exit: the child's exit handlers run */
        int st;
        waitpid(c, &st, 0);
        printf("child_status=%d\nhold=0\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        fflush(stdout);
        char line[64];
        if (!fgets(line, sizeof line, stdin)) {
        }
        return 0;
    }
    die("exit: how must be return, thread, pthread_exit or fork");
    return 2;
}

/* ---------- stream-ordered allocations held (issue 12 defect 9) ---------- */

/* hold_async SIZE...: cuMemAllocAsync of each size, one right after the other on one stream
 * (as PyTorch's cudaMallocAsync backend makes them), synchronize, print what NVML lists for
 * this process ("nvml_self_used", -1 if not listed; the process list is not hooked, so this
 * triggers nothing in the hook) and "hold=1", then free after a line on stdin. No view
 * (cuMemGetInfo, nvmlDeviceGetMemoryInfo) is called. */
static int cmd_hold_async(int n, char **sizes) {
    must(A.cuInit(0), "cuInit");
    ctx_on(0);
    CUstream s;
    must(A.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUdeviceptr p[16];
    int k = 0;
    for (; k < n && k < 16; k++) {
        CUresult r = A.cuMemAllocAsync(&p[k], strtoull(sizes[k], NULL, 0), s);
        printf("async%d=%d\n", k, r);
        if (r) break;
    }
    must(A.cuStreamSynchronize(s), "cuStreamSynchronize");
    printf("nvml_self_used=%lld\nhold=1\n", nvml_self_used());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) {
    }
    for (int i = 0; i < k; i++) A.cuMemFreeAsync(p[i], s);
    A.cuStreamSynchronize(s);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) die("usage: probe info|counted|threads|hold|try|fork|range|devices|launch|bench_*|leak|exit ...");
    load_api();
    printf("via=%s\n", via);
    const char *c = argv[1];
#define ARG(i) (argc > (i) ? strtoull(argv[i], NULL, 0) : 0)
    if (!strcmp(c, "info")) return cmd_info();
    if (!strcmp(c, "counted") && argc == 5) return cmd_counted(argv[2], ARG(3), ARG(4));
    if (!strcmp(c, "threads")) return cmd_threads((int)ARG(2), (int)ARG(3));
    if (!strcmp(c, "hold")) return cmd_hold(ARG(2));
    if (!strcmp(c, "try")) return cmd_try(ARG(2));
    if (!strcmp(c, "fork")) return cmd_fork(ARG(2), argv[0]);
    if (!strcmp(c, "fork_after") && argc >= 4) return cmd_fork_after(argv[2], ARG(3), ARG(4));
    if (!strcmp(c, "range")) return cmd_range();
    if (!strcmp(c, "takes")) return cmd_takes();
    if (!strcmp(c, "hold_async")) return cmd_hold_async(argc - 2, argv + 2);
    if (!strcmp(c, "two_steps")) return cmd_two_steps(ARG(2), ARG(3));
    if (!strcmp(c, "reset")) return cmd_reset(ARG(2));
    if (!strcmp(c, "devices")) return cmd_devices(ARG(2));
    if (!strcmp(c, "launch")) return cmd_launch((int)ARG(2));
    if (!strcmp(c, "bench_alloc")) return cmd_bench_alloc((int)ARG(2), ARG(3));
    if (!strcmp(c, "bench_small")) return cmd_bench_small((int)ARG(2), ARG(3));
    if (!strcmp(c, "bench_free_live")) return cmd_bench_free_live((int)ARG(2), (int)ARG(3), ARG(4));
    if (!strcmp(c, "bench_launch"))
        return cmd_bench_launch((int)ARG(2), argc > 3 ? (int)ARG(3) : 1, argc > 4 ? (int)ARG(4) : 0);
    if (!strcmp(c, "leak")) return cmd_leak(ARG(2));
    if (!strcmp(c, "code") && argc == 4) return cmd_code(argv[2], ARG(3));
    if (!strcmp(c, "hot")) return cmd_hot((int)ARG(2));
    if (!strcmp(c, "exit") && argc == 4) return cmd_exit(argv[2], ARG(3));
    die("unknown command");
    return 2;
}
