// A CPU emulation of the CUDA selection (cc/kernels/approx_topk.cuh), built
// from the same arithmetic (topk_common.h), so the GPU algorithm's plan and
// slot counts are tested on every CI run, on machines without a GPU.
//
// It follows the kernels step by step: the level-1 histogram and moments of
// the float32 keys the kernels compute, the plan (the serial crossing, which
// debug builds of the kernels check the parallel one against; the exact
// radix levels; the normal fit), one compaction pass with the kernels'
// counters and caps, and the finish step. The entries go through the
// compaction in index order, one of the orders the GPU's atomics allow.
//
// Build (tests/test_gpu_emulation.py does this):
//   g++ -O2 -std=c++17 -shared -fPIC -I cc/kernels cc/emulation/gpu_emulation.cc
#include <cstdint>
#include <cstring>
#include <vector>

#include "topk_common.h"

namespace {

using tf_topk::EntryClass;
using tf_topk::Plan;

// IEEE half bits to float, exactly (subnormals, Inf and NaN included), as
// __half2float does on the device.
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {  // Inf or NaN
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // zero
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      mantissa <<= 1;
      ++e;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | ((112u - e) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return tf_topk::FloatFromBits(bits);
}

enum Dtype { kFloat32 = 0, kFloat16 = 1, kBfloat16 = 2 };

struct Input {
  const void* data;
  int dtype;
  uint32_t Raw(int64_t i) const {
    if (dtype == kFloat32) return static_cast<const uint32_t*>(data)[i];
    return static_cast<const uint16_t*>(data)[i];
  }
  // The float the kernels convert an entry to (Traits<T>::ToFloat).
  float Value(int64_t i) const {
    const uint32_t raw = Raw(i);
    if (dtype == kFloat32) return tf_topk::FloatFromBits(raw);
    if (dtype == kBfloat16) return tf_topk::FloatFromBits(raw << 16);
    return HalfToFloat(static_cast<uint16_t>(raw));
  }
  uint32_t Key(int64_t i) const { return tf_topk::MagnitudeBits(Value(i)); }
};

// PlanGaussianKernel: histogram level 1 with moments, crossing, normal fit.
Plan PlanGaussian(const Input& x, int64_t n, long long k) {
  std::vector<uint32_t> hist(tf_topk::kNumBins, 0u);
  tf_topk::Moments moments{0.0, 0.0, 0};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = x.Key(i);
    if (!tf_topk::Qualifies(key)) continue;
    ++hist[tf_topk::BinOf(key)];
    const double d = x.Value(i);
    moments.sum += d;
    moments.sum_squares += d * d;
    moments.count += 1;
  }
  long long above, total;
  const int bin = tf_topk::FindCrossingSerial(hist.data(), tf_topk::kNumBins, k,
                                              &above, &total);
  Plan plan = bin >= 0 ? tf_topk::PlanForBin(bin, above, k)
                       : tf_topk::SelectAllPlan(total);
  plan.tie_low = tf_topk::GaussianTieLow(plan, hist.data(), moments);
  return plan;
}

// HistogramKernel<level> + PlanExactKernel<level> for levels 1 to 3.
Plan PlanExact(const Input& x, int64_t n, long long k, int* error) {
  tf_topk::ExactState state{0u, 0, 0, 0, 0};
  Plan plan = tf_topk::SelectAllPlan(0);
  for (int level = 1; level <= 3; ++level) {
    const int bins = level == 3 ? tf_topk::kL3Bins
                                : (level == 1 ? tf_topk::kNumBins
                                              : tf_topk::kL2Bins);
    std::vector<uint32_t> hist(bins, 0u);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t key = x.Key(i);
      if (!tf_topk::Qualifies(key) ||
          !tf_topk::InExactLevel(key, level, state.prefix)) {
        continue;
      }
      ++hist[tf_topk::ExactLevelBin(key, level)];
    }
    const long long want = level == 1 ? k : state.k_rem;
    long long above, total;
    const int bin =
        tf_topk::FindCrossingSerial(hist.data(), bins, want, &above, &total);
    if (tf_topk::ExactLevelStep(level, bin, above, total, k, &state, &plan)) {
      break;
    }
  }
  *error = state.error;
  return plan;
}

}  // namespace

extern "C" {

// Selects k of the n entries at `x` (raw bits: float32, float16 or bfloat16
// by `dtype` 0/1/2) with `method` (0 gaussian, 1 exact) as the CUDA kernels
// do. Writes values[0:k] (raw bits, widened to 32) and indices[0:k], and
// state[0:10]: above, need, sure_count, tie_count, fill_count, filled slots,
// error (0 ok, 1 exact level lost the rank, 2 a sure slot >= k), bin,
// tie_low, sure_above. Returns 0, or -1 for bad arguments.
int tf_topk_emulate_gpu_select(const void* x, int dtype, long long n,
                               long long k, int method, uint32_t* values,
                               int32_t* indices, long long* state) {
  if (x == nullptr || values == nullptr || indices == nullptr ||
      state == nullptr || dtype < 0 || dtype > 2 || n < 1 || k < 1 || k > n ||
      (method != 0 && method != 1)) {
    return -1;
  }
  const Input input{x, dtype};
  int error = 0;
  const Plan plan = method == 0 ? PlanGaussian(input, n, k)
                                : PlanExact(input, n, k, &error);

  // CompactKernel.
  const unsigned long long need =
      plan.need > 0 ? static_cast<unsigned long long>(plan.need) : 0ull;
  unsigned long long sure_counter = 0, tie_counter = 0, fill_counter = 0;
  std::vector<int32_t> fill_list(static_cast<size_t>(k));
  for (int64_t i = 0; i < n; ++i) {
    const EntryClass c = tf_topk::Classify(input.Key(i), plan.sure_above,
                                           plan.tie_low, plan.bin_low);
    if (c == EntryClass::kSure) {
      const unsigned long long slot = sure_counter++;
      if (slot < static_cast<unsigned long long>(k)) {
        values[slot] = input.Raw(i);
        indices[slot] = static_cast<int32_t>(i);
      } else {
        error = 2;
      }
    } else if (c == EntryClass::kTie) {
      const unsigned long long t = tie_counter++;
      if (t < need) {
        values[plan.above + t] = input.Raw(i);
        indices[plan.above + t] = static_cast<int32_t>(i);
      }
    } else if (c == EntryClass::kFill) {
      const unsigned long long f = fill_counter++;
      if (f < need) fill_list[f] = static_cast<int32_t>(i);
    }
  }

  // FinishKernel.
  const long long need_slots = plan.need > 0 ? plan.need : 0;
  const long long fills =
      tf_topk::FillCount(need_slots, tie_counter, fill_counter);
  const long long first_fill =
      plan.above + tf_topk::TiesTaken(need_slots, tie_counter);
  for (long long slot = first_fill; slot < k; ++slot) {
    if (slot < first_fill + fills) {
      const int32_t index = fill_list[slot - first_fill];
      values[slot] = input.Raw(index);
      indices[slot] = index;
    } else {
      values[slot] = 0u;
      indices[slot] = 0;
    }
  }
  const long long out[] = {plan.above,
                           plan.need,
                           static_cast<long long>(sure_counter),
                           static_cast<long long>(tie_counter),
                           static_cast<long long>(fill_counter),
                           first_fill + fills,
                           error,
                           plan.bin,
                           plan.tie_low,
                           plan.sure_above};
  std::memcpy(state, out, sizeof(out));
  return 0;
}

}  // extern "C"
