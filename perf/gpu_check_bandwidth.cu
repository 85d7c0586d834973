// Part of rigctl's perf/gpu_check.py: the card's peak memory bandwidth from what the device itself reports.
// Prints "<memory clock, kHz> <bus width, bits>" of CUDA device 0 (the check pins CUDA_VISIBLE_DEVICES).
// Device attributes, not cudaDeviceProp: CUDA 13 dropped the struct's memoryClockRate field.
#include <cstdio>
#include <cuda_runtime.h>

int main() {
    int clock_khz = 0;
    int bus_bits = 0;
    cudaError_t err = cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0);
    if (err == cudaSuccess) {
        err = cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0);
    }
    if (err != cudaSuccess) {
        std::fprintf(stderr, "%s\n", cudaGetErrorString(err));
        return 1;
    }
    std::printf("%d %d\n", clock_khz, bus_bits);
    return 0;
}
