// Device helpers shared by the SPIN kernels.
#pragma once
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math_constants.h>

#include "spin/spin_kernels.h"

namespace spin {

// Raise a kernel's dynamic shared-memory limit to `bytes`, never lower it: a CUDA graph captured
// with a larger launch of the same kernel stays launchable.
template <typename Kernel>
inline cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  if (static_cast<size_t>(attr.maxDynamicSharedSizeBytes) >= bytes) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and in launches without it). A kernel
// that lets its dependents start calls pdl_launch_dependents(); one launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may then run beside it, and pdl_wait()
// blocks until that kernel has completed and its writes are visible.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A grid launched beside its predecessor (beside_previous) must not complete before it: what
// follows in the stream waits for this grid only. One thread of the first CTA waits; the other
// CTAs leave as they finish. Call it on every exit path.
__device__ __forceinline__ void leave_after_previous(bool beside_previous) {
  if (beside_previous && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
      threadIdx.x == 0)
    pdl_wait();
}

// An attribute of the current device (host side; 0 if it cannot be read).
inline int current_device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&value, attr, device);
  return value;
}

// Sets cfg's attributes (attr: room for one) so that the kernel may start beside the one
// launched before it in the stream (programmatic stream serialization); only with
// beside_previous and on sm_90+, elsewhere the launch is plain.
inline void allow_beside_previous(cudaLaunchConfig_t& cfg, cudaLaunchAttribute* attr,
                                  bool beside_previous) {
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs =
      beside_previous && current_device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9 ? 1 : 0;
}

// The largest block id whose slot ids (block * 64 + offset) all fit int32: past it a block has
// no slot id (the reference's rule; topk.cu's slot_id, remap, the logits' block lookup).
constexpr int kMaxSlotBlock = INT_MAX / kBlockSize;

// Monotone map float -> uint32 (larger float, larger key); -0.0 is folded into +0.0 so that
// equal values tie, as in torch.
__device__ __forceinline__ uint32_t ordered_key(float x) {
  if (x == 0.0f) x = 0.0f;
  uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The float whose ordered_key is `key` (0.0f for the key of +-0.0).
__device__ __forceinline__ float value_of_key(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// ordered_key on 16 bits for a value fp16 holds exactly (fp16 or fp8 state and its max
// pooling): the same order and ties, in half the radix passes.
__device__ __forceinline__ uint32_t ordered_key16(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t h = __half_as_ushort(__float2half_rn(x));
  return (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
}

__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Same chain as reference.counter_hash: h = fmix32(seed ^ C0); h = fmix32(h ^ v ^ Ck), split
// where the block comes in: the first four rounds are one value for a whole (request, layer)
// stream, counter_hash_block(counter_hash_stream(seed, request, layer, step), block).
__device__ __forceinline__ uint32_t counter_hash_stream(uint32_t seed, int64_t request,
                                                        int64_t layer, int64_t step) {
  uint32_t h = fmix32(seed ^ 0x9E3779B9u);
  h = fmix32(h ^ static_cast<uint32_t>(request) ^ 0x85EBCA77u);
  h = fmix32(h ^ static_cast<uint32_t>(layer) ^ 0xC2B2AE3Du);
  return fmix32(h ^ static_cast<uint32_t>(step) ^ 0x27D4EB2Fu);
}

__device__ __forceinline__ uint32_t counter_hash_block(uint32_t stream_hash, int64_t block) {
  return fmix32(stream_hash ^ static_cast<uint32_t>(block) ^ 0x165667B1u);
}

__host__ __device__ constexpr int state_bytes(int type) {
  return type == kStateF32 ? 4 : type == kStateF16 ? 2 : 1;
}

// The largest finite value of a state type: stores saturate there, as reference._store does.
__host__ __device__ constexpr float state_max(int type) {
  return type == kStateF32 ? FLT_MAX : type == kStateF16 ? 65504.0f : kE4M3Max;
}

__device__ __forceinline__ float saturate_state(int type, float v) {
  return fminf(fmaxf(v, -state_max(type)), state_max(type));
}

__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __half2float(__half(h));
}

// Two e4m3 entries (the low 16 bits, first entry in the low byte) as a packed fp16 pair:
// exact, as every e4m3 value is an fp16 value.
__device__ __forceinline__ __half2 e4m3x2_to_half2(uint32_t pair) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
  return __half2(h);
}

// Round to nearest even, saturated (NaN, never stored by the ops, goes to -448 like fp16's).
__device__ __forceinline__ uint32_t float_to_e4m3(float v) {
  return __nv_cvt_float_to_fp8(saturate_state(kStateE4M3, v), __NV_SATFINITE, __NV_E4M3);
}

// float_to_e4m3 of two values in one conversion: lo in the low byte.
__device__ __forceinline__ uint32_t float2_to_e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(
      make_float2(saturate_state(kStateE4M3, lo), saturate_state(kStateE4M3, hi)), __NV_SATFINITE,
      __NV_E4M3);
}

// The raw bits of one entry, converted later by state_from_bits: a loop that loads several
// entries then issues every load before the first conversion waits on it.
__device__ __forceinline__ uint32_t load_state_bits(const void* base, int type, int64_t idx) {
  if (type == kStateF32) return static_cast<const uint32_t*>(base)[idx];
  if (type == kStateF16) return static_cast<const uint16_t*>(base)[idx];
  return static_cast<const uint8_t*>(base)[idx];
}

__device__ __forceinline__ float state_from_bits(uint32_t bits, int type) {
  if (type == kStateF32) return __uint_as_float(bits);
  if (type == kStateF16) return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  return e4m3_to_float(bits);
}

__device__ __forceinline__ float load_state(const void* base, int type, int64_t idx) {
  return state_from_bits(load_state_bits(base, type, idx), type);
}

// Whole rows of V/D can be read vec entries at a time: cap % vec == 0 and both arrays aligned
// to vec entries.
__host__ __device__ __forceinline__ bool state_vectorizable(const StateView& s, int vec = 4) {
  const uintptr_t bytes = static_cast<uintptr_t>(vec) * state_bytes(s.type);
  return s.cap % vec == 0 && reinterpret_cast<uintptr_t>(s.V) % bytes == 0 &&
         reinterpret_cast<uintptr_t>(s.D) % bytes == 0;
}

// kVec state entries of one 4-, 8- or 16-byte load, kept raw until read: converting at the load
// makes the compiler wait on each load in turn instead of issuing them all first.
template <int kType, int kVec>
struct StateVec {
  static constexpr int kWords = kVec * state_bytes(kType) / 4;
  static_assert(kWords == 1 || kWords == 2 || kWords == 4, "4-, 8- or 16-byte loads");
  uint32_t w[kWords];
  // entries idx..idx+kVec-1; idx % kVec == 0 on a state_vectorizable(s, kVec) row
  __device__ __forceinline__ void load(const void* base, int64_t idx) {
    const char* at = static_cast<const char*>(base) + idx * state_bytes(kType);
    if constexpr (kWords == 4) {
      const uint4 r = *reinterpret_cast<const uint4*>(at);
      w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
    } else if constexpr (kWords == 2) {
      const uint2 r = *reinterpret_cast<const uint2*>(at);
      w[0] = r.x; w[1] = r.y;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(at);
    }
  }
  // vector vi of a row (entries kVec*vi..): 32-bit index, the row pointer carries the base
  __device__ __forceinline__ void load_vec(const void* row, int vi) {
    if constexpr (kWords == 4) {
      const uint4 r = static_cast<const uint4*>(row)[vi];
      w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
    } else {
      const uint2 r = static_cast<const uint2*>(row)[vi];
      w[0] = r.x; w[1] = r.y;
    }
  }
  // x saturated and stored as vector vi of a row (the counterpart of load_vec)
  __device__ __forceinline__ static void store_vec(void* row, int vi, const float (&x)[kVec]) {
    uint32_t o[kWords];
#pragma unroll
    for (int u = 0; u < kWords; ++u) {
      if constexpr (kType == kStateF16) {
        const __half2 h2 = __halves2half2(__float2half_rn(saturate_state(kType, x[2 * u])),
                                          __float2half_rn(saturate_state(kType, x[2 * u + 1])));
        o[u] = *reinterpret_cast<const uint32_t*>(&h2);
      } else if constexpr (kType == kStateE4M3) {
        o[u] = float2_to_e4m3x2(x[4 * u], x[4 * u + 1]) |
               float2_to_e4m3x2(x[4 * u + 2], x[4 * u + 3]) << 16;
      } else {
        o[u] = __float_as_uint(saturate_state(kType, x[u]));
      }
    }
    if constexpr (kWords == 4)
      static_cast<uint4*>(row)[vi] = make_uint4(o[0], o[1], o[2], o[3]);
    else
      static_cast<uint2*>(row)[vi] = make_uint2(o[0], o[1]);
  }
  // every entry as a float (fp8: two per conversion)
  __device__ __forceinline__ void unpack(float (&x)[kVec]) const {
#pragma unroll
    for (int e = 0; e < kVec; e += 2) {
      if constexpr (kType == kStateE4M3) {
        const float2 f = __half22float2(e4m3x2_to_half2(w[e / 4] >> (8 * (e % 4))));
        x[e] = f.x;
        x[e + 1] = f.y;
      } else {
        x[e] = (*this)[e];
        x[e + 1] = (*this)[e + 1];
      }
    }
  }
  __device__ __forceinline__ float operator[](int e) const {
    if constexpr (kType == kStateF16) {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[e / 2]);
      return (e & 1) ? __high2float(h) : __low2float(h);
    } else if constexpr (kType == kStateE4M3) {
      return e4m3_to_float((w[e / 4] >> (8 * (e % 4))) & 0xFFu);
    } else {
      return __uint_as_float(w[e]);
    }
  }
};

__device__ __forceinline__ void store_state(void* base, int type, int64_t idx, float v) {
  if (type == kStateF32)
    static_cast<float*>(base)[idx] = saturate_state(type, v);
  else if (type == kStateF16)
    static_cast<__half*>(base)[idx] = __float2half_rn(saturate_state(type, v));
  else
    static_cast<uint8_t*>(base)[idx] = static_cast<uint8_t>(float_to_e4m3(v));
}

// EMA in the reference's order: round(a * old) + round(b * z), no fused multiply-add.
__device__ __forceinline__ float ema(float a, float b, float old, float z) {
  return __fadd_rn(__fmul_rn(a, old), __fmul_rn(b, z));
}

// Inclusive prefix sum over the lanes of a warp (all 32 lanes call it).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// Exclusive prefix sum of v over the CTA's threads; the CTA's total in `total`. warp_sums
// (kT / 32 ints) is free at the call and read until the next barrier.
template <int kT>
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int& total) {
  constexpr int kW = kT / 32;
  static_assert(kW <= 32, "the warps' sums are scanned in one warp");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int incl = warp_inclusive_sum(v);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int s = warp_inclusive_sum(lane < kW ? warp_sums[lane] : 0);
    if (lane < kW) warp_sums[lane] = s;
  }
  __syncthreads();
  total = warp_sums[kW - 1];
  return (warp > 0 ? warp_sums[warp - 1] : 0) + incl - v;
}

// Block-wide sum of one value per thread; every thread gets the total. `scratch` holds
// one int per warp and must not be in use by the caller.
template <int THREADS>
__device__ __forceinline__ long long block_sum(long long v, long long* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  long long total = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += scratch[w];
  return total;
}

template <int THREADS>
__device__ __forceinline__ float block_min_max(float v, bool want_max, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = want_max ? fmaxf(v, other) : fminf(v, other);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) r = want_max ? fmaxf(r, scratch[w]) : fminf(r, scratch[w]);
  return r;
}

}  // namespace spin

namespace spin {

// Exact descending selection of T entries by a kKeyBits-bit key (32 or 16), ties to the lower
// index. radix_threshold: the T-th largest key among eligible entries (kKeyBits / 8 passes of
// 8-bit digit histograms) and how many entries equal to it are taken (`need`); entries with a
// larger key are all taken. Requires 1 <= T <= #eligible. `hist` holds 256 ints; `bcast` 2 ints
// (3 with `whole`). With `whole`, the passes stop once the T-th key's bin is taken entirely;
// *whole then says that every eligible entry with a key >= thr is taken (thr may be below the
// T-th key, no tie order needed), else thr and need are exact as without it.
// With several CTAs sharing one selection (a thread-block cluster), each counts its own entries
// into `hist` and merge() leaves the sum over the CTAs in `merged` (256 ints) after each pass;
// T and #eligible are then totals over the CTAs.
template <int THREADS, int kKeyBits = 32, typename Key, typename Eligible, typename Merge>
__device__ void radix_threshold(int count, int T, Key key, Eligible eligible, int* hist,
                                const int* merged, Merge merge, int* bcast, uint32_t& thr,
                                int& need, bool* whole = nullptr) {
  static_assert(kKeyBits == 32 || kKeyBits == 16, "32- or 16-bit keys");
  uint32_t prefix = 0, mask = 0;
  int remaining = T;
  if (whole != nullptr) *whole = false;
  for (int shift = kKeyBits - 8; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += THREADS) hist[d] = 0;
    __syncthreads();
    for (int base = 0; base < count; base += THREADS) {
      const int i = base + threadIdx.x;
      uint32_t digit = 256;  // 256: nothing to count
      if (i < count && eligible(i)) {
        const uint32_t k = key(i);
        if ((k & mask) == prefix) digit = (k >> shift) & 255u;
      }
      // one atomic per distinct digit of the warp: high digits repeat a lot in early passes
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit < 256 && (threadIdx.x & 31) == __ffs(peers) - 1)
        atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    merge();
    if (threadIdx.x < 32) {
      // walking the bins from the top, the first d with (entries above d) + hist[d] >= remaining
      // (d = 0 if none): lane l sums bins 255-8l .. 248-8l, a warp scan finds the lane to walk
      const int lane = threadIdx.x, top = 255 - 8 * lane;
      int sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += merged[top - j];
      const int incl = warp_inclusive_sum(sum);
      int cum = incl - sum;
      if (cum < remaining && (incl >= remaining || lane == 31)) {
        int d = top;
        for (; d > 0 && cum + merged[d] < remaining; --d) cum += merged[d];
        bcast[0] = d;
        bcast[1] = remaining - cum;
        if (whole != nullptr) bcast[2] = merged[d] == remaining - cum;
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(bcast[0]) << shift;
    mask |= 255u << shift;
    remaining = bcast[1];
    const bool bin_taken = whole != nullptr && bcast[2];
    __syncthreads();
    if (bin_taken) {
      *whole = true;
      break;
    }
  }
  thr = prefix;
  need = remaining;
}

template <int THREADS, int kKeyBits = 32, typename Key, typename Eligible>
__device__ void radix_threshold(int count, int T, Key key, Eligible eligible, int* hist,
                                int* bcast, uint32_t& thr, int& need, bool* whole = nullptr) {
  radix_threshold<THREADS, kKeyBits>(count, T, key, eligible, hist, hist, [] {}, bcast, thr, need,
                                     whole);
}

}  // namespace spin
