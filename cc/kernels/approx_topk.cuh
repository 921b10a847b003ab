// CUDA kernels of the top-k selection op. No TensorFlow include: the TF glue
// (approx_topk_op_gpu.cu.cc) and the standalone harness (benchmarks/gpu/)
// both compile this header, so the code tested against torch.topk on a GPU
// machine is the code TensorFlow runs.
//
// Entry points (namespace tf_topk::cuda):
//   ScratchBytes(n, k)    bytes of device scratch LaunchApproxTopK needs.
//   LaunchApproxTopK<T>() zeroes the scratch's counters, then enqueues every
//                         kernel on `stream`. Nothing is read back to the host
//                         and nothing synchronises: each kernel takes its
//                         parameters (plan, prefix, flags) from scratch,
//                         written by the kernels before it on the same stream.
//
// One pass over x when the sampled prefilter works (inputs of at least
// kMinPrefilterSize entries, k at most about 1/16 of them; topk_common.h):
//   [sample] -> [pass: candidates at or above the sample's threshold, their
//   histogram] -> plan -> {exact: [histogram 19:9] -> plan -> [histogram 8:0]
//   -> plan, over the candidates} -> [compaction of the candidates]
// Otherwise, or when the candidates turn out too few or too many (the
// fallback kernels run, and do nothing when not needed):
//   gaussian: [histogram + moments] -> plan -> [compaction]          2 passes
//   exact:    [histogram 30:20] -> plan -> [histogram 19:9] -> plan
//             -> [histogram 8:0] -> plan -> [compaction]             4 passes
// then [finish], over the output slots only: the gaussian fill copies, from
// a list the compaction kept, entries of the threshold bin below the normal
// fit's threshold into the slots the entries above it left empty (k slots
// are filled whenever k entries qualify), and spare slots get zeros. All
// passes over x are grid-stride with 16-byte vector loads.
//
// The plan arithmetic (sample, crossing, exact radix levels, normal fit,
// entry classes, fill count) is in topk_common.h, shared with the CPU kernel
// and with the CPU emulation of this algorithm that the tests run without a
// GPU (cc/emulation/gpu_emulation.cc).
//
// Not deterministic: slots come from atomic counters, so the output order,
// and which of several equal-priority tied entries fill the last slots,
// vary from run to run (the set above the threshold bin does not). The TF
// op refuses to run on the GPU under op determinism.
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
// Resident blocks per SM wanted, enforced by __launch_bounds__ (register cap)
// on chips with 2048 threads per SM (A100, H100); the grid is sized from the
// occupancy the kernel really has on the running GPU, so it runs in one wave:
// the grid-stride loops split the work evenly, so a block that had to wait
// for a slot would double the time.
constexpr int kHistBlocksPerSm = 8;     // 2048 threads, <= 32 regs, 8 KiB smem
constexpr int kCompactBlocksPerSm = 6;  // 1536 threads, <= 40 regs (32 spills)
constexpr int kCollectBlocksPerSm = 6;  // the prefilter's pass, as compaction

// Threads an SM holds on the architecture being compiled (device pass): 1024
// on Turing, 1536 on the GA10x/AD10x and consumer Blackwell chips, else 2048.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
constexpr int kMaxThreadsPerSm = 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || \
                                 __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
constexpr int kMaxThreadsPerSm = 1536;
#else
constexpr int kMaxThreadsPerSm = 2048;
#endif

// The __launch_bounds__ minimum of resident blocks: what is wanted, as far as
// the architecture holds it.
constexpr int MinBlocksPerSm(int wanted) {
  return wanted * kThreads <= kMaxThreadsPerSm ? wanted
                                               : kMaxThreadsPerSm / kThreads;
}
constexpr int kUnroll = 4;          // 16-byte loads in flight per thread
constexpr int kPlanThreads = 256;   // the single-block plan kernels
constexpr int kSampleThreads = 256;  // the sample kernel: one sample a thread
constexpr int kSampleBlocks = static_cast<int>(kSampleSize / kSampleThreads);
constexpr int kWarpBuffer = 128;  // candidates a warp gathers per global claim

static_assert(kNumBins % kPlanThreads == 0, "plan threads must divide bins");
static_assert(kL2Bins % kPlanThreads == 0, "plan threads must divide bins");
static_assert(kL3Bins % kPlanThreads == 0, "plan threads must divide bins");
static_assert(kNumBins % kSampleThreads == 0, "sample threads must divide bins");
static_assert(kSampleSize % kSampleThreads == 0, "whole blocks of samples");
static_assert(kThreads % 32 == 0, "whole warps only: the loops use ballots");
static_assert(kThreads >= 32, "head + tail entries are handled by one block");

// ---------------------------------------------------------------------------
// Device scratch: the Scratch struct (zeroed by cudaMemsetAsync at the start
// of every launch, so a reused buffer starts clean), then the candidate list
// (CandidateCapacity entries), then the fill list (k indices).

struct State {
  // The sampled prefilter (SampleKernel): threshold bits (0: none) and the
  // moments of the qualifying sampled entries.
  unsigned int sample_blocks_done;
  uint32_t prefilter_key;
  double sample_sum;
  double sample_sum_squares;
  unsigned long long sample_count;
  // Candidates the first pass found (more than the capacity: overflow).
  unsigned long long candidate_count;
  // 1: the plan is made and the later passes read the candidate list; 0:
  // they read all of x.
  int use_candidates;
  // 1: the prefilter failed; the fallback kernels make the plan from x.
  int fallback;
  // Moments of all qualifying entries (gaussian, histogram of all of x).
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
  uint32_t sample_hist[kNumBins];  // bits [30:20] of the sampled entries
  uint32_t hist1[kNumBins];  // bits [30:20] (BinOf)
  uint32_t hist2[kL2Bins];   // bits [19:9] inside the level-1 bin
  uint32_t hist3[kL3Bins];   // bits [8:0] inside the level-2 bin
  State state;
};

// An entry at or above the prefilter threshold: its raw bits (widened to 32)
// and its index, so later passes never go back to x.
struct Candidate {
  uint32_t raw;
  int32_t index;
};

// Error codes stored in State::error.
constexpr int kErrorLevelNotFound = 1;   // exact: a deeper level lost the rank
constexpr int kErrorSlotOverflow = 2;    // compaction: a sure slot >= k
constexpr int kErrorPlanMismatch = 3;    // debug: parallel plan != serial plan

inline size_t ScratchHeaderBytes() {
  return (sizeof(Scratch) + 255) / 256 * 256;
}

inline size_t CandidateBytes(int64_t n, int64_t k) {
  return static_cast<size_t>(CandidateCapacity(n, k)) * sizeof(Candidate);
}

inline size_t ScratchBytes(int64_t n, int64_t k) {
  return ScratchHeaderBytes() + CandidateBytes(n, k) +
         static_cast<size_t>(k > 0 ? k : 0) * sizeof(int32_t);
}

inline Candidate* CandidateList(void* scratch) {
  return reinterpret_cast<Candidate*>(static_cast<char*>(scratch) +
                                      ScratchHeaderBytes());
}

inline int32_t* FillList(void* scratch, int64_t n, int64_t k) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(scratch) +
                                    ScratchHeaderBytes() + CandidateBytes(n, k));
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

// ---------------------------------------------------------------------------
// The sample: kSampleBlocks blocks read one sampled entry (SampleIndex) per
// thread, so the scattered reads spread over many SMs, and add their bins and
// moments to the scratch; the last block to finish places the prefilter
// threshold at the lower edge of the bin of the sampled magnitude of rank
// PrefilterRank (none when too few sampled entries qualify).

template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
    SampleKernel(const T* __restrict__ x, int64_t n, long long k, Scratch* s) {
  using Bits = typename Traits<T>::Bits;
  __shared__ uint32_t shist[kNumBins];
  __shared__ bool s_last;
  State& st = s->state;
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) shist[i] = 0u;
  __syncthreads();
  const long long sample =
      static_cast<long long>(blockIdx.x) * kSampleThreads + threadIdx.x;
  const Bits raw = reinterpret_cast<const Bits*>(x)[SampleIndex(sample, n)];
  const float f = Traits<T>::ToFloat(raw);
  const uint32_t bits = MagnitudeBits(f);
  double sum = 0.0, sum_squares = 0.0;
  unsigned long long count = 0;
  if (Qualifies(bits)) {
    atomicAdd(&shist[BinOf(bits)], 1u);
    sum = f;
    sum_squares = static_cast<double>(f) * f;
    count = 1;
  }
  BlockSumMoments<kSampleThreads>(&sum, &sum_squares, &count);
  __syncthreads();
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) {
    if (shist[i] != 0u) atomicAdd(&s->sample_hist[i], shist[i]);
  }
  if (threadIdx.x == 0 && count != 0) {
    atomicAdd(&st.sample_sum, sum);
    atomicAdd(&st.sample_sum_squares, sum_squares);
    atomicAdd(&st.sample_count, count);
  }
  // The last block sees every block's additions (fence, then count).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(&st.sample_blocks_done, 1u) == gridDim.x - 1u;
  }
  __syncthreads();
  if (!s_last) return;  // block-uniform
  __threadfence();
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) {
    shist[i] = __ldcg(&s->sample_hist[i]);  // from L2: other blocks' atomics
  }
  __syncthreads();
  int bin;
  long long above, total;
  const long long rank = PrefilterRank(n, k);  // >= 0: the launcher checked
  FindCrossing<kNumBins, kSampleThreads>(shist, rank + 1, &bin, &above, &total);
  if (threadIdx.x != 0) return;
  const uint32_t key = bin >= 0 ? static_cast<uint32_t>(bin) << kBinShift : 0u;
  st.prefilter_key = Qualifies(key) ? key : 0u;
}

// ---------------------------------------------------------------------------
// Histogram passes.
//
// kLevel 1: every qualifying entry's bin (+ moments). The fallback call
//           (kFallback) does it only when the prefilter failed.
// kLevel 2: 2048 bins of bits [19:9] over entries whose bits [30:20] equal the
//           level-1 bin (state.exact.prefix); the candidates or all of x.
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
  const int64_t head = HeadCount(x, n);
  const int64_t nv = (n - head) / V;  // whole vectors in the body
  const uint4* body = reinterpret_cast<const uint4*>(xb + head);
  const int64_t per_iter = static_cast<int64_t>(blockDim.x) * kUnroll;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * per_iter;
  for (int64_t base = blockIdx.x * per_iter; base < nv; base += stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      v[u] = vi < nv ? __ldg(body + vi) : make_uint4(0u, 0u, 0u, 0u);
    }
    int64_t first_index[kUnroll];
    uint32_t valid = 0u;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vi = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      first_index[u] = head + vi * V;
      if (vi < nv) valid |= ((1u << V) - 1u) << (u * V);
    }
    add(v, first_index, valid);
  }
  if (blockIdx.x == 0) {
    // head < V and tail < V, so fewer than 2V <= 16 entries: one per thread.
    const int64_t tail_start = head + nv * V;
    const int64_t t = threadIdx.x;
    const bool in_range = t < head + (n - tail_start);
    uint4 v[kUnroll] = {};
    int64_t first_index[kUnroll] = {};
    if (in_range) {  // entry 0 of v[0]: the low bits of its first word
      first_index[0] = t < head ? t : tail_start + (t - head);
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

template <typename T, int kLevel, bool kMoments, bool kFallback>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm(kHistBlocksPerSm))
    HistogramKernel(const T* __restrict__ x, int64_t n, Scratch* s,
                    Candidate* __restrict__ candidates, long long capacity) {
  using Bits = typename Traits<T>::Bits;
  constexpr int kBins = LevelInfo<kLevel>::kBins;
  __shared__ uint32_t shist[kBins];
  State& st = s->state;

  static_assert(kLevel == 1 || !kFallback, "levels 2 and 3: one pass");
  // Block-uniform exits, before any barrier.
  if (kFallback && !st.fallback) return;
  if (kLevel > 1 && st.exact.done) return;
  const uint32_t prefix = st.exact.prefix;
  const bool from_candidates = kLevel > 1 && st.use_candidates;

  for (int i = threadIdx.x; i < kBins; i += blockDim.x) shist[i] = 0u;
  __syncthreads();

  double sum = 0.0, sum_squares = 0.0;
  unsigned long long count = 0;
  auto count_bins = [&](int64_t, Bits raw, bool valid) {
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
  if (from_candidates) {
    ForEachCandidate<T>(candidates, CandidatesKept(st, capacity), count_bins);
  } else {
    ForEachEntry(x, n, count_bins);
  }
  __syncthreads();

  uint32_t* hist = LevelHist<kLevel>(s);
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    const uint32_t c = shist[i];
    if (c != 0u) atomicAdd(&hist[i], c);
  }
  if (kMoments) {
    BlockSumMoments<kThreads>(&sum, &sum_squares, &count);
    if (threadIdx.x == 0 && count != 0) {
      atomicAdd(&st.sum, sum);
      atomicAdd(&st.sum_squares, sum_squares);
      atomicAdd(&st.count, count);
    }
  }
}

// ---------------------------------------------------------------------------
// Plan kernels (one block of kPlanThreads).

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

// After the prefilter's pass: whether its candidates make the plan (a
// threshold was set, at least k candidates, all kept). If not, clears hist1
// for the fallback pass and sets the fallback flag. Called by every thread
// after FindCrossing over hist1 (whose reads are then done); block-uniform
// result. (Non-template device functions here are inline: several
// translation units of one library include this header.)
__device__ inline bool CandidatesSuffice(Scratch* s, int bin,
                                         long long capacity) {
  State& st = s->state;
  if (st.prefilter_key != 0u && bin >= 0 &&
      static_cast<long long>(st.candidate_count) <= capacity) {
    return true;
  }
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) s->hist1[i] = 0u;
  if (threadIdx.x == 0) st.fallback = 1;
  return false;
}

// The smallest bits b in [low, high] with AboveGaussianThreshold(fit, b), as
// GaussianTieLow's bisection finds it, searched 256 ways per round (one
// candidate per thread): 2^20 candidates in 3 rounds instead of 20
// sequential steps, each of two double-precision erfc. Called by every
// thread of the block; the result is valid in every thread.
__device__ inline uint32_t SearchGaussianThreshold(const GaussianFit& fit,
                                                   uint32_t low,
                                                   uint32_t high) {
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

// Gaussian plan: the threshold bin from hist1, then the tie threshold from
// the normal fit (FitGaussian, shared with the CPU kernel). The first call
// (kFallback false) plans from the candidates when there is a prefilter
// (capacity > 0; with the sample's moments, as the CPU does) or from all of
// x; the fallback call plans from all of x when the candidates did not
// suffice.
template <bool kFallback>
__global__ void __launch_bounds__(kPlanThreads)
    PlanGaussianKernel(Scratch* s, long long k, long long capacity) {
  State& st = s->state;
  if (kFallback && !st.fallback) return;  // block-uniform, before any barrier
  const bool prefiltered = !kFallback && capacity > 0;
  int bin;
  long long above, total;
  FindCrossing<kNumBins>(s->hist1, k, &bin, &above, &total);
  if (prefiltered && !CandidatesSuffice(s, bin, capacity)) return;
  Plan plan = bin >= 0 ? PlanForBin(bin, above, k) : SelectAllPlan(total);
  Moments moments;
  moments.sum = prefiltered ? st.sample_sum : st.sum;
  moments.sum_squares = prefiltered ? st.sample_sum_squares : st.sum_squares;
  moments.count = static_cast<long long>(prefiltered ? st.sample_count : st.count);
  const GaussianFit fit = FitGaussian(plan, s->hist1, moments);
  if (fit.refine) {  // block-uniform: every thread computed the same fit
    plan.tie_low = SearchGaussianThreshold(fit, plan.tie_low, plan.sure_above);
  }
  if (threadIdx.x != 0) return;
#if defined(TF_TOPK_DEBUG_CHECKS)
  CheckCrossing<kNumBins>(s->hist1, k, bin, above, total, &st);
  if (plan.tie_low != GaussianTieLow(bin >= 0 ? PlanForBin(bin, above, k)
                                              : SelectAllPlan(total),
                                     s->hist1, moments)) {
    st.error = kErrorPlanMismatch;
  }
#endif
  StorePlan(plan, &st);
  st.use_candidates = prefiltered ? 1 : 0;
}

// Exact plan after histogram level kLevel (ExactLevelStep, topk_common.h):
// level 1 finds the bin of the k-th largest (or that fewer than k qualify),
// levels 2 and 3 refine the prefix inside it; level 3 leaves the exact bits T
// of the k-th largest and the plan sure_above = tie_low = T. Level 1 has a
// first and a fallback call, as the gaussian plan.
template <int kLevel, bool kFallback>
__global__ void __launch_bounds__(kPlanThreads)
    PlanExactKernel(Scratch* s, long long k, long long capacity) {
  State& st = s->state;
  // Block-uniform exits, before any barrier.
  if (kFallback && !st.fallback) return;
  if (kLevel > 1 && st.exact.done) return;
  const bool prefiltered = kLevel == 1 && !kFallback && capacity > 0;
  const long long want = kLevel == 1 ? k : st.exact.k_rem;
  int bin;
  long long above, total;
  FindCrossing<LevelInfo<kLevel>::kBins>(LevelHist<kLevel>(s), want, &bin,
                                         &above, &total);
  if (prefiltered && !CandidatesSuffice(s, bin, capacity)) return;
  if (threadIdx.x != 0) return;
#if defined(TF_TOPK_DEBUG_CHECKS)
  CheckCrossing<LevelInfo<kLevel>::kBins>(LevelHist<kLevel>(s), want, bin,
                                          above, total, &st);
#endif
  if (kLevel == 1) st.use_candidates = prefiltered ? 1 : 0;
  Plan plan;
  if (ExactLevelStep(kLevel, bin, above, total, k, &st.exact, &plan)) {
    StorePlan(plan, &st);
    if (st.exact.error != 0) st.error = kErrorLevelNotFound;
  }
}

// ---------------------------------------------------------------------------
// Compaction: one pass over the candidates (or all of x) writing the selected
// entries (Classify, topk_common.h).
//   sure  bits > sure_above             -> slot sure_counter++ (< k of them)
//   tie   bits in [tie_low, sure_above] -> c = tie_counter++, slot above + c
//                                          while c < need
//   fill  bits in [bin_low, tie_low)    -> c = fill_counter++, fill list[c]
//                                          while c < need (gaussian only;
//                                          FinishKernel places them)
// Slots come from warp-aggregated atomics (one atomicAdd per warp and class).
// Most warps see no candidate at all and skip with a single ballot.

template <typename T>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm(kCompactBlocksPerSm))
    CompactKernel(const T* __restrict__ x, int64_t n, long long k, Scratch* s,
                  const Candidate* __restrict__ candidates, long long capacity,
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
  if (st.use_candidates) {  // block-uniform
    ForEachCandidate<T>(candidates, CandidatesKept(st, capacity), fn);
  } else {
    ForEachEntry(x, n, fn);
  }
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

// Blocks for a streaming pass of `kernel`: as many as the GPU holds at once
// (one wave), fewer when the input is small (each block then does one
// iteration).
template <typename Kernel>
inline int StreamingBlocks(int64_t n, int vec, Kernel kernel) {
  int device = 0;
  int sms = 0;
  int blocks_per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      sms <= 0) {
    sms = 132;  // H100 SXM; only the speed depends on it
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                    kThreads, 0) != cudaSuccess ||
      blocks_per_sm <= 0) {
    (void)cudaGetLastError();  // the launch reports real trouble
    blocks_per_sm = 1;
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
// `scratch` (ScratchBytes(n, k) bytes of device memory, 8-byte aligned) must
// not be used by anything else until the stream has passed this work. Returns
// the first error seen while enqueuing.
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
  // Neither the lists nor the outputs need clearing: only written candidates
  // and fill entries are read, and FinishKernel writes every slot the
  // compaction left.
  const cudaError_t err =
      cudaMemsetAsync(scratch, 0, ScratchHeaderBytes(), stream);
  if (err != cudaSuccess) return err;

  using Bits = typename Traits<T>::Bits;
  Scratch* s = static_cast<Scratch*>(scratch);
  Candidate* candidates = CandidateList(scratch);
  int32_t* fill_list = FillList(scratch, n, k);
  const long long capacity = CandidateCapacity(n, k);
  const bool prefilter = capacity > 0;  // else no sample and no fallback
  // Levels 1 (two-pass and fallback), 2 and 3 share their resources.
  const int blocks = StreamingBlocks(n, Traits<T>::kVec,
                                     HistogramKernel<T, 2, false, false>);
  const int compact_blocks =
      StreamingBlocks(n, Traits<T>::kVec, CompactKernel<T>);
  const long long kk = static_cast<long long>(k);
  if (prefilter) {
    SampleKernel<T><<<kSampleBlocks, kSampleThreads, 0, stream>>>(x, n, kk, s);
  }
  // The level-1 pass over x: the candidates (prefilter) or every entry. The
  // kernels after it check the state's flags themselves (fallback, done), so
  // the sequence is fixed at launch.
  const bool gaussian = method == Method::kGaussian;
  if (prefilter) {
    CollectKernel<T><<<StreamingBlocks(n, Traits<T>::kVec, CollectKernel<T>),
                       kThreads, 0, stream>>>(x, n, s, candidates, capacity);
  }
  if (gaussian) {
    if (!prefilter) {
      HistogramKernel<T, 1, true, false>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    }
    PlanGaussianKernel<false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    if (prefilter) {
      HistogramKernel<T, 1, true, true>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
      PlanGaussianKernel<true><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    }
  } else {
    if (!prefilter) {
      HistogramKernel<T, 1, false, false>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    }
    PlanExactKernel<1, false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    if (prefilter) {
      HistogramKernel<T, 1, false, true>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
      PlanExactKernel<1, true><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    }
  }
  if (!gaussian) {  // levels 2 and 3, over the candidates or all of x
    HistogramKernel<T, 2, false, false>
        <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    PlanExactKernel<2, false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    HistogramKernel<T, 3, false, false>
        <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    PlanExactKernel<3, false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
  }
  CompactKernel<T><<<compact_blocks, kThreads, 0, stream>>>(
      x, n, kk, s, candidates, capacity, fill_list,
      reinterpret_cast<Bits*>(values), indices);
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
