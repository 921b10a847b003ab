// The fused error-feedback selection on the CPU (ErrorFeedbackTopKFunctor's
// CPU specialization in error_feedback_topk_op.cc calls ErrorFeedbackTopK).
//
// Unfused, error feedback costs a dozen passes over the gradient around one
// selection (add the residual, scatter the selected entries, subtract them,
// assign, square and sum for the statistics, check finiteness). Here one
// parallel pass over blocks of the input, chunk by chunk, computes
// accumulated = gradient + residual into the `remaining` output, its
// statistics (sum of squares, non-finite count) and, while the chunk is still
// in the L1 cache, the prefilter of the selection (topk_cpu.h) with the
// threshold a sample of the sums gave. The selection then only looks at the
// candidates, and the selected entries are zeroed in `remaining` (k writes).
// Memory traffic: gradient and residual read once, remaining written once.
// Small inputs, or a misleading sample, fall back to the two-pass selection
// over `remaining` (plus one pass for the statistic of what remains).
#ifndef TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_CPU_H_
#define TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "error_feedback_topk_op.h"
#include "topk_common.h"
#include "topk_cpu.h"

namespace tf_topk {
namespace cpu {

// Entries accumulated before the chunk is prefiltered: 16 KiB of float32,
// well inside L1/L2, and a multiple of the prefilter's 16-entry groups.
constexpr int64_t kChunk = 4096;

// What a block's pass adds up, in double. float32 chunks sum their squares
// in float32 (partial sums over at most kChunk entries), and again in double
// when that overflowed.
struct BlockSums {
  double accumulated_squares = 0.0;
  double below_squares = 0.0;  // finite entries under the prefilter threshold
  int64_t non_finite = 0;
};

// accumulated = R(gradient) + residual over [begin, end), into out.
template <typename T, typename R>
void AccumulateScalar(const T* gradient, const R* residual, int64_t begin,
                      int64_t end, uint32_t low_key, R* out, BlockSums* sums) {
  double squares = 0.0, below = 0.0;
  int64_t non_finite = 0;
  for (int64_t i = begin; i < end; ++i) {
    const R a = static_cast<R>(gradient[i]) + residual[i];
    out[i] = a;
    const uint32_t key = KeyOf(a);
    if (key >= kInfBits) {
      ++non_finite;
      continue;
    }
    const double square = static_cast<double>(a) * static_cast<double>(a);
    squares += square;
    if (key < low_key) below += square;
  }
  sums->accumulated_squares += squares;
  sums->below_squares += below;
  sums->non_finite += non_finite;
}

template <typename T, typename R>
void AccumulateChunk(const T* gradient, const R* residual, int64_t begin,
                     int64_t end, uint32_t low_key, R* out, BlockSums* sums) {
  AccumulateScalar(gradient, residual, begin, end, low_key, out, sums);
}

// float32: four-wide vectors (GCC/Clang vector extensions), masks from the
// raw bits, so non-finite entries add nothing without a branch.
typedef float Float4 __attribute__((vector_size(16)));

template <>
inline void AccumulateChunk<float, float>(const float* gradient,
                                          const float* residual,
                                          int64_t begin, int64_t end,
                                          uint32_t low_key, float* out,
                                          BlockSums* sums) {
  Float4 squares = {}, below = {};
  Int4 non_finite = {};
  // Keys below 2^31 compare correctly as signed integers.
  const int32_t low = static_cast<int32_t>(
      std::min<uint32_t>(low_key, static_cast<uint32_t>(kInfBits)));
  const int32_t inf = static_cast<int32_t>(kInfBits);
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    Float4 g, r;
    std::memcpy(&g, gradient + i, sizeof(g));
    std::memcpy(&r, residual + i, sizeof(r));
    const Float4 a = g + r;
    std::memcpy(out + i, &a, sizeof(a));
    Int4 bits;
    std::memcpy(&bits, &a, sizeof(bits));
    const Int4 magnitude = bits & 0x7fffffff;
    const Int4 finite = magnitude < inf;  // -1 where finite
    Int4 square_bits;
    const Float4 square = a * a;
    std::memcpy(&square_bits, &square, sizeof(square_bits));
    const Int4 kept = square_bits & finite;
    const Int4 kept_below = kept & (magnitude < low);
    Float4 kept_f, kept_below_f;
    std::memcpy(&kept_f, &kept, sizeof(kept_f));
    std::memcpy(&kept_below_f, &kept_below, sizeof(kept_below_f));
    squares += kept_f;
    below += kept_below_f;
    non_finite += finite + 1;  // 1 where non-finite
  }
  double total = 0.0, total_below = 0.0;
  int64_t count = 0;
  for (int lane = 0; lane < 4; ++lane) {
    total += squares[lane];
    total_below += below[lane];
    count += non_finite[lane];
  }
  if (!std::isfinite(total) || !std::isfinite(total_below)) {
    // Entries above 2^64 in magnitude: their float32 squares overflowed.
    total = total_below = 0.0;
    for (int64_t j = begin; j < i; ++j) {
      const uint32_t key = KeyOf(out[j]);
      if (key >= kInfBits) continue;
      const double square = static_cast<double>(out[j]) * out[j];
      total += square;
      if (key < low_key) total_below += square;
    }
  }
  sums->accumulated_squares += total;
  sums->below_squares += total_below;
  sums->non_finite += count;
  AccumulateScalar(gradient, residual, i, end, low_key, out, sums);
}

// The pass: every block accumulates its chunks and, while a prefilter is in
// use and its block has not overflowed, collects their candidates.
template <typename R>
struct PassResult {
  std::vector<BlockSums> sums;
  std::vector<std::vector<double>> profiles;  // per block: counts, then energies
  std::vector<std::vector<Candidate<R>>> candidates;
  bool prefiltered = false;  // every block's candidates are complete
};

// Adds the count and sum of squares of the finite, non-zero entries of
// x[begin, end) whose key is at least floor_key to their magnitude bins
// (profile: counts, then energies).
template <typename R>
inline void ProfileEntry(R x, uint32_t floor_key, double* profile) {
  const uint32_t key = KeyOf(x);
  if (key < floor_key || !Qualifies(key)) return;
  const int bin = BinOf(key);
  profile[bin] += 1.0;
  profile[kNumBins + bin] += static_cast<double>(x) * static_cast<double>(x);
}

template <typename R>
void ProfileChunk(const R* x, int64_t begin, int64_t end, uint32_t floor_key, double* profile) {
  for (int64_t i = begin; i < end; ++i) ProfileEntry(x[i], floor_key, profile);
}

// float32: sixteen entries per test, so that groups below the floor (most of
// them under a shallow floor) cost no scalar work; the entries of a group with
// any above it are gathered without a branch per entry, then profiled. A
// branch per entry mispredicts on a large share of them under a deep floor
// (the top 15% of a bucket: 3.9x the fused selection's time against 1.5x at
// the top 3%).
template <>
inline void ProfileChunk<float>(const float* x, int64_t begin, int64_t end, uint32_t floor_key, double* profile) {
  if (floor_key == 0u) {  // no floor: every entry
    for (int64_t i = begin; i < end; ++i) ProfileEntry(x[i], 0u, profile);
    return;
  }
  constexpr int kGroup = 16;
  const uint32_t floor = std::min<uint32_t>(floor_key, kInfBits);
  const int32_t signed_floor = static_cast<int32_t>(floor);
  float kept[kChunk];  // a chunk's entries above the floor, in order (the same sums as one by one)
  int64_t count = 0, i = begin;
  for (; i + kGroup <= end && i + kGroup - begin <= kChunk; i += kGroup) {
    Int4 any = {};
    for (int q = 0; q < kGroup; q += 4) {
      Int4 raw;
      std::memcpy(&raw, x + i + q, sizeof(raw));
      any |= (raw & 0x7fffffff) >= signed_floor;
    }
    if (!(any[0] | any[1] | any[2] | any[3])) continue;
    for (int lane = 0; lane < kGroup; ++lane) {
      kept[count] = x[i + lane];
      count += MagnitudeBits(x[i + lane]) >= floor ? 1 : 0;
    }
  }
  for (int64_t j = 0; j < count; ++j) ProfileEntry(kept[j], floor_key, profile);
  for (; i < end; ++i) ProfileEntry(x[i], floor_key, profile);
}

// The profile's floor: a sampled magnitude with comfortably more than the
// top profile_density * n entries above it (the sample's expected count
// among them, plus a quarter, plus three standard deviations, plus 8), or 0
// (profile everything) when the sample cannot tell.
inline uint32_t ProfileFloorKey(Sample* sample, double profile_density) {
  std::vector<double>& m = sample->magnitudes;
  const double expected = profile_density * static_cast<double>(kSampleSize);
  const int64_t rank = static_cast<int64_t>(std::ceil(1.25 * expected + 3.0 * std::sqrt(expected) + 8.0));
  if (profile_density >= 1.0 || rank >= static_cast<int64_t>(m.size())) return 0u;
  std::nth_element(m.begin(), m.begin() + rank, m.end(), [](double a, double b) { return a > b; });
  const uint32_t key = MagnitudeBits(static_cast<float>(m[rank]));
  return Qualifies(key) ? key : 0u;
}

template <typename T, typename R>
PassResult<R> AccumulateAndPrefilter(const Blocks& blocks,
                                     const T* gradient, const R* residual,
                                     uint32_t low_key, bool with_profile,
                                     uint32_t floor_key, R* remaining) {
  PassResult<R> result;
  result.sums.resize(blocks.count());
  if (with_profile) {
    result.profiles.assign(blocks.count(), std::vector<double>(kProfileRows * kNumBins, 0.0));
  }
  result.candidates.resize(blocks.count());
  std::vector<char> ok(blocks.count(), low_key != 0u);
  blocks.ForEach([&](int64_t b) {
    const int64_t begin = blocks.begin(b), end = blocks.end(b);
    const int64_t limit = CandidateLimit(end - begin);
    for (int64_t c = begin; c < end; c += kChunk) {
      const int64_t c_end = std::min(end, c + kChunk);
      // With no prefilter, every finite entry counts as "below".
      AccumulateChunk(gradient, residual, c, c_end,
                      low_key == 0u ? kInfBits : low_key, remaining,
                      &result.sums[b]);
      if (with_profile) {  // while the chunk is in cache
        ProfileChunk(remaining, c, c_end, floor_key, result.profiles[b].data());
      }
      if (ok[b]) {
        ok[b] = PrefilterBlock(remaining, c, c_end, low_key, limit,
                               &result.candidates[b]);
        if (!ok[b]) std::vector<Candidate<R>>().swap(result.candidates[b]);
      }
    }
  });
  result.prefiltered = low_key != 0u && std::all_of(ok.begin(), ok.end(),
                                                   [](char v) { return v != 0; });
  return result;
}

// Sum of squares of the finite entries of x[0:n], in parallel.
template <typename R>
double FiniteSquares(const Blocks& blocks, const R* x) {
  std::vector<double> partial(blocks.count(), 0.0);
  blocks.ForEach([&](int64_t b) {
    double total = 0.0;
    for (int64_t i = blocks.begin(b); i < blocks.end(b); ++i) {
      if (KeyOf(x[i]) < kInfBits) {
        total += static_cast<double>(x[i]) * static_cast<double>(x[i]);
      }
    }
    partial[b] = total;
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

// The op on n >= 0 entries in `blocks` (ErrorFeedbackTopKFunctor's contract,
// error_feedback_topk_op.h).
template <typename T, typename R>
void ErrorFeedbackTopK(const Blocks& blocks, const T* gradient,
                       const R* residual, int64_t n, int64_t k, Method method,
                       R* values, int32_t* indices, R* remaining,
                       double* stats, double* profile,
                       double profile_density) {
  uint32_t low_key = 0u, floor_key = 0u;
  Sample sample{{}, {0.0, 0.0, 0}};
  const bool prefilter = k > 0 && PrefilterRank(n, k) >= 0;
  const bool floor = profile != nullptr && profile_density < 1.0 && n >= kMinPrefilterSize;
  if (prefilter || floor) {
    sample = SampleOf<R>(
        blocks, [gradient, residual](int64_t i) {
          return static_cast<R>(gradient[i]) + residual[i];
        },
        n);
    if (floor) floor_key = ProfileFloorKey(&sample, profile_density);
    if (prefilter) low_key = PrefilterKey(&sample, n, k);
  }
  PassResult<R> pass = AccumulateAndPrefilter(
      blocks, gradient, residual, low_key, profile != nullptr, floor_key, remaining);
  if (profile != nullptr) {  // blocks in order: the same sums on every run
    std::fill(profile, profile + kProfileRows * kNumBins, 0.0);
    for (const std::vector<double>& block : pass.profiles) {
      for (int j = 0; j < kProfileRows * kNumBins; ++j) profile[j] += block[j];
    }
  }
  double accumulated_squares = 0.0, below_squares = 0.0;
  int64_t non_finite = 0;
  for (const BlockSums& s : pass.sums) {
    accumulated_squares += s.accumulated_squares;
    below_squares += s.below_squares;
    non_finite += s.non_finite;
  }
  bool from_candidates = false;
  if (k > 0) {
    from_candidates =
        pass.prefiltered &&
        SelectFromCandidateLists(pass.candidates, remaining, k, method,
                                 sample.moments, low_key, values, indices);
    if (!from_candidates) {
      SelectWithTwoPasses(blocks, remaining, k, method, values, indices);
    }
    for (int64_t j = 0; j < k; ++j) {
      if (values[j] != R(0)) remaining[indices[j]] = R(0);  // spare slots: none
    }
  }
  double remaining_squares = accumulated_squares;
  if (from_candidates) {
    // Every finite entry is below the threshold or a candidate.
    remaining_squares = below_squares;
    for (const auto& candidates : pass.candidates) {
      for (const Candidate<R>& c : candidates) {
        const double v = static_cast<double>(remaining[c.index]);
        remaining_squares += v * v;
      }
    }
  } else if (k > 0) {
    remaining_squares = FiniteSquares(blocks, remaining);
  }
  stats[kAccumulatedSquares] = accumulated_squares;
  stats[kRemainingSquares] = remaining_squares;
  stats[kNonFinite] = static_cast<double>(non_finite);
}

}  // namespace cpu
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_CPU_H_
