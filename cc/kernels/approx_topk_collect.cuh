// Stage 2 of the one-pass path, the collection (part of approx_topk.cuh,
// which is what to include): the only pass over x when the prefilter works.
// It keeps the candidates in a list that every later kernel reads instead
// of x, and makes their level-1 histogram on the way.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_COLLECT_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_COLLECT_CUH_

#include <cstdint>

#include "approx_topk_primitives.cuh"
#include "approx_topk_scratch.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

// The prefilter's pass over x: the candidates (qualifying entries at or above
// the sample's threshold) go to the candidate list and their bins into hist1.
// Without a threshold (the sample found too few qualifying entries) it does
// nothing, and the plan kernel sends the work to the fallback kernels.
//
// A large part of the input can pass the threshold (several k), so claiming
// list slots per ballot would queue hundreds of thousands of atomics on one
// counter. Instead each thread tests its entries of an iteration at once, a
// warp scan places them in the warp's shared buffer, and a warp claims list
// slots only when its buffer is full (one atomic per kWarpBuffer
// candidates). An iteration with more candidates than a buffer holds goes
// straight to the list.
template <typename T>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm(kCollectBlocksPerSm))
    CollectKernel(const T* __restrict__ x, int64_t n, Scratch* s,
                  Candidate* __restrict__ candidates, long long capacity) {
  using Bits = typename Traits<T>::Bits;
  constexpr int V = Traits<T>::kVec;
  constexpr int kPerThread = kUnroll * V;  // entries a thread tests at once
  static_assert(kPerThread <= 32, "a thread's entries fit a 32-bit mask");
  __shared__ uint32_t shist[kNumBins];
  __shared__ Candidate buffers[kThreads / 32][kWarpBuffer];
  State& st = s->state;
  const uint32_t key = st.prefilter_key;
  if (key == 0u) return;  // block-uniform, before any barrier
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) shist[i] = 0u;
  __syncthreads();
  const unsigned lane = threadIdx.x & 31u;
  Candidate* buffer = buffers[threadIdx.x >> 5];
  const unsigned long long cap = static_cast<unsigned long long>(capacity);
  int buffered = 0;   // warp-uniform: candidates in the warp's buffer
  bool full = false;  // warp-uniform: the list overflowed; stop collecting

  // Claims `count` list slots for the warp (count > 0, warp-uniform).
  auto claim = [&](int count) {
    unsigned long long first = 0;
    if (lane == 0) first = atomicAdd(&st.candidate_count, static_cast<unsigned long long>(count));
    first = __shfl_sync(0xffffffffu, first, 0);
    if (first + count > cap) full = true;
    return first;
  };
  auto flush = [&]() {
    if (buffered == 0) return;
    __syncwarp();
    const unsigned long long first = claim(buffered);
    for (int i = static_cast<int>(lane); i < buffered; i += 32) {
      if (first + i < cap) candidates[first + i] = buffer[i];
    }
    __syncwarp();
    buffered = 0;
  };
  // One iteration: entry u * V + j of the thread is entry j of v[u], at
  // index first[u] + j, when that bit of `valid` is set.
  auto add = [&](const uint4* v, const int64_t* first_index, uint32_t valid) {
    uint32_t mine = 0u;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const Bits raw = VecEntry<Bits>(v[j / V], j % V);
      const uint32_t bits = MagnitudeBits(Traits<T>::ToFloat(raw));
      if (((valid >> j) & 1u) && Qualifies(bits) && bits >= key) mine |= 1u << j;
    }
    if (full) mine = 0u;
    const int count = __popc(mine);
    int inclusive = count;  // warp inclusive scan of the counts
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= static_cast<unsigned>(offset)) inclusive += up;
    }
    const int total = __shfl_sync(0xffffffffu, inclusive, 31);
    if (total == 0) return;
    if (buffered + total > kWarpBuffer) flush();
    const bool direct = total > kWarpBuffer;
    unsigned long long first = 0;
    if (direct) first = claim(total);
    int position = inclusive - count;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if ((mine >> j) & 1u) {
        const Bits raw = VecEntry<Bits>(v[j / V], j % V);
        atomicAdd(&shist[BinOf(MagnitudeBits(Traits<T>::ToFloat(raw)))], 1u);
        const Candidate c{static_cast<uint32_t>(raw),
                          static_cast<int32_t>(first_index[j / V] + j % V)};
        if (!direct) {
          buffer[buffered + position] = c;
        } else if (first + position < cap) {
          candidates[first + position] = c;
        }
        ++position;
      }
    }
    if (!direct) buffered += total;
  };

  const Bits* xb = reinterpret_cast<const Bits*>(x);
  const VectorBody body = BodyOf(x, n);
  auto iteration = [&](const uint4 (&v)[kUnroll], int64_t base) {
    int64_t first_index[kUnroll];
    uint32_t valid = 0u;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      first_index[u] = body.head + vi * V;
      if (vi < body.nv) valid |= ((1u << V) - 1u) << (u * V);
    }
    add(v, first_index, valid);
  };
  ForEachIteration(body, iteration);
  if (blockIdx.x == 0) {
    // head < V and tail < V, so fewer than 2V <= 16 entries: one per thread.
    const int64_t tail_start = body.head + body.nv * V;
    const int64_t t = threadIdx.x;
    const bool in_range = t < body.head + (n - tail_start);
    uint4 v[kUnroll] = {};
    int64_t first_index[kUnroll] = {};
    if (in_range) {  // entry 0 of v[0]: the low bits of its first word
      first_index[0] = t < body.head ? t : tail_start + (t - body.head);
      v[0].x = static_cast<uint32_t>(xb[first_index[0]]);
    }
    add(v, first_index, in_range ? 1u : 0u);
  }
  flush();
  __syncthreads();
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) {
    if (shist[i] != 0u) atomicAdd(&s->hist1[i], shist[i]);
  }
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_COLLECT_CUH_
