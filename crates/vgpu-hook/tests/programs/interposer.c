/* A preloadable library that defines cuMemAlloc_v2 and nothing else: calls that reach it
 * return 777. Used to show that the simulated driver's cuGetProcAddress pointers cannot be
 * interposed (it is linked with -Bsymbolic-functions, like the real driver). */
typedef unsigned long long CUdeviceptr;
int cuMemAlloc_v2(CUdeviceptr *p, unsigned long n) {
    (void)p;
    (void)n;
    return 777;
}
