/* Which driver calls invalidate a global-mode stream capture (run bare on a real GPU). */
#include <stdio.h>
#include <string.h>
#include "cuda_min.h"
CUresult cuStreamGetCtx(CUstream s, CUcontext *c);
CUresult cuCtxGetDevice(CUdevice *d);
CUresult cuCtxGetCurrent(CUcontext *c);
CUresult cuDeviceGetMemPool(CUmemoryPool *p, CUdevice d);
CUresult cuStreamIsCapturing(CUstream s, int *st);
CUresult cuCtxPushCurrent_v2(CUcontext c);
CUresult cuCtxPopCurrent_v2(CUcontext *c);
int main(void) {
    CUdevice d; CUcontext c; CUstream s; CUmemoryPool pool; CUgraph g; CUdeviceptr p;
    cuInit(0); cuDeviceGet(&d, 0); cuDevicePrimaryCtxRetain(&c, d); cuCtxSetCurrent(c);
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING); cuDeviceGetMemPool(&pool, d);
    for (int t = 0; t < 11; t++) {
        unsigned long long v = 0; size_t f, tt; int st; CUcontext cc; CUdevice dd; CUmemoryPool pp;
        cuStreamBeginCapture_v2(s, 0);
        CUresult r = 0; const char *what = "";
        switch (t) {
        case 0: what = "nothing"; break;
        case 1: what = "cuStreamGetCtx"; r = cuStreamGetCtx(s, &cc); break;
        case 2: what = "cuCtxGetDevice"; r = cuCtxGetDevice(&dd); break;
        case 3: what = "cuCtxGetCurrent"; r = cuCtxGetCurrent(&cc); break;
        case 4: what = "cuDeviceGetMemPool"; r = cuDeviceGetMemPool(&pp, d); break;
        case 5: what = "cuStreamIsCapturing"; r = cuStreamIsCapturing(s, &st); break;
        case 6: what = "cuMemPoolGetAttribute(RESERVED)"; r = cuMemPoolGetAttribute(pool, 5, &v); break;
        case 7: what = "cuMemPoolGetAttribute(USED)"; r = cuMemPoolGetAttribute(pool, 7, &v); break;
        case 8: what = "cuMemGetInfo"; r = cuMemGetInfo_v2(&f, &tt); break;
        case 9: what = "cuCtxPush+Pop"; r = cuCtxPushCurrent_v2(c); cuCtxPopCurrent_v2(&cc); break;
        case 10: what = "cuMemAllocAsync"; r = cuMemAllocAsync(&p, 1 << 20, s); break;
        }
        CUresult e = cuStreamEndCapture(s, &g);
        printf("%-34s call=%d end_capture=%d\n", what, r, e);
    }
    return 0;
}
