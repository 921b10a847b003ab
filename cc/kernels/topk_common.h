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
//                   fewer than k of them); entries in [tie_low, sure_above]
//                   fill the remaining `need` slots.
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
  long long above;      // number of entries with bits > sure_above (< k)
  long long need;       // slots left for the tie range: k - above
  int bin;              // the threshold bin (-1: fewer than k qualify)
};

// Where the k-th largest magnitude lies in a 2048-bin histogram of the
// qualifying entries. When fewer than k entries qualify, every qualifying
// entry is selected (bin = -1, sure_above = 0, need = 0).
TF_TOPK_HD inline Plan PlanFromHistogram(const uint32_t* hist, long long k) {
  Plan plan;
  long long above = 0;
  for (int b = kNumBins - 1; b >= 0; --b) {
    const long long in_bin = hist[b];
    if (above + in_bin >= k && k > 0) {
      plan.bin = b;
      plan.above = above;
      plan.need = k - above;
      plan.sure_above = ((static_cast<uint32_t>(b) + 1u) << kBinShift) - 1u;
      plan.tie_low = static_cast<uint32_t>(b) << kBinShift;
      return plan;
    }
    above += in_bin;
  }
  plan.bin = -1;
  plan.above = above;
  plan.need = 0;
  plan.sure_above = 0u;
  plan.tie_low = 1u;  // empty tie range
  return plan;
}

// Two-sided normal tail P(|X| > t) for X ~ N(mean, stddev^2).
TF_TOPK_HD inline double NormalTwoSidedTail(double t, double mean,
                                            double stddev) {
  const double inv = 1.0 / (stddev * 1.4142135623730951);
  return 0.5 * erfc((t - mean) * inv) + 0.5 * erfc((t + mean) * inv);
}

// The gaussian method's refinement: inside the threshold bin [lo, hi) the
// histogram says `in_bin` entries lie and `need` of them are wanted. Fit the
// normal model (mean and standard deviation of the data) to place the
// threshold t so that the model's mass in [t, hi) is need/in_bin of its mass
// in [lo, hi). Where the model has no mass there (heavy tails far beyond the
// fit, or a constant tensor), interpolate linearly instead. Returns the
// magnitude bits of t, a value in [lo, hi].
TF_TOPK_HD inline uint32_t GaussianTieLow(const Plan& plan,
                                          const uint32_t* hist,
                                          const Moments& moments) {
  if (plan.bin < 0 || plan.need <= 0) return plan.tie_low;
  const long long in_bin = hist[plan.bin];
  if (plan.need >= in_bin) return plan.tie_low;  // the whole bin is wanted
  const double fraction = static_cast<double>(plan.need) / in_bin;
  const double lo = FloatFromBits(plan.tie_low);
  const double hi = FloatFromBits(plan.sure_above + 1u);  // may be +Inf bits
  double t = hi - fraction * (hi - lo);                    // linear fallback
  if (moments.count > 1) {
    const double mean = moments.sum / moments.count;
    double var = moments.sum_squares / moments.count - mean * mean;
    const double stddev = var > 0.0 ? sqrt(var) : 0.0;
    if (stddev > 0.0 && hi < 3.0e38) {
      const double tail_lo = NormalTwoSidedTail(lo, mean, stddev);
      const double tail_hi = NormalTwoSidedTail(hi, mean, stddev);
      const double mass = tail_lo - tail_hi;
      if (mass > 1e-300 && mass == mass) {
        const double target = tail_hi + fraction * mass;
        double a = lo, b = hi;  // tail is decreasing in t: bisect
        for (int i = 0; i < 48; ++i) {
          const double mid = 0.5 * (a + b);
          if (NormalTwoSidedTail(mid, mean, stddev) > target) {
            a = mid;
          } else {
            b = mid;
          }
        }
        t = 0.5 * (a + b);
      }
    }
  }
  uint32_t bits = MagnitudeBits(static_cast<float>(t));
  if (bits < plan.tie_low) bits = plan.tie_low;
  if (bits > plan.sure_above) bits = plan.sure_above;
  return bits;
}

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_TOPK_COMMON_H_
