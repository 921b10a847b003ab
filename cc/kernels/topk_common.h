// Selection arithmetic shared by the CPU kernel, the CUDA kernels and the
// standalone GPU harness. No TensorFlow and no CUDA runtime include: every
// function here is plain arithmetic on magnitudes, histograms and statistics,
// so host and device compute the same plan from the same counts.
//
// Vocabulary
//   magnitude bits  the IEEE-754 float32 bits of |x| (sign cleared). For
//                   non-negative floats the unsigned bit pattern is ordered
//                   like the value, so comparing bits compares magnitudes.
//   qualifying      an entry that may be selected: finite and non-zero.
//                   NaN, +-Inf and zeros are never selected.
//   bin             the top kBinBits bits of the magnitude bits (8 exponent
//                   bits and 3 mantissa bits): 2048 logarithmic bins, each
//                   1/8 of an octave wide.
//   plan            what the compaction pass needs: entries whose magnitude
//                   bits are > sure_above are always selected (there are
//                   fewer than k of them: `above`); entries in
//                   [tie_low, sure_above] (preferred ties) fill the
//                   remaining `need` slots first, and entries in
//                   [bin_low, tie_low) (the rest of the threshold bin) fill
//                   whatever slots the preferred ties left. The threshold
//                   bin holds at least `need` entries, so exactly
//                   min(k, qualifying) slots are filled, by both methods, on
//                   both devices.
#ifndef TF_TOPK_CC_KERNELS_TOPK_COMMON_H_
#define TF_TOPK_CC_KERNELS_TOPK_COMMON_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TF_TOPK_HD __host__ __device__
#else
#define TF_TOPK_HD
#endif

namespace tf_topk {

enum class Method : int { kGaussian = 0, kExact = 1 };

constexpr int kBinBits = 11;
constexpr int kNumBins = 1 << kBinBits;          // 2048
constexpr int kBinShift = 31 - kBinBits;         // 20
constexpr uint32_t kInfBits = 0x7f800000u;       // |x| bits >= this: Inf/NaN

TF_TOPK_HD inline uint32_t MagnitudeBits(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__float_as_uint(x)) & 0x7fffffffu;
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7fffffffu;
#endif
}

TF_TOPK_HD inline float FloatFromBits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Finite and non-zero: the only entries the op ever selects.
TF_TOPK_HD inline bool Qualifies(uint32_t magnitude_bits) {
  return magnitude_bits != 0u && magnitude_bits < kInfBits;
}

TF_TOPK_HD inline int BinOf(uint32_t magnitude_bits) {
  return static_cast<int>(magnitude_bits >> kBinShift);
}

// Moments of the qualifying entries, accumulated in double.
struct Moments {
  double sum;
  double sum_squares;
  long long count;
};

struct Plan {
  uint32_t sure_above;  // magnitude bits > sure_above: always selected
  uint32_t tie_low;     // [tie_low, sure_above]: fill up to `need` slots
  uint32_t bin_low;     // [bin_low, tie_low): fill the slots ties left
  long long above;      // number of entries with bits > sure_above (< k)
  long long need;       // slots left for the tie range: k - above
  int bin;              // the threshold bin (-1: fewer than k qualify)
};

// The plan when fewer than k entries qualify: every qualifying entry is
// selected (all are "sure"), the tie and fill ranges are empty.
TF_TOPK_HD inline Plan SelectAllPlan(long long qualifying) {
  Plan plan;
  plan.bin = -1;
  plan.above = qualifying;
  plan.need = 0;
  plan.sure_above = 0u;
  plan.tie_low = kInfBits;  // empty: nothing is both <= 0 and >= kInfBits
  plan.bin_low = kInfBits;
  return plan;
}

// The plan once the threshold bin `bin` (kBinBits wide, at `shift`) of a
// histogram and the count `above` of entries in higher bins are known.
TF_TOPK_HD inline Plan PlanForBin(int bin, long long above, long long k) {
  Plan plan;
  plan.bin = bin;
  plan.above = above;
  plan.need = k - above;
  plan.sure_above = ((static_cast<uint32_t>(bin) + 1u) << kBinShift) - 1u;
  plan.tie_low = static_cast<uint32_t>(bin) << kBinShift;
  plan.bin_low = plan.tie_low;
  return plan;
}

// What the compaction does with one entry, given its magnitude bits.
enum class EntryClass : int { kSkip = 0, kSure = 1, kTie = 2, kFill = 3 };

TF_TOPK_HD inline EntryClass Classify(uint32_t bits, uint32_t sure_above,
                                      uint32_t tie_low, uint32_t bin_low) {
  if (!Qualifies(bits)) return EntryClass::kSkip;
  if (bits > sure_above) return EntryClass::kSure;
  if (bits >= tie_low) return EntryClass::kTie;
  if (bits >= bin_low) return EntryClass::kFill;
  return EntryClass::kSkip;
}

// After the compaction: `ties_seen` entries of the tie range and
// `fills_seen` of the fill range asked for a slot (each range's counter may
// stop a little past `need`: only `need` slots exist for either). The tie
// range took the first TiesTaken slots after the sure ones; the fill range
// takes the next FillCount, as far as it has entries.
TF_TOPK_HD inline long long TiesTaken(long long need,
                                      unsigned long long ties_seen) {
  return ties_seen < static_cast<unsigned long long>(need)
             ? static_cast<long long>(ties_seen)
             : need;
}

TF_TOPK_HD inline long long FillCount(long long need,
                                      unsigned long long ties_seen,
                                      unsigned long long fills_seen) {
  const long long wanted = need - TiesTaken(need, ties_seen);
  return fills_seen < static_cast<unsigned long long>(wanted)
             ? static_cast<long long>(fills_seen)
             : wanted;
}

// Where the k-th largest magnitude lies in a 2048-bin histogram of the
// qualifying entries. When fewer than k entries qualify, every qualifying
// entry is selected (bin = -1, sure_above = 0, need = 0).
TF_TOPK_HD inline Plan PlanFromHistogram(const uint32_t* hist, long long k) {
  long long above = 0;
  for (int b = kNumBins - 1; b >= 0; --b) {
    const long long in_bin = hist[b];
    if (above + in_bin >= k && k > 0) return PlanForBin(b, above, k);
    above += in_bin;
  }
  return SelectAllPlan(above);
}

// Serial crossing search over a histogram of `bins` bins: the bin where the
// running count from the top reaches `want` (-1 when the total is below it),
// with the count above it and the total. The CUDA plan kernels search in
// parallel; debug builds compare the two.
TF_TOPK_HD inline int FindCrossingSerial(const uint32_t* hist, int bins,
                                         long long want, long long* above,
                                         long long* total) {
  long long running = 0;
  int found = -1;
  for (int b = bins - 1; b >= 0; --b) {
    if (found < 0 && running < want && running + hist[b] >= want) {
      found = b;
      *above = running;
    }
    running += hist[b];
  }
  if (found < 0) *above = running;
  *total = running;
  return found;
}

// The exact method: a radix select over the 31 magnitude bits in three
// levels, bits [30:20] (the common 2048-bin histogram), [19:9] and [8:0].
constexpr int kL2Shift = 9;                              // level 2: [19:9]
constexpr int kL2Bins = 1 << (kBinShift - kL2Shift);     // 2048
constexpr int kL3Bins = 1 << kL2Shift;                   // level 3: [8:0], 512

// The state the exact levels carry between histogram passes.
struct ExactState {
  uint32_t prefix;  // magnitude bits fixed so far (high digits)
  long long above;  // entries strictly above the prefix's range
  long long k_rem;  // rank still wanted inside the prefix's range
  int done;         // 1: the plan is final (fewer than k qualify, or error)
  int error;        // 1: a deeper level lost the rank (never expected)
};

// Shift of the digit of exact level `level` (1, 2 or 3).
TF_TOPK_HD inline int ExactLevelShift(int level) {
  return level == 1 ? kBinShift : level == 2 ? kL2Shift : 0;
}

// Whether magnitude bits belong to the range level `level` histograms
// (level 1: every qualifying entry; deeper: those matching the prefix).
TF_TOPK_HD inline bool InExactLevel(uint32_t bits, int level,
                                    uint32_t prefix) {
  if (level == 1) return true;
  const int match_shift = ExactLevelShift(level - 1);
  return (bits >> match_shift) == (prefix >> match_shift);
}

// The bin of `bits` in level `level`'s histogram.
TF_TOPK_HD inline int ExactLevelBin(uint32_t bits, int level) {
  const int shift = ExactLevelShift(level);
  const uint32_t mask = level == 3 ? (kL3Bins - 1u) : (kL2Bins - 1u);
  return static_cast<int>((bits >> shift) & mask);
}

// One exact level's plan step from its crossing (FindCrossing* over that
// level's histogram with want = level 1 ? k : state->k_rem). Level 3 leaves
// the exact bits T of the k-th largest magnitude in *plan. Returns true
// when *plan is final.
TF_TOPK_HD inline bool ExactLevelStep(int level, int bin, long long above,
                                      long long total, long long k,
                                      ExactState* state, Plan* plan) {
  if (level == 1) {
    if (bin < 0) {  // fewer than k qualify: select them all
      state->done = 1;
      *plan = SelectAllPlan(total);
      return true;
    }
    state->prefix = static_cast<uint32_t>(bin) << kBinShift;
    state->above = above;
    state->k_rem = k - above;
    return false;
  }
  if (bin < 0) {
    // Impossible (the previous level's bin holds at least k_rem entries).
    // Select what is surely above and report.
    state->error = 1;
    state->done = 1;
    *plan = SelectAllPlan(state->above);
    plan->sure_above = state->prefix | ((1u << ExactLevelShift(level - 1)) - 1u);
    return true;
  }
  const int shift = ExactLevelShift(level);
  state->prefix |= static_cast<uint32_t>(bin) << shift;
  state->above += above;
  state->k_rem -= above;
  if (level < 3) return false;
  state->done = 1;
  plan->bin = static_cast<int>(state->prefix >> kBinShift);
  plan->above = state->above;
  plan->need = state->k_rem;
  plan->sure_above = state->prefix;
  plan->tie_low = state->prefix;
  plan->bin_low = state->prefix;  // empty fill range: ties are all equal
  return true;
}

// Two-sided normal tail P(|X| > t) for X ~ N(mean, stddev^2).
TF_TOPK_HD inline double NormalTwoSidedTail(double t, double mean,
                                            double stddev) {
  const double inv = 1.0 / (stddev * 1.4142135623730951);
  return 0.5 * erfc((t - mean) * inv) + 0.5 * erfc((t + mean) * inv);
}

// ---------------------------------------------------------------------------
// The sampled prefilter (both devices): a deterministic sample of the input
// gives a threshold above which comfortably more than k entries should lie;
// one pass then collects only the entries at or above it (the candidates),
// and the plan is made from the candidates alone, as a histogram of the whole
// input would make it (every bin at or above the threshold's is complete).
// Too few candidates (the sample misled) or too many: the two-pass path runs.

constexpr long long kSampleSize = 32768;
// Inputs smaller than this take the two-pass path: two passes over a small
// input cost less than the sample's scattered reads.
constexpr long long kMinPrefilterSize = 8 * kSampleSize;
// No prefilter when the sample says more than 1/8 of the entries would pass.
constexpr long long kMaxCandidateFraction = 8;

// Index of sample s (0 <= s < kSampleSize) of n >= kSampleSize entries: one
// from each of kSampleSize equal strides, at a pseudo-random offset inside it
// (so periodic structure, such as the rows of a matrix, does not alias).
TF_TOPK_HD inline long long SampleIndex(long long s, long long n) {
  const long long stride = n / kSampleSize;
  uint64_t h = static_cast<uint64_t>(s + 1) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return s * stride + static_cast<long long>(h % static_cast<uint64_t>(stride));
}

// The rank (0-based, descending) of the sampled magnitude that becomes the
// prefilter threshold: twice the expected count of sampled entries among the
// k largest, plus three standard deviations, plus 8, so that "fewer than k
// candidates" is rare. -1: no prefilter (small input, or k too large a part
// of it).
TF_TOPK_HD inline long long PrefilterRank(long long n, long long k) {
  if (n < kMinPrefilterSize || k < 1) return -1;
  const double expected = static_cast<double>(kSampleSize) * k / n;
  const long long rank =
      static_cast<long long>(ceil(2.0 * expected + 3.0 * sqrt(expected) + 8.0));
  if (rank * kMaxCandidateFraction > kSampleSize) return -1;
  return rank;
}

// The GPU's candidate list holds at most this many entries (beyond it, the
// two-pass path runs). Its threshold is the lower edge of the bin of the
// rank-th sampled magnitude, below the CPU's exact sampled magnitude, so it
// allows three times the rank's share of the input plus slack.
TF_TOPK_HD inline long long CandidateCapacity(long long n, long long k) {
  const long long rank = PrefilterRank(n, k);
  if (rank < 0) return 0;
  const long long capacity = 3 * (rank + 1) * (n / kSampleSize + 1) + 4096;
  return capacity < n ? capacity : n;
}

// The gaussian method's refinement: inside the threshold bin [lo, hi) the
// histogram says `in_bin` entries lie and `need` of them are wanted. Fit the
// normal model (mean and standard deviation of the data) to place the
// threshold t so that the model's mass in [t, hi) is need/in_bin of its mass
// in [lo, hi). Where the model has no mass there (heavy tails far beyond the
// fit, or a constant tensor), place t linearly instead.
//
// The threshold is the smallest magnitude bits b in [tie_low, sure_above]
// that satisfy AboveGaussianThreshold (a predicate that is monotone in b).
// The CPU bisects (GaussianTieLow); the CUDA plan kernel searches 256 ways
// at once, one candidate per thread, and lands on the same b.
struct GaussianFit {
  bool refine;    // false: keep the plan's tie_low (whole bin wanted)
  bool normal;    // true: compare normal tails; false: compare values
  double mean;
  double stddev;
  double target;  // normal: the tail P(|X| > t) wanted at the threshold
  double linear;  // linear: the threshold value
};

TF_TOPK_HD inline GaussianFit FitGaussian(const Plan& plan,
                                          const uint32_t* hist,
                                          const Moments& moments) {
  GaussianFit fit{false, false, 0.0, 0.0, 0.0, 0.0};
  if (plan.bin < 0 || plan.need <= 0) return fit;
  const long long in_bin = hist[plan.bin];
  if (plan.need >= in_bin) return fit;  // the whole bin is wanted
  fit.refine = true;
  const double fraction = static_cast<double>(plan.need) / in_bin;
  const double lo = FloatFromBits(plan.tie_low);
  // The top finite bin ends at +Inf: take its largest finite value instead,
  // so the arithmetic below never meets Inf - Inf.
  const uint32_t hi_bits = plan.sure_above + 1u >= kInfBits
                               ? plan.sure_above
                               : plan.sure_above + 1u;
  const double hi = FloatFromBits(hi_bits);
  fit.linear = hi - fraction * (hi - lo);
  if (moments.count > 1) {
    const double mean = moments.sum / moments.count;
    const double var = moments.sum_squares / moments.count - mean * mean;
    const double stddev = var > 0.0 ? sqrt(var) : 0.0;
    if (stddev > 0.0) {
      const double tail_lo = NormalTwoSidedTail(lo, mean, stddev);
      const double tail_hi = NormalTwoSidedTail(hi, mean, stddev);
      const double mass = tail_lo - tail_hi;
      if (mass > 1e-300 && mass == mass) {
        fit.normal = true;
        fit.mean = mean;
        fit.stddev = stddev;
        fit.target = tail_hi + fraction * mass;
      }
    }
  }
  return fit;
}

// Whether magnitude bits b lie at or above the fitted threshold.
TF_TOPK_HD inline bool AboveGaussianThreshold(const GaussianFit& fit,
                                              uint32_t bits) {
  const double t = FloatFromBits(bits);
  return fit.normal ? NormalTwoSidedTail(t, fit.mean, fit.stddev) <= fit.target
                    : t >= fit.linear;
}

// The threshold's magnitude bits, in [plan.tie_low, plan.sure_above]: the
// smallest b there that is AboveGaussianThreshold (sure_above when none is).
TF_TOPK_HD inline uint32_t GaussianTieLow(const Plan& plan,
                                          const uint32_t* hist,
                                          const Moments& moments) {
  const GaussianFit fit = FitGaussian(plan, hist, moments);
  if (!fit.refine) return plan.tie_low;
  uint32_t low = plan.tie_low, high = plan.sure_above;  // answer in [low, high]
  while (low < high) {
    const uint32_t mid = low + (high - low) / 2u;
    if (AboveGaussianThreshold(fit, mid)) {
      high = mid;
    } else {
      low = mid + 1u;
    }
  }
  return low;
}

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_TOPK_COMMON_H_
