// Does compute-sanitizer's initcheck see global writes made by cp.async.bulk (shared ->
// global, the async proxy)? The warp-specialized backward's first key block stores each dq_accum
// tile that way, and initcheck reports the convert kernel's reads of those tiles. On the lent
// H100 (compute-sanitizer 2025.3.1; docs/archive/PERF.md, "initcheck and the backward's bulk
// stores"): `./probe 0` (plain stores) 0 errors, `./probe 1` (one bulk store) 1016 errors,
// "Uninitialized __global__ memory read" for the reads of the data it wrote; the sum (523776)
// is right either way. On the GPU machine:
//   nvcc -arch=sm_90a -o /tmp/probe scripts/gpu/initcheck_bulk_probe.cu
//   compute-sanitizer --tool initcheck /tmp/probe 1
#include <cstdint>
#include <cstdio>
#include <cstdlib>

__global__ void write_bulk(float* g, int n, int bulk) {
    __shared__ __align__(128) float s[1024];
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = float(i);
    if (!bulk) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) g[i] = s[i];
        return;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t sa = uint32_t(__cvta_generic_to_shared(s));
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(g),
                     "r"(sa), "r"(n * 4)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
}
__global__ void read(const float* g, int n, float* out) {
    float acc = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += g[i];
    atomicAdd(out, acc);
}
int main(int argc, char** argv) {
    const int bulk = argc > 1 ? atoi(argv[1]) : 1, n = 1024;
    float *g, *out;
    cudaMalloc(&g, n * 4);
    cudaMalloc(&out, 4);
    cudaMemset(out, 0, 4);
    write_bulk<<<1, 128>>>(g, n, bulk);
    read<<<1, 128>>>(g, n, out);
    float h;
    cudaMemcpy(&h, out, 4, cudaMemcpyDeviceToHost);
    printf("bulk=%d sum=%.0f (expect %.0f) err=%s\n", bulk, h, n * (n - 1) / 2.0,
           cudaGetErrorString(cudaGetLastError()));
    return 0;
}
