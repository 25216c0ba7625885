// Does compute-sanitizer racecheck model mbarrier arrive/wait ordering? Warp 1 reads a shared
// buffer and arrives; thread 0 waits on the barrier, then overwrites the buffer.
// VARIANT 1: st.shared write; 2: cp.async.bulk write; 3: 2 + fence.proxy.async before arrive;
// 4: named barrier (bar.sync) instead of the mbarrier.
#include <cstdio>
#include <cstdint>
__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__global__ void k(const float* src, float* out) {
  __shared__ __align__(128) float buf[64];
  __shared__ __align__(8) uint64_t bars[2];
  const uint32_t b_empty = __cvta_generic_to_shared(&bars[0]);
  const uint32_t b_full = __cvta_generic_to_shared(&bars[1]);
  if (threadIdx.x < 64) buf[threadIdx.x] = src[threadIdx.x];
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b_empty), "r"(1) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b_full), "r"(1) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 1) {
    float v = buf[lane];
    out[lane] = v;
    __syncwarp();
#if VARIANT == 3
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
#if VARIANT == 4
    asm volatile("bar.arrive 1, 64;\n" ::: "memory");
#else
    if (lane == 0) arrive(b_empty);
#endif
  } else if (warp == 0) {
#if VARIANT == 4
    asm volatile("bar.sync 1, 64;\n" ::: "memory");
#else
    if (lane == 0) wait(b_empty, 0);
    __syncwarp();
#endif
    if (lane == 0) {
#if VARIANT == 1 || VARIANT == 4
      for (int i = 0; i < 64; ++i) buf[i] = src[64 + i];
#else
      const uint32_t dst = __cvta_generic_to_shared(buf);
      asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(b_full), "r"(256) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                   ::"r"(dst), "l"(src + 64), "r"(256), "r"(b_full) : "memory");
      wait(b_full, 0);
#endif
    }
  }
}
int main() {
  float *src, *out;
  cudaMalloc(&src, 512 * 4); cudaMalloc(&out, 64 * 4);
  cudaMemset(src, 0, 512 * 4);
  k<<<1, 64>>>(src, out);
  printf("variant %d: %s\n", VARIANT, cudaGetErrorString(cudaDeviceSynchronize()));
}
