"""How long NVML's power and utilization queries take (why they are off the launch path).

usage: python3 nvml_latency.py [calls]
"""
import ctypes
import statistics
import sys
import time

n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()
dev = ctypes.c_void_p()
nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
u64, u32 = ctypes.c_ulonglong(), ctypes.c_uint()
util = (ctypes.c_uint * 2)()
calls = {
    "nvmlDeviceGetTotalEnergyConsumption": lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(u64)),
    "nvmlDeviceGetEnforcedPowerLimit": lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(dev, ctypes.byref(u32)),
    "nvmlDeviceGetUtilizationRates": lambda: nvml.nvmlDeviceGetUtilizationRates(dev, util),
    "nvmlDeviceGetPowerUsage": lambda: nvml.nvmlDeviceGetPowerUsage(dev, ctypes.byref(u32)),
}
for name, f in calls.items():
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns()
        rc = f()
        ts.append((time.perf_counter_ns() - t) / 1000)
        time.sleep(0.002)
    ts.sort()
    print(f"{name:40s} rc={rc} median {statistics.median(ts):8.1f} us  p90 {ts[int(0.9 * n)]:8.1f} us  max {ts[-1]:8.1f} us")
