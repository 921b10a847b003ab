// The CPU selection, shared by the selection op (approx_topk_op.cc) and the
// fused error-feedback op (error_feedback_cpu.h).
//
// CPU algorithm, on the intra-op thread pool, in blocks of the input:
//   sample     a deterministic strided sample of 32768 entries gives a
//              prefilter threshold above which
//              comfortably more than k entries should lie, whatever the
//              distribution, and the moments for the gaussian method's fit;
//   prefilter  one pass collects the indices of entries at or above it
//              (vectorized compare, rare writes);
//   plan       the 2048-bin histogram of the candidates finds the threshold
//              bin as a histogram of the whole input would (every bin above
//              the prefilter threshold is complete); the gaussian method
//              places its threshold inside that bin with the normal fit
//              (topk_common.h);
//   select     candidates above the threshold bin fill their slots in index
//              order; the threshold bin's entries fill the rest: exact takes
//              the largest by true magnitude (nth_element), gaussian first
//              those at or above its threshold, in index order, then the
//              rest of the bin.
// Small inputs, and the rare case where the sample misleads (fewer than k
// candidates, or too many), take the fallback: a histogram pass over the
// whole input, then a compaction pass over the entries in and above the
// threshold bin.
// The result is deterministic: same input, same outputs in the same order.
#ifndef TF_TOPK_CC_KERNELS_TOPK_CPU_H_
#define TF_TOPK_CC_KERNELS_TOPK_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/lib/core/threadpool.h"
#include "topk_common.h"

namespace tf_topk {
namespace cpu {

using ::tensorflow::OpKernelContext;

constexpr int64_t kMinBlockSize = 1 << 16;
constexpr int kBlocksPerThread = 4;

// Magnitude bits of the float32 rounding of |x|, the key the histogram uses.
// float32 keys are exact; wider types round, which keeps order (monotone),
// so bins never misorder entries; ties inside a bin use the true magnitude.
template <typename T>
inline uint32_t KeyOf(T x) {
  return MagnitudeBits(static_cast<float>(x));
}
template <>
inline uint32_t KeyOf<double>(double x) {
  if (!std::isfinite(x)) return kInfBits;  // never selected
  if (x == 0.0) return 0u;
  uint32_t bits = MagnitudeBits(static_cast<float>(x));
  if (bits >= kInfBits) return kInfBits - 1u;  // finite beyond float range
  if (bits == 0u) return 1u;                   // non-zero below float range
  return bits;
}

template <typename T>
inline double MagnitudeOf(T x) {
  return std::fabs(static_cast<double>(x));
}

// Fallback pass over input[begin, end): the histogram and the moments of its
// qualifying entries. Four interleaved sub-histograms break the
// store-to-load dependency when neighbouring entries share a bin.
template <typename T>
Moments HistogramOfBlock(const T* input, int64_t begin, int64_t end,
                         uint32_t* hist) {
  std::vector<uint32_t> sub(4 * kNumBins, 0u);
  Moments moments{0.0, 0.0, 0};
  auto add = [&](int lane, T x) {
    const uint32_t key = KeyOf(x);
    if (!Qualifies(key)) return;
    ++sub[lane * kNumBins + BinOf(key)];
    const double v = static_cast<double>(x);
    moments.sum += v;
    moments.sum_squares += v * v;
    moments.count += 1;
  };
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    for (int lane = 0; lane < 4; ++lane) add(lane, input[i + lane]);
  }
  for (; i < end; ++i) add(0, input[i]);
  for (int b = 0; b < kNumBins; ++b) {
    hist[b] = sub[b] + sub[kNumBins + b] + sub[2 * kNumBins + b] +
              sub[3 * kNumBins + b];
  }
  return moments;
}

// Entries the generic (non-float32) prefilter checks per early-out test.
constexpr int kLanes = 16;

// float32 loops use explicit 4-wide vectors (GCC/Clang vector extensions:
// SSE2 on x86-64, NEON on Arm); masks are integer arithmetic on raw bits.
typedef int32_t Int4 __attribute__((vector_size(16)));

struct Sample {
  std::vector<double> magnitudes;  // of the qualifying sampled entries
  Moments moments;                 // of the qualifying sampled entries
};

// Adds the sampled entries s in [first, last) of the deterministic sample
// (SampleIndex, shared with the GPU) to `sample`, from the entries value_at(i)
// gives (the input itself, or a sum computed on the fly).
template <typename T, typename ValueAt>
void SampleRange(const ValueAt& value_at, int64_t n, int64_t first, int64_t last, Sample* sample) {
  for (int64_t s = first; s < last; ++s) {
    const T x = value_at(SampleIndex(s, n));
    if (!Qualifies(KeyOf(x))) continue;
    const double v = static_cast<double>(x);
    sample->magnitudes.push_back(std::fabs(v));
    sample->moments.sum += v;
    sample->moments.sum_squares += v * v;
    sample->moments.count += 1;
  }
}

// The prefilter threshold (magnitude bits): the sampled magnitude of rank
// PrefilterRank. Returns 0 when no useful prefilter exists.
inline uint32_t PrefilterKey(Sample* sample, int64_t n, int64_t k) {
  const int64_t rank = PrefilterRank(n, k);
  std::vector<double>& m = sample->magnitudes;
  if (rank < 0 || rank >= static_cast<int64_t>(m.size())) return 0u;
  std::nth_element(m.begin(), m.begin() + rank, m.end(),
                   [](double a, double b) { return a > b; });
  const uint32_t key = MagnitudeBits(static_cast<float>(m[rank]));
  return Qualifies(key) ? key : 0u;
}

// An entry that passed the prefilter. It carries its value so that later
// steps never go back to the input (each such read would be a cache miss).
template <typename T>
struct Candidate {
  int32_t index;
  T value;
};

// Appends the qualifying entries of input[begin, end) whose key is >=
// low_key: the scalar part of the prefilter.
template <typename T>
inline void CollectAtOrAbove(const T* input, int64_t begin, int64_t end,
                             uint32_t low_key,
                             std::vector<Candidate<T>>* candidates) {
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = KeyOf(input[i]);
    if (key >= low_key && key < kInfBits) {
      candidates->push_back(Candidate<T>{static_cast<int32_t>(i), input[i]});
    }
  }
}

// Pass 2 (prefilter) over input[begin, end): appends the indices of entries
// whose key is >= low_key and that qualify. Returns false when more than
// `limit` were found (the fit was too far off for a prefilter to pay).
template <typename T>
bool PrefilterBlock(const T* input, int64_t begin, int64_t end,
                    uint32_t low_key, int64_t limit,
                    std::vector<Candidate<T>>* candidates) {
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    int any = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      any |= KeyOf(input[i + lane]) >= low_key;
    }
    if (!any) continue;
    CollectAtOrAbove(input, i, i + kLanes, low_key, candidates);
    if (static_cast<int64_t>(candidates->size()) > limit) return false;
  }
  CollectAtOrAbove(input, i, end, low_key, candidates);
  return static_cast<int64_t>(candidates->size()) <= limit;
}

template <>
inline bool PrefilterBlock<float>(const float* input, int64_t begin, int64_t end,
                           uint32_t low_key, int64_t limit,
                           std::vector<Candidate<float>>* candidates) {
  // Keys below 2^31 compare correctly as signed integers.
  const int32_t low = static_cast<int32_t>(low_key);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    Int4 hit[4];
    Int4 any = {};
    for (int group = 0; group < 4; ++group) {
      Int4 raw;
      std::memcpy(&raw, input + i + 4 * group, sizeof(raw));
      hit[group] = (raw & 0x7fffffff) >= low;
      any |= hit[group];
    }
    if (!(any[0] | any[1] | any[2] | any[3])) continue;
    for (int group = 0; group < 4; ++group) {
      if (!(hit[group][0] | hit[group][1] | hit[group][2] | hit[group][3])) {
        continue;
      }
      CollectAtOrAbove(input, i + 4 * group, i + 4 * group + 4, low_key,
                       candidates);
    }
    if (static_cast<int64_t>(candidates->size()) > limit) return false;
  }
  CollectAtOrAbove(input, i, end, low_key, candidates);
  return static_cast<int64_t>(candidates->size()) <= limit;
}

struct TieCandidate {
  double magnitude;
  int32_t index;
};

// Pass 2 over input[begin, end): writes sure entries from `slot` on and
// collects the threshold bin's entries (tie or fill).
template <typename T>
void CompactBlock(const T* input, int64_t begin, int64_t end,
                  const Plan& plan, int64_t slot, T* values, int32_t* indices,
                  std::vector<TieCandidate>* ties) {
  for (int64_t i = begin; i < end; ++i) {
    const T x = input[i];
    const EntryClass c =
        Classify(KeyOf(x), plan.sure_above, plan.tie_low, plan.bin_low);
    if (c == EntryClass::kSure) {
      values[slot] = x;
      indices[slot] = static_cast<int32_t>(i);
      ++slot;
    } else if (c != EntryClass::kSkip) {  // the threshold bin: tie or fill
      ties->push_back(TieCandidate{MagnitudeOf(x), static_cast<int32_t>(i)});
    }
  }
}


// Fills slots [slot, k) from the threshold bin's entries (`ties`, in index
// order), then zeros. exact: the `need` largest by true magnitude. gaussian:
// first the entries at or above its threshold inside the bin, in index
// order, then, if slots remain, the rest of the bin: k slots are filled
// whenever k entries qualify.
template <typename T>
void FinishTies(Method method, const Plan& plan, const T* input,
                std::vector<TieCandidate>* ties, int64_t slot, int64_t k,
                T* values, int32_t* indices) {
  const int64_t take = std::min<int64_t>(plan.need, ties->size());
  if (method == Method::kExact) {
    if (take < static_cast<int64_t>(ties->size())) {
      std::nth_element(ties->begin(), ties->begin() + take, ties->end(),
                       [](const TieCandidate& a, const TieCandidate& b) {
                         return a.magnitude > b.magnitude;
                       });
    }
  } else {
    std::stable_partition(ties->begin(), ties->end(),
                          [&](const TieCandidate& t) {
                            return KeyOf(input[t.index]) >= plan.tie_low;
                          });
  }
  for (int64_t j = 0; j < take; ++j, ++slot) {
    values[slot] = input[(*ties)[j].index];
    indices[slot] = (*ties)[j].index;
  }
  for (; slot < k; ++slot) {
    values[slot] = T(0);
    indices[slot] = 0;
  }
}

// The threshold plan from a histogram; the gaussian method then places its
// threshold inside the threshold bin with the normal fit.
// `floor_key`: the histogram counts only entries at or above it (the
// prefilter threshold; 0 for a histogram of the whole input). When it lies
// inside the threshold bin, that bin is counted in part; since at least
// `need` of its entries are counted, the bin's `need` largest are among them,
// and the normal fit sees the bin as starting at floor_key.
inline Plan MakePlan(const uint32_t* hist, int64_t k, Method method,
                     const Moments& moments, uint32_t floor_key) {
  Plan plan = PlanFromHistogram(hist, k);
  if (plan.bin >= 0 && plan.bin_low < floor_key) {
    plan.bin_low = floor_key;
    plan.tie_low = floor_key;
  }
  if (method == Method::kGaussian) {
    plan.tie_low = GaussianTieLow(plan, hist, moments);
  }
  return plan;
}

// The input cut into blocks that run in parallel on the intra-op pool, a few
// blocks per thread, at least kMinBlockSize entries each.
class Blocks {
 public:
  Blocks(OpKernelContext* ctx, int64_t n)
      : pool_(ctx->device()->tensorflow_cpu_worker_threads()->workers), n_(n) {
    const int threads = std::max(1, pool_->NumThreads());
    size_ = std::max<int64_t>(kMinBlockSize,
                              (n + threads * kBlocksPerThread - 1) /
                                  (threads * kBlocksPerThread));
    count_ = (n + size_ - 1) / size_;
  }

  int64_t count() const { return count_; }
  int64_t begin(int64_t b) const { return std::min(n_, b * size_); }
  int64_t end(int64_t b) const { return begin(b + 1); }

  // fn(b) for every block, in parallel; one block per shard, since blocks
  // are already sized to spread over the threads.
  void ForEach(const std::function<void(int64_t)>& fn) const { Parallel(count_, fn); }

  // fn(i) for i in [0, count), in parallel, one per shard.
  void Parallel(int64_t count, const std::function<void(int64_t)>& fn) const {
    pool_->ParallelFor(count,
                       ::tsl::thread::ThreadPool::SchedulingParams::Fixed(1),
                       [&](int64_t first, int64_t last) {
                         for (int64_t i = first; i < last; ++i) fn(i);
                       });
  }

 private:
  ::tsl::thread::ThreadPool* pool_;
  int64_t n_;
  int64_t size_;
  int64_t count_;
};

// The sample is read in this many pieces, in parallel: its entries are
// scattered over the input, so each read is a cache miss, and the threads'
// misses overlap. Pieces are combined in order, so the sample (and the
// moments' sums) do not depend on the number of threads.
constexpr int64_t kSamplePieces = 16;

template <typename T, typename ValueAt>
Sample SampleOf(const Blocks& blocks, const ValueAt& value_at, int64_t n) {
  std::vector<Sample> pieces(kSamplePieces, Sample{{}, {0.0, 0.0, 0}});
  blocks.Parallel(kSamplePieces, [&](int64_t p) {
    pieces[p].magnitudes.reserve(kSampleSize / kSamplePieces);
    SampleRange<T>(value_at, n, p * kSampleSize / kSamplePieces, (p + 1) * kSampleSize / kSamplePieces,
                   &pieces[p]);
  });
  Sample sample{{}, {0.0, 0.0, 0}};
  sample.magnitudes.reserve(kSampleSize);
  for (const Sample& piece : pieces) {
    sample.magnitudes.insert(sample.magnitudes.end(), piece.magnitudes.begin(), piece.magnitudes.end());
    sample.moments.sum += piece.moments.sum;
    sample.moments.sum_squares += piece.moments.sum_squares;
    sample.moments.count += piece.moments.count;
  }
  return sample;
}

// After the prefilter: the histogram of the candidates (every block's, in
// block order) makes the plan, and the selection is made from them alone.
// Returns false, having written nothing, when fewer than k candidates were
// found. `input` is read again only for the threshold bin's entries.
template <typename T>
bool SelectFromCandidateLists(
    const std::vector<std::vector<Candidate<T>>>& block_candidates,
    const T* input, int64_t k, Method method, const Moments& moments,
    uint32_t low_key, T* values, int32_t* indices) {
  std::vector<uint32_t> hist(kNumBins, 0u);
  for (const auto& candidates : block_candidates) {
    for (const Candidate<T>& c : candidates) ++hist[BinOf(KeyOf(c.value))];
  }
  const Plan plan = MakePlan(hist.data(), k, method, moments, low_key);
  if (plan.bin < 0) return false;  // fewer than k candidates
  int64_t slot = 0;
  std::vector<TieCandidate> ties;
  for (const auto& candidates : block_candidates) {
    for (const Candidate<T>& c : candidates) {
      const EntryClass c_class = Classify(KeyOf(c.value), plan.sure_above,
                                          plan.tie_low, plan.bin_low);
      if (c_class == EntryClass::kSure) {
        values[slot] = c.value;
        indices[slot] = c.index;
        ++slot;
      } else if (c_class != EntryClass::kSkip) {
        ties.push_back(TieCandidate{MagnitudeOf(c.value), c.index});
      }
    }
  }
  FinishTies(method, plan, input, &ties, slot, k, values, indices);
  return true;
}

// The candidate limit of a block of `entries` entries: more means the sample
// misled and the prefilter no longer pays.
inline int64_t CandidateLimit(int64_t entries) {
  return entries / kMaxCandidateFraction + 64;
}

// The one-pass path: the sample gives the prefilter threshold (and, for the
// gaussian method, the moments of the normal fit); one pass collects the
// entries at or above it; their histogram makes the plan. Returns false,
// having written nothing, when there is no useful threshold or the sample
// misled (too many candidates in a block, or fewer than k in all).
template <typename T>
bool SelectFromCandidates(const Blocks& blocks, const T* input, int64_t n,
                          int64_t k, Method method, T* values,
                          int32_t* indices) {
  if (PrefilterRank(n, k) < 0) return false;
  Sample sample = SampleOf<T>(blocks, [input](int64_t i) { return input[i]; }, n);
  const uint32_t low_key = PrefilterKey(&sample, n, k);
  if (low_key == 0u) return false;
  std::vector<std::vector<Candidate<T>>> block_candidates(blocks.count());
  std::vector<char> block_ok(blocks.count(), 0);
  blocks.ForEach([&](int64_t b) {
    const int64_t begin = blocks.begin(b), end = blocks.end(b);
    block_ok[b] = PrefilterBlock(input, begin, end, low_key,
                                 CandidateLimit(end - begin),
                                 &block_candidates[b]);
  });
  if (!std::all_of(block_ok.begin(), block_ok.end(),
                   [](char ok) { return ok != 0; })) {
    return false;
  }
  return SelectFromCandidateLists(block_candidates, input, k, method,
                                  sample.moments, low_key, values, indices);
}

// The two-pass path: histogram of the whole input, then compaction. Each
// block's output offset is known from its own histogram, so blocks write in
// parallel and in index order.
template <typename T>
void SelectWithTwoPasses(const Blocks& blocks, const T* input, int64_t k,
                         Method method, T* values, int32_t* indices) {
  const int64_t num_blocks = blocks.count();
  std::vector<uint32_t> block_hists(num_blocks * kNumBins);
  std::vector<Moments> block_moments(num_blocks);
  blocks.ForEach([&](int64_t b) {
    block_moments[b] = HistogramOfBlock(input, blocks.begin(b), blocks.end(b),
                                        &block_hists[b * kNumBins]);
  });
  std::vector<uint32_t> hist(kNumBins, 0u);
  Moments moments{0.0, 0.0, 0};
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int bin = 0; bin < kNumBins; ++bin) {
      hist[bin] += block_hists[b * kNumBins + bin];
    }
    moments.sum += block_moments[b].sum;
    moments.sum_squares += block_moments[b].sum_squares;
    moments.count += block_moments[b].count;
  }
  const Plan plan = MakePlan(hist.data(), k, method, moments, 0u);
  std::vector<int64_t> offsets(num_blocks + 1, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    int64_t sure = 0;
    for (int bin = plan.bin + 1; bin < kNumBins; ++bin) {
      sure += block_hists[b * kNumBins + bin];
    }
    offsets[b + 1] = offsets[b] + sure;
  }
  std::vector<std::vector<TieCandidate>> block_ties(num_blocks);
  blocks.ForEach([&](int64_t b) {
    CompactBlock(input, blocks.begin(b), blocks.end(b), plan, offsets[b],
                 values, indices, &block_ties[b]);
  });
  std::vector<TieCandidate> ties;
  for (auto& t : block_ties) ties.insert(ties.end(), t.begin(), t.end());
  FinishTies(method, plan, input, &ties, offsets[num_blocks], k, values,
             indices);
}

}  // namespace cpu
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_TOPK_CPU_H_
