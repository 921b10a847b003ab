// Device building blocks the selection kernels share (part of
// approx_topk.cuh, which is what to include): element types moved as raw
// bits, the grid-stride loops over x or the candidate list (warp-uniform
// calls, so their bodies may use ballots), warp-aggregated slot claims,
// block sums, and the parallel crossing search over a histogram that the
// sample and plan kernels use.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_PRIMITIVES_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_PRIMITIVES_CUH_

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "approx_topk_scratch.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

// Element types. Kernels move raw bits (uint32 / uint16) and convert to float
// only for the key, so values are written back bit-exactly in their dtype.

template <typename T>
struct Traits;

template <>
struct Traits<float> {
  using Bits = uint32_t;
  static constexpr int kVec = 4;  // entries per 16-byte load
  __device__ static float ToFloat(uint32_t b) { return __uint_as_float(b); }
};

template <>
struct Traits<__half> {
  using Bits = uint16_t;
  static constexpr int kVec = 8;
  __device__ static float ToFloat(uint16_t b) {
    return __half2float(__ushort_as_half(b));
  }
};

template <>
struct Traits<__nv_bfloat16> {
  using Bits = uint16_t;
  static constexpr int kVec = 8;
  __device__ static float ToFloat(uint16_t b) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
};

__device__ __forceinline__ uint32_t Word(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Entry j of a 16-byte vector (little endian: the low half comes first).
// j is a compile-time constant after unrolling, so this folds to a register.
template <typename Bits>
__device__ __forceinline__ Bits VecEntry(const uint4& v, int j);

template <>
__device__ __forceinline__ uint32_t VecEntry<uint32_t>(const uint4& v, int j) {
  return Word(v, j);
}

template <>
__device__ __forceinline__ uint16_t VecEntry<uint16_t>(const uint4& v, int j) {
  return static_cast<uint16_t>(Word(v, j >> 1) >> ((j & 1) * 16));
}

// Entries before x's first 16-byte boundary (x is aligned to sizeof(T)).
template <typename T>
__host__ __device__ inline int64_t HeadCount(const T* x, int64_t n) {
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(x) & 15u;
  const int64_t head =
      misalign == 0 ? 0 : static_cast<int64_t>((16u - misalign) / sizeof(T));
  return head < n ? head : n;
}

// x[0:n] as the streaming passes read it: the body in whole 16-byte vectors
// from the first aligned address (entry j of vector vi is x[head + vi * V +
// j]), then the head (entries before it) and the tail (fewer than one vector
// at the end), which block 0 handles, one entry per thread.
struct VectorBody {
  const uint4* body;
  int64_t head;      // entries before the body
  int64_t nv;        // whole vectors in the body
};

template <typename T>
__device__ __forceinline__ VectorBody BodyOf(const T* x, int64_t n) {
  using Bits = typename Traits<T>::Bits;
  constexpr int V = Traits<T>::kVec;
  VectorBody b;
  b.head = HeadCount(x, n);
  b.nv = (n - b.head) / V;
  b.body = reinterpret_cast<const uint4*>(reinterpret_cast<const Bits*>(x) + b.head);
  return b;
}

// The grid-stride loop over the body: calls iteration(v, base) with v[u] the
// thread's vector base + u * blockDim.x + threadIdx.x (zeros past the end).
// The trip count is block-uniform.
template <typename Iteration>
__device__ __forceinline__ void ForEachIteration(const VectorBody& b,
                                                 Iteration& iteration) {
  const int64_t per_iter = static_cast<int64_t>(blockDim.x) * kUnroll;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_iter;
  for (int64_t base = blockIdx.x * per_iter; base < b.nv; base += stride) {
    uint4 v[kUnroll];
    // All loads first (memory-level parallelism), then the arithmetic.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      v[u] = vi < b.nv ? __ldg(b.body + vi) : make_uint4(0u, 0u, 0u, 0u);
    }
    iteration(v, base);
  }
}

// Calls fn(index, raw_bits, valid) for every entry of x[0:n]: the body's
// entries through ForEachIteration, then block 0 the head and the tail.
//
// Every thread of every block makes the same number of fn calls within its
// warp (loop bounds are block-uniform, `valid` marks entries past the end), so
// fn may use full-warp ballots and shuffles.
template <typename T, typename Fn>
__device__ __forceinline__ void ForEachEntry(const T* x, int64_t n, Fn& fn) {
  using Bits = typename Traits<T>::Bits;
  constexpr int V = Traits<T>::kVec;
  const VectorBody b = BodyOf(x, n);
  auto entries = [&](const uint4 (&v)[kUnroll], int64_t base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      const bool valid = vi < b.nv;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        fn(b.head + vi * V + j, VecEntry<Bits>(v[u], j), valid);
      }
    }
  };
  ForEachIteration(b, entries);
  if (blockIdx.x == 0) {
    // head < V and tail < V, so fewer than 2V <= 16 entries: one per thread.
    const int64_t tail_start = b.head + b.nv * V;
    const int64_t t = threadIdx.x;
    const bool valid = t < b.head + (n - tail_start);
    const int64_t index = t < b.head ? t : tail_start + (t - b.head);
    const Bits* xb = reinterpret_cast<const Bits*>(x);
    fn(valid ? index : 0, valid ? xb[index] : static_cast<Bits>(0), valid);
  }
}

// Calls fn(index, raw_bits, valid) for the first `count` candidates, with the
// same warp-uniform call pattern as ForEachEntry.
template <typename T, typename Fn>
__device__ __forceinline__ void ForEachCandidate(const Candidate* candidates,
                                                 long long count, Fn& fn) {
  using Bits = typename Traits<T>::Bits;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long base = static_cast<long long>(blockIdx.x) * blockDim.x;
       base < count; base += stride) {
    const long long i = base + threadIdx.x;
    const bool valid = i < count;
    const Candidate c = valid ? candidates[i] : Candidate{0u, 0};
    fn(static_cast<int64_t>(c.index), static_cast<Bits>(c.raw), valid);
  }
}

// The candidates the first pass kept (all of them unless the list overflowed,
// in which case nothing reads them).
__device__ __forceinline__ long long CandidatesKept(const State& st,
                                                    long long capacity) {
  const long long found = static_cast<long long>(st.candidate_count);
  return found < capacity ? found : capacity;
}

// One class's warp-aggregated slot claim: every lane with `mine` set gets a
// distinct counter value, in lane order after the warp's first (*first_out).
__device__ __forceinline__ unsigned long long ClaimSlots(
    unsigned long long* counter, unsigned mask, bool mine, unsigned lane,
    unsigned long long* first_out) {
  const int leader = __ffs(mask) - 1;
  unsigned long long first = 0;
  if (lane == static_cast<unsigned>(leader)) {
    first = atomicAdd(counter, static_cast<unsigned long long>(__popc(mask)));
  }
  first = __shfl_sync(0xffffffffu, first, leader);
  *first_out = first;
  return first + __popc(mask & ((1u << lane) - 1u));
}

// Sums a per-thread double and count over the block (every thread calls it;
// the result is valid in thread 0). kBlock threads, whole warps.
template <int kBlock>
__device__ void BlockSumMoments(double* sum, double* sum_squares,
                                unsigned long long* count) {
  __shared__ double swarp_sum[kBlock / 32];
  __shared__ double swarp_sq[kBlock / 32];
  __shared__ unsigned long long swarp_count[kBlock / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    *sum += __shfl_down_sync(0xffffffffu, *sum, offset);
    *sum_squares += __shfl_down_sync(0xffffffffu, *sum_squares, offset);
    *count += __shfl_down_sync(0xffffffffu, *count, offset);
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    swarp_sum[warp] = *sum;
    swarp_sq[warp] = *sum_squares;
    swarp_count[warp] = *count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double bsum = 0.0, bsq = 0.0;
    unsigned long long bcount = 0;
    for (int w = 0; w < kBlock / 32; ++w) {
      bsum += swarp_sum[w];
      bsq += swarp_sq[w];
      bcount += swarp_count[w];
    }
    *sum = bsum;
    *sum_squares = bsq;
    *count = bcount;
  }
}

// ---------------------------------------------------------------------------
// Crossing search (used by the sample and plan kernels).

// Walking the histogram from the top bin down, the bin where the running count
// reaches `want`: *bin (or -1 when the total is below it), *above = the count
// in the bins above it, *total = the count in all bins. Must be called by
// every thread of a block of kBlock threads; the results are valid in every
// thread, and every read of `hist` is done when it returns.
//
// Thread t owns kBins / kBlock consecutive bins counted from the top, so an
// inclusive scan over threads gives each thread the count above its bins.
// Exactly one bin has running < want <= running + hist[bin]: running only
// grows.
template <int kBins, int kBlock = kPlanThreads>
__device__ void FindCrossing(const uint32_t* hist, long long want, int* bin,
                             long long* above, long long* total) {
  constexpr int kPer = kBins / kBlock;
  __shared__ unsigned long long scan[kBlock];
  __shared__ int s_bin;
  __shared__ long long s_above;
  const int t = threadIdx.x;
  const unsigned long long wanted = static_cast<unsigned long long>(want);
  if (t == 0) {
    s_bin = -1;
    s_above = 0;
  }
  unsigned long long local = 0;
  for (int j = 0; j < kPer; ++j) local += hist[kBins - 1 - (t * kPer + j)];
  scan[t] = local;
  __syncthreads();
  // Hillis-Steele inclusive scan: log2(kBlock) steps.
  for (int offset = 1; offset < kBlock; offset <<= 1) {
    const unsigned long long add = t >= offset ? scan[t - offset] : 0ull;
    __syncthreads();
    scan[t] += add;
    __syncthreads();
  }
  unsigned long long running = scan[t] - local;  // count above my bins
  for (int j = 0; j < kPer; ++j) {
    const int b = kBins - 1 - (t * kPer + j);
    const unsigned long long h = hist[b];
    if (want > 0 && running < wanted && running + h >= wanted) {
      s_bin = b;
      s_above = static_cast<long long>(running);
    }
    running += h;
  }
  __syncthreads();
  *bin = s_bin;
  *above = s_above;
  *total = static_cast<long long>(scan[kBlock - 1]);
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_PRIMITIVES_CUH_
