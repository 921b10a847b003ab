// Launch constants and the device scratch of the selection kernels (part of
// approx_topk.cuh, which is what to include). Every kernel takes its
// parameters (plan, prefix, flags) from the scratch that the kernels before
// it wrote, so nothing is read back between them; the host side sizes and
// clears the scratch, and the harness reads its State back.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_SCRATCH_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_SCRATCH_CUH_

#include <cuda_runtime.h>  // before topk_common.h: erfc/sqrt resolve on device

#include <cstddef>
#include <cstdint>

#include "topk_common.h"

namespace tf_topk {
namespace cuda {

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

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_SCRATCH_CUH_
