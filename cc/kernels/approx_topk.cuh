// CUDA kernels of the top-k selection op. No TensorFlow include: the TF glue
// (approx_topk_op_gpu.cu.cc) and the standalone harness (benchmarks/gpu/)
// both compile this header, so the code tested against torch.topk on a GPU
// machine is the code TensorFlow runs.
//
// Entry points (namespace tf_topk::cuda):
//   ScratchBytes(k)       bytes of device scratch LaunchApproxTopK needs.
//   LaunchApproxTopK<T>() zeroes scratch and outputs, then enqueues every
//                         kernel on `stream`. Nothing is read back to the host
//                         and nothing synchronises: each kernel takes its
//                         parameters (plan, prefix, done flag) from scratch,
//                         written by the kernel before it on the same stream.
//
// Passes over x (all grid-stride, 16-byte vector loads):
//   gaussian: [histogram + moments] -> plan -> [compaction]          2 passes
//   exact:    [histogram 30:20] -> plan -> [histogram 19:9] -> plan
//             -> [histogram 8:0] -> plan -> [compaction]             4 passes
// then [finish], over the output slots only: the gaussian fill copies, from
// a list the compaction kept, entries of the threshold bin below the normal
// fit's threshold into the slots the entries above it left empty (k slots
// are filled whenever k entries qualify), and spare slots get zeros.
//
// The plan arithmetic (crossing, exact radix levels, normal fit, entry
// classes, fill count) is in topk_common.h, shared with the CPU kernel and
// the CPU emulation of this algorithm that the tests run without a GPU.
//
// Not deterministic: slots come from atomic counters, so the output order,
// and which of several equal-priority tied entries fill the last slots,
// vary from run to run (the set above the threshold bin does not). The TF
// op refuses to run on the GPU under op determinism.
// The exact method's levels 2 and 3 only count entries inside the bin found
// so far; their shared-memory atomics are rare, so those passes run at the
// speed of the loads.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_CUH_

#include <cuda_runtime.h>  // before topk_common.h: erfc/sqrt resolve on device
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "topk_common.h"

namespace tf_topk {
namespace cuda {

// ---------------------------------------------------------------------------
// Constants (plain constexpr ints: device code cannot read host arrays).

constexpr int kThreads = 256;       // threads per block of the streaming kernels
// Resident blocks per SM, enforced by __launch_bounds__ (register cap) so the
// grid (SMs x this) runs in one wave: the grid-stride loops split the work
// evenly, so a block that had to wait for a slot would double the time.
constexpr int kHistBlocksPerSm = 8;     // 2048 threads, <= 32 regs, 8 KiB smem
constexpr int kCompactBlocksPerSm = 6;  // 1536 threads, <= 40 regs (32 spills)
constexpr int kUnroll = 4;          // 16-byte loads in flight per thread
constexpr int kPlanThreads = 256;   // the single-block plan kernels

static_assert(kNumBins % kPlanThreads == 0, "plan threads must divide bins");
static_assert(kL2Bins % kPlanThreads == 0, "plan threads must divide bins");
static_assert(kL3Bins % kPlanThreads == 0, "plan threads must divide bins");
static_assert(kThreads % 32 == 0, "whole warps only: the loops use ballots");
static_assert(kThreads >= 32, "head + tail entries are handled by one block");

// ---------------------------------------------------------------------------
// Device scratch. Zeroed by cudaMemsetAsync at the start of every launch, so
// a reused buffer starts clean (counters, histograms, moments, done flag).

struct State {
  // Moments of the qualifying entries (gaussian only).
  double sum;
  double sum_squares;
  unsigned long long count;
  // Output slot counters of the compaction pass.
  unsigned long long sure_counter;  // entries with bits > sure_above
  unsigned long long tie_counter;   // entries with bits in [tie_low, sure_above]
  unsigned long long fill_counter;  // entries with bits in [bin_low, tie_low)
  // The plan the compaction pass reads.
  long long above;  // entries with bits > sure_above (< k)
  long long need;   // tie slots: k - above (0 when fewer than k qualify)
  uint32_t sure_above;
  uint32_t tie_low;
  uint32_t bin_low;
  // Exact radix select between its levels.
  ExactState exact;
  // Invariant violations seen on the device (0: none). Never expected; the
  // harness reads it after its correctness runs.
  int error;
};

struct Scratch {
  uint32_t hist1[kNumBins];  // bits [30:20] (BinOf)
  uint32_t hist2[kL2Bins];   // bits [19:9] inside the level-1 bin
  uint32_t hist3[kL3Bins];   // bits [8:0] inside the level-2 bin
  State state;
};

// Error codes stored in State::error.
constexpr int kErrorLevelNotFound = 1;   // exact: a deeper level lost the rank
constexpr int kErrorSlotOverflow = 2;    // compaction: a sure slot >= k
constexpr int kErrorPlanMismatch = 3;    // debug: parallel plan != serial plan

// The Scratch struct, then the fill list: the indices of up to k entries of
// the threshold bin below the gaussian threshold.
inline size_t ScratchHeaderBytes() {
  return (sizeof(Scratch) + 255) / 256 * 256;
}

inline size_t ScratchBytes(int64_t k) {
  return ScratchHeaderBytes() + static_cast<size_t>(k > 0 ? k : 0) * sizeof(int32_t);
}

inline int32_t* FillList(void* scratch) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(scratch) +
                                    ScratchHeaderBytes());
}

// ---------------------------------------------------------------------------
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

// Calls fn(index, raw_bits, valid) for every entry of x[0:n]. The body is read
// with 16-byte loads from the first aligned address; the head (entries before
// it) and the tail (fewer than one vector at the end) are handled by block 0.
//
// Every thread of every block makes the same number of fn calls within its
// warp (loop bounds are block-uniform, `valid` marks entries past the end), so
// fn may use full-warp ballots and shuffles.
template <typename T, typename Fn>
__device__ __forceinline__ void ForEachEntry(const T* x, int64_t n, Fn& fn) {
  using Bits = typename Traits<T>::Bits;
  constexpr int V = Traits<T>::kVec;
  const Bits* xb = reinterpret_cast<const Bits*>(x);
  const int64_t head = HeadCount(x, n);
  const int64_t nv = (n - head) / V;  // whole vectors in the body
  const uint4* body = reinterpret_cast<const uint4*>(xb + head);
  const int64_t per_iter = static_cast<int64_t>(blockDim.x) * kUnroll;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_iter;
  for (int64_t base = blockIdx.x * per_iter; base < nv; base += stride) {
    uint4 v[kUnroll];
    // All loads first (memory-level parallelism), then the arithmetic.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      v[u] = vi < nv ? __ldg(body + vi) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      const bool valid = vi < nv;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        fn(head + vi * V + j, VecEntry<Bits>(v[u], j), valid);
      }
    }
  }
  if (blockIdx.x == 0) {
    // head < V and tail < V, so fewer than 2V <= 16 entries: one per thread.
    const int64_t tail_start = head + nv * V;
    const int64_t tail = n - tail_start;
    const int64_t t = threadIdx.x;
    const bool valid = t < head + tail;
    const int64_t index = t < head ? t : tail_start + (t - head);
    fn(valid ? index : 0, valid ? xb[index] : static_cast<Bits>(0), valid);
  }
}

// ---------------------------------------------------------------------------
// Histogram passes.
//
// kLevel 1: 2048 bins of bits [30:20] over all qualifying entries (+ moments).
// kLevel 2: 2048 bins of bits [19:9] over entries whose bits [30:20] equal the
//           level-1 bin (state.prefix).
// kLevel 3: 512 bins of bits [8:0] over entries whose bits [30:9] equal the
//           prefix after level 2.
// Each block counts into shared memory and flushes every non-zero bin with one
// global atomicAdd; moments are reduced per block (warp shuffles) and added
// with one atomic per block.

template <int kLevel>
struct LevelInfo;
template <>
struct LevelInfo<1> { static constexpr int kBins = kNumBins; };
template <>
struct LevelInfo<2> { static constexpr int kBins = kL2Bins; };
template <>
struct LevelInfo<3> { static constexpr int kBins = kL3Bins; };

template <int kLevel>
__device__ __forceinline__ uint32_t* LevelHist(Scratch* s) {
  return kLevel == 1 ? s->hist1 : kLevel == 2 ? s->hist2 : s->hist3;
}

template <typename T, int kLevel, bool kMoments>
__global__ void __launch_bounds__(kThreads, kHistBlocksPerSm)
    HistogramKernel(const T* __restrict__ x, int64_t n, Scratch* s) {
  using Bits = typename Traits<T>::Bits;
  constexpr int kBins = LevelInfo<kLevel>::kBins;
  __shared__ uint32_t shist[kBins];
  __shared__ double swarp_sum[kThreads / 32];
  __shared__ double swarp_sq[kThreads / 32];
  __shared__ unsigned long long swarp_count[kThreads / 32];

  // Block-uniform exit, before any barrier: the exact method already knows
  // that fewer than k entries qualify.
  if (kLevel > 1 && s->state.exact.done) return;
  const uint32_t prefix = s->state.exact.prefix;

  for (int i = threadIdx.x; i < kBins; i += blockDim.x) shist[i] = 0u;
  __syncthreads();

  double sum = 0.0, sum_squares = 0.0;
  uint32_t count = 0;
  auto fn = [&](int64_t, Bits raw, bool valid) {
    const float f = Traits<T>::ToFloat(raw);
    const uint32_t bits = MagnitudeBits(f);
    if (!valid || !Qualifies(bits) || !InExactLevel(bits, kLevel, prefix)) {
      return;
    }
    atomicAdd(&shist[ExactLevelBin(bits, kLevel)], 1u);
    if (kMoments) {
      const double d = f;
      sum += d;
      sum_squares += d * d;
      ++count;
    }
  };
  ForEachEntry(x, n, fn);
  __syncthreads();

  uint32_t* hist = LevelHist<kLevel>(s);
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    const uint32_t c = shist[i];
    if (c != 0u) atomicAdd(&hist[i], c);
  }

  if (kMoments) {
    unsigned long long wcount = count;
    for (int offset = 16; offset > 0; offset >>= 1) {
      sum += __shfl_down_sync(0xffffffffu, sum, offset);
      sum_squares += __shfl_down_sync(0xffffffffu, sum_squares, offset);
      wcount += __shfl_down_sync(0xffffffffu, wcount, offset);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
      swarp_sum[warp] = sum;
      swarp_sq[warp] = sum_squares;
      swarp_count[warp] = wcount;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double bsum = 0.0, bsq = 0.0;
      unsigned long long bcount = 0;
      for (int w = 0; w < kThreads / 32; ++w) {
        bsum += swarp_sum[w];
        bsq += swarp_sq[w];
        bcount += swarp_count[w];
      }
      if (bcount != 0) {
        atomicAdd(&s->state.sum, bsum);
        atomicAdd(&s->state.sum_squares, bsq);
        atomicAdd(&s->state.count, bcount);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Plan kernels (one block of kPlanThreads).

// Walking the histogram from the top bin down, the bin where the running count
// reaches k: *bin (or -1 when the total is below k), *above = the count in the
// bins above it, *total = the count in all bins. Must be called by every
// thread of the block; the results are valid in every thread.
//
// Thread t owns kBins / kPlanThreads consecutive bins counted from the top, so
// an inclusive scan over threads gives each thread the count above its bins.
// Exactly one bin has running < k <= running + hist[bin]: running only grows.
template <int kBins>
__device__ void FindCrossing(const uint32_t* hist, long long k, int* bin,
                             long long* above, long long* total) {
  constexpr int kPer = kBins / kPlanThreads;
  __shared__ unsigned long long scan[kPlanThreads];
  __shared__ int s_bin;
  __shared__ long long s_above;
  const int t = threadIdx.x;
  const unsigned long long kk = static_cast<unsigned long long>(k);
  if (t == 0) {
    s_bin = -1;
    s_above = 0;
  }
  unsigned long long local = 0;
  for (int j = 0; j < kPer; ++j) local += hist[kBins - 1 - (t * kPer + j)];
  scan[t] = local;
  __syncthreads();
  // Hillis-Steele inclusive scan: log2(256) = 8 steps.
  for (int offset = 1; offset < kPlanThreads; offset <<= 1) {
    const unsigned long long add = t >= offset ? scan[t - offset] : 0ull;
    __syncthreads();
    scan[t] += add;
    __syncthreads();
  }
  unsigned long long running = scan[t] - local;  // count above my bins
  for (int j = 0; j < kPer; ++j) {
    const int b = kBins - 1 - (t * kPer + j);
    const unsigned long long h = hist[b];
    if (running < kk && running + h >= kk) {
      s_bin = b;
      s_above = static_cast<long long>(running);
    }
    running += h;
  }
  __syncthreads();
  *bin = s_bin;
  *above = s_above;
  *total = static_cast<long long>(scan[kPlanThreads - 1]);
}

__device__ inline void StorePlan(const Plan& plan, State* st) {
  st->sure_above = plan.sure_above;
  st->tie_low = plan.tie_low;
  st->bin_low = plan.bin_low;
  st->above = plan.above;
  st->need = plan.need;
}

#if defined(TF_TOPK_DEBUG_CHECKS)
// Debug builds: the parallel crossing must equal the serial one.
template <int kBins>
__device__ void CheckCrossing(const uint32_t* hist, long long want, int bin,
                              long long above, long long total, State* st) {
  long long serial_above, serial_total;
  const int serial_bin =
      FindCrossingSerial(hist, kBins, want, &serial_above, &serial_total);
  if (serial_bin != bin || serial_total != total ||
      (bin >= 0 && serial_above != above)) {
    st->error = kErrorPlanMismatch;
  }
}
#endif

// The smallest bits b in [low, high] with AboveGaussianThreshold(fit, b), as
// GaussianTieLow's bisection finds it, searched 256 ways per round (one
// candidate per thread): 2^20 candidates in 3 rounds instead of 20
// sequential steps, each of two double-precision erfc. Called by every
// thread of the block; the result is valid in every thread.
__device__ uint32_t SearchGaussianThreshold(const GaussianFit& fit,
                                            uint32_t low, uint32_t high) {
  __shared__ int s_first;  // the first thread whose candidate satisfies
  while (low < high) {     // block-uniform: every thread holds low and high
    const uint32_t step = (high - low + kPlanThreads - 1) / kPlanThreads;
    const uint32_t mine = low + threadIdx.x * step;  // candidate of this thread
    // Candidates at or past `high` count as satisfying: high always does.
    const bool above = mine >= high || AboveGaussianThreshold(fit, mine);
    if (threadIdx.x == 0) s_first = kPlanThreads;
    __syncthreads();
    if (above) atomicMin(&s_first, static_cast<int>(threadIdx.x));
    __syncthreads();
    const int first = s_first;
    __syncthreads();  // s_first is rewritten by the next round
    if (first == 0) {
      high = low;
    } else {
      const uint32_t hit = low + first * step;  // satisfies (or is >= high)
      low = low + (first - 1) * step + 1u;      // the one before did not
      if (hit < high) high = hit;
    }
  }
  return low;
}

// Gaussian plan: the threshold bin from the histogram, then the tie threshold
// from the normal fit (FitGaussian, shared with the CPU kernel).
template <int kUnused = 0>
__global__ void __launch_bounds__(kPlanThreads)
    PlanGaussianKernel(Scratch* s, long long k) {
  int bin;
  long long above, total;
  FindCrossing<kNumBins>(s->hist1, k, &bin, &above, &total);
  State& st = s->state;
  Plan plan = bin >= 0 ? PlanForBin(bin, above, k) : SelectAllPlan(total);
  Moments moments;
  moments.sum = st.sum;
  moments.sum_squares = st.sum_squares;
  moments.count = static_cast<long long>(st.count);
  const GaussianFit fit = FitGaussian(plan, s->hist1, moments);
  if (fit.refine) {  // block-uniform: every thread computed the same fit
    plan.tie_low = SearchGaussianThreshold(fit, plan.tie_low, plan.sure_above);
  }
  if (threadIdx.x != 0) return;
#if defined(TF_TOPK_DEBUG_CHECKS)
  CheckCrossing<kNumBins>(s->hist1, k, bin, above, total, &st);
  if (plan.tie_low != GaussianTieLow(plan.bin >= 0 ? PlanForBin(bin, above, k)
                                                   : SelectAllPlan(total),
                                     s->hist1, moments)) {
    st.error = kErrorPlanMismatch;
  }
#endif
  StorePlan(plan, &st);
}

// Exact plan after histogram level kLevel (ExactLevelStep, topk_common.h):
// level 1 finds the bin of the k-th largest (or that fewer than k qualify),
// levels 2 and 3 refine the prefix inside it; level 3 leaves the exact bits T
// of the k-th largest and the plan sure_above = tie_low = T.
template <int kLevel>
__global__ void __launch_bounds__(kPlanThreads)
    PlanExactKernel(Scratch* s, long long k) {
  State& st = s->state;
  if (kLevel > 1 && st.exact.done) return;  // block-uniform, before any barrier
  const long long want = kLevel == 1 ? k : st.exact.k_rem;
  int bin;
  long long above, total;
  FindCrossing<LevelInfo<kLevel>::kBins>(LevelHist<kLevel>(s), want, &bin,
                                         &above, &total);
  if (threadIdx.x != 0) return;
#if defined(TF_TOPK_DEBUG_CHECKS)
  CheckCrossing<LevelInfo<kLevel>::kBins>(LevelHist<kLevel>(s), want, bin,
                                          above, total, &st);
#endif
  Plan plan;
  if (ExactLevelStep(kLevel, bin, above, total, k, &st.exact, &plan)) {
    StorePlan(plan, &st);
    if (st.exact.error != 0) st.error = kErrorLevelNotFound;
  }
}

// ---------------------------------------------------------------------------
// Compaction: one pass writing the selected entries (Classify, topk_common.h).
//   sure  bits > sure_above             -> slot sure_counter++ (< k of them)
//   tie   bits in [tie_low, sure_above] -> c = tie_counter++, slot above + c
//                                          while c < need
//   fill  bits in [bin_low, tie_low)    -> c = fill_counter++, fill list[c]
//                                          while c < need (gaussian only;
//                                          FinishKernel places them)
// Slots come from warp-aggregated atomics (one atomicAdd per warp and class).
// Most warps see no candidate at all and skip with a single ballot.

// One class's warp-aggregated slot claim: every lane with `mine` set gets a
// distinct counter value, in lane order after the warp's first.
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

template <typename T>
__global__ void __launch_bounds__(kThreads, kCompactBlocksPerSm)
    CompactKernel(const T* __restrict__ x, int64_t n, long long k, Scratch* s,
                  int32_t* __restrict__ fill_list,
                  typename Traits<T>::Bits* __restrict__ values,
                  int32_t* __restrict__ indices) {
  using Bits = typename Traits<T>::Bits;
  State& st = s->state;
  const uint32_t sure_above = st.sure_above;
  const uint32_t tie_low = st.tie_low;
  const uint32_t bin_low = st.bin_low;
  const long long above = st.above;
  const unsigned long long need =
      st.need > 0 ? static_cast<unsigned long long>(st.need) : 0ull;
  const unsigned lane = threadIdx.x & 31u;
  // Warp-uniform: set once a counter passed `need`; later entries of that
  // class in this warp would get c >= need anyway, so skip their atomics.
  bool ties_full = need == 0;
  bool fills_full = need == 0 || bin_low >= tie_low;

  auto fn = [&](int64_t index, Bits raw, bool valid) {
    const uint32_t bits = MagnitudeBits(Traits<T>::ToFloat(raw));
    const EntryClass c = valid ? Classify(bits, sure_above, tie_low, bin_low)
                               : EntryClass::kSkip;
    const bool sure = c == EntryClass::kSure;
    const bool tie = c == EntryClass::kTie && !ties_full;
    const bool fill = c == EntryClass::kFill && !fills_full;
    if (__ballot_sync(0xffffffffu, sure || tie || fill) == 0u) return;

    unsigned long long first;
    const unsigned sure_mask = __ballot_sync(0xffffffffu, sure);
    if (sure_mask != 0u) {
      const unsigned long long slot =
          ClaimSlots(&st.sure_counter, sure_mask, sure, lane, &first);
      if (sure) {
        if (slot < static_cast<unsigned long long>(k)) {
          values[slot] = raw;
          indices[slot] = static_cast<int32_t>(index);
        } else {
          st.error = kErrorSlotOverflow;
        }
      }
    }
    const unsigned tie_mask = __ballot_sync(0xffffffffu, tie);
    if (tie_mask != 0u) {
      const unsigned long long t =
          ClaimSlots(&st.tie_counter, tie_mask, tie, lane, &first);
      if (tie && t < need) {
        const unsigned long long slot = static_cast<unsigned long long>(above) + t;
        if (slot < static_cast<unsigned long long>(k)) {
          values[slot] = raw;
          indices[slot] = static_cast<int32_t>(index);
        } else {
          st.error = kErrorSlotOverflow;
        }
      }
      if (first + __popc(tie_mask) >= need) ties_full = true;
    }
    const unsigned fill_mask = __ballot_sync(0xffffffffu, fill);
    if (fill_mask != 0u) {
      const unsigned long long f =
          ClaimSlots(&st.fill_counter, fill_mask, fill, lane, &first);
      if (fill && f < need) fill_list[f] = static_cast<int32_t>(index);
      if (first + __popc(fill_mask) >= need) fills_full = true;
    }
  };
  ForEachEntry(x, n, fn);
}

// After the compaction: the slots the tie range left empty,
// [above + ties taken, k), take entries from the fill list in order (gaussian
// only: the exact method's tie range always fills its `need` slots), and the
// slots after those (fewer than k qualify) get value 0 and index 0.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FinishKernel(const T* __restrict__ x, long long k, const Scratch* s,
                 const int32_t* __restrict__ fill_list,
                 typename Traits<T>::Bits* __restrict__ values,
                 int32_t* __restrict__ indices) {
  using Bits = typename Traits<T>::Bits;
  const State& st = s->state;
  const long long need = st.need > 0 ? st.need : 0;
  const long long fills = FillCount(need, st.tie_counter, st.fill_counter);
  const long long first_fill = st.above + TiesTaken(need, st.tie_counter);
  const long long first_spare = first_fill + fills;
  const Bits* xb = reinterpret_cast<const Bits*>(x);
  for (long long slot = first_fill + blockIdx.x * static_cast<long long>(blockDim.x) +
                        threadIdx.x;
       slot < k; slot += static_cast<long long>(gridDim.x) * blockDim.x) {
    if (slot < first_spare) {
      const int32_t index = fill_list[slot - first_fill];
      values[slot] = xb[index];
      indices[slot] = index;
    } else {
      values[slot] = static_cast<Bits>(0);
      indices[slot] = 0;
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.

// Blocks for a streaming pass: enough to fill every SM (blocks_per_sm each),
// fewer when the input is small (each block then does one iteration).
inline int StreamingBlocks(int64_t n, int vec, int blocks_per_sm) {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      sms <= 0) {
    sms = 132;  // H100 SXM; only the speed depends on it
  }
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll * vec;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sms) * blocks_per_sm;
  int64_t blocks = wanted < cap ? wanted : cap;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks);
}

// Selects k entries of x[0:n] (see the op's documentation): writes values[0:k]
// and indices[0:k]; spare slots hold 0. Everything is enqueued on `stream`;
// `scratch` (ScratchBytes(k) bytes of device memory, 8-byte aligned) must not
// be used by anything else until the stream has passed this work. Returns the
// first error seen while enqueuing.
template <typename T>
cudaError_t LaunchApproxTopK(const T* x, int64_t n, int64_t k, Method method,
                             T* values, int32_t* indices, void* scratch,
                             cudaStream_t stream) {
  if (x == nullptr || values == nullptr || indices == nullptr ||
      scratch == nullptr || n < 1 || n > 0x7fffffffLL || k < 1 || k > n ||
      (reinterpret_cast<uintptr_t>(scratch) & 7u) != 0u ||
      (reinterpret_cast<uintptr_t>(x) & (sizeof(T) - 1)) != 0u) {
    return cudaErrorInvalidValue;
  }
  // Clear a stale error left by an earlier failed call of this runtime (this
  // library's own: cudart is linked statically), so the result below is ours.
  (void)cudaGetLastError();
  // Neither the fill list nor the outputs need clearing: FinishKernel reads
  // only fill entries that were written and writes every slot the compaction
  // left.
  const cudaError_t err =
      cudaMemsetAsync(scratch, 0, ScratchHeaderBytes(), stream);
  if (err != cudaSuccess) return err;

  Scratch* s = static_cast<Scratch*>(scratch);
  const int blocks = StreamingBlocks(n, Traits<T>::kVec, kHistBlocksPerSm);
  const int compact_blocks =
      StreamingBlocks(n, Traits<T>::kVec, kCompactBlocksPerSm);
  const long long kk = static_cast<long long>(k);
  if (method == Method::kGaussian) {
    HistogramKernel<T, 1, true><<<blocks, kThreads, 0, stream>>>(x, n, s);
    PlanGaussianKernel<<<1, kPlanThreads, 0, stream>>>(s, kk);
  } else {
    // Launched unconditionally: levels 2 and 3 check state.done themselves.
    HistogramKernel<T, 1, false><<<blocks, kThreads, 0, stream>>>(x, n, s);
    PlanExactKernel<1><<<1, kPlanThreads, 0, stream>>>(s, kk);
    HistogramKernel<T, 2, false><<<blocks, kThreads, 0, stream>>>(x, n, s);
    PlanExactKernel<2><<<1, kPlanThreads, 0, stream>>>(s, kk);
    HistogramKernel<T, 3, false><<<blocks, kThreads, 0, stream>>>(x, n, s);
    PlanExactKernel<3><<<1, kPlanThreads, 0, stream>>>(s, kk);
  }
  using Bits = typename Traits<T>::Bits;
  int32_t* fill_list = FillList(scratch);
  CompactKernel<T><<<compact_blocks, kThreads, 0, stream>>>(
      x, n, kk, s, fill_list, reinterpret_cast<Bits*>(values), indices);
  // At most k slots to finish, usually none or a few: a small grid.
  const int64_t wanted = (k + kThreads - 1) / kThreads;
  const int finish_blocks = static_cast<int>(wanted < 256 ? wanted : 256);
  FinishKernel<T><<<finish_blocks, kThreads, 0, stream>>>(
      x, kk, s, fill_list, reinterpret_cast<Bits*>(values), indices);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_CUH_
