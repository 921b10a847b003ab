// A CPU emulation of the CUDA selection (cc/kernels/approx_topk.cuh), built
// from the same arithmetic (topk_common.h), so the GPU algorithm's plan and
// slot counts are tested on every CI run, on machines without a GPU.
//
// It follows the kernels step by step on the float32 keys they compute: the
// sample and its prefilter threshold, the pass collecting the candidates (or
// the level-1 histogram and moments of all of x), the fallback when the
// candidates do not suffice, the plan (the serial crossing, which debug
// builds of the kernels check the parallel one against; the exact radix
// levels; the normal fit), one compaction pass with the kernels' counters and
// caps, and the finish step. Candidates and entries go through in index
// order, one of the orders the GPU's atomics allow.
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

// The entries a pass reads: all of x, or the candidate list.
struct Source {
  const Input* input;
  int64_t n;
  const std::vector<int64_t>* candidates;  // nullptr: all of x
  int64_t size() const {
    return candidates ? static_cast<int64_t>(candidates->size()) : n;
  }
  int64_t Index(int64_t i) const { return candidates ? (*candidates)[i] : i; }
};

// Level-1 histogram (and moments) of the qualifying entries of a source.
tf_topk::Moments Histogram1(const Source& source, uint32_t* hist) {
  tf_topk::Moments moments{0.0, 0.0, 0};
  for (int64_t i = 0; i < source.size(); ++i) {
    const int64_t index = source.Index(i);
    const uint32_t key = source.input->Key(index);
    if (!tf_topk::Qualifies(key)) continue;
    ++hist[tf_topk::BinOf(key)];
    const double d = source.input->Value(index);
    moments.sum += d;
    moments.sum_squares += d * d;
    moments.count += 1;
  }
  return moments;
}

// What the kernels before the compaction leave in the scratch state.
struct Emulated {
  Plan plan;
  uint32_t prefilter_key = 0u;
  long long candidate_count = 0;
  bool use_candidates = false;
  bool fallback = false;
  int error = 0;
  std::vector<int64_t> candidates;  // the kept candidate list, index order
};

// SampleKernel: the prefilter threshold (0: none) and the sample's moments.
uint32_t SampleThreshold(const Input& x, int64_t n, long long k,
                         tf_topk::Moments* moments) {
  *moments = tf_topk::Moments{0.0, 0.0, 0};
  const long long rank = tf_topk::PrefilterRank(n, k);
  if (rank < 0) return 0u;
  std::vector<uint32_t> hist(tf_topk::kNumBins, 0u);
  for (long long s = 0; s < tf_topk::kSampleSize; ++s) {
    const int64_t index = tf_topk::SampleIndex(s, n);
    const uint32_t key = x.Key(index);
    if (!tf_topk::Qualifies(key)) continue;
    ++hist[tf_topk::BinOf(key)];
    const double d = x.Value(index);
    moments->sum += d;
    moments->sum_squares += d * d;
    moments->count += 1;
  }
  long long above, total;
  const int bin = tf_topk::FindCrossingSerial(hist.data(), tf_topk::kNumBins,
                                              rank + 1, &above, &total);
  const uint32_t key = bin >= 0 ? static_cast<uint32_t>(bin) << tf_topk::kBinShift : 0u;
  return tf_topk::Qualifies(key) ? key : 0u;
}

// CollectKernel: the candidates at or above the threshold, in index order,
// kept up to `capacity`; their histogram.
void Collect(const Input& x, int64_t n, long long capacity, Emulated* e,
             uint32_t* hist) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = x.Key(i);
    if (!tf_topk::Qualifies(key) || key < e->prefilter_key) continue;
    ++hist[tf_topk::BinOf(key)];
    if (e->candidate_count++ < capacity) e->candidates.push_back(i);
  }
}

// Level 1 of either method: the first pass (collect, or all of x), the
// crossing, and the fallback when the candidates do not suffice. Returns the
// crossing over the histogram the plan is made from (*hist).
int Level1(const Input& x, int64_t n, long long k, long long capacity,
           Emulated* e, std::vector<uint32_t>* hist, tf_topk::Moments* moments,
           long long* above, long long* total) {
  tf_topk::Moments sample_moments;
  hist->assign(tf_topk::kNumBins, 0u);
  const Source all{&x, n, nullptr};
  if (capacity > 0) {  // the prefilter's kernels run
    e->prefilter_key = SampleThreshold(x, n, k, &sample_moments);
    if (e->prefilter_key != 0u) Collect(x, n, capacity, e, hist->data());
    const int bin = tf_topk::FindCrossingSerial(hist->data(), tf_topk::kNumBins,
                                                k, above, total);
    if (e->prefilter_key != 0u && bin >= 0 &&
        e->candidate_count <= capacity) {  // CandidatesSuffice
      e->use_candidates = true;
      *moments = sample_moments;
      return bin;
    }
    e->fallback = true;
    hist->assign(tf_topk::kNumBins, 0u);
  }
  *moments = Histogram1(all, hist->data());
  return tf_topk::FindCrossingSerial(hist->data(), tf_topk::kNumBins, k, above,
                                     total);
}

// PlanGaussianKernel (first call, or the fallback one).
Emulated PlanGaussian(const Input& x, int64_t n, long long k, long long capacity) {
  Emulated e;
  std::vector<uint32_t> hist;
  tf_topk::Moments moments;
  long long above, total;
  const int bin = Level1(x, n, k, capacity, &e, &hist, &moments, &above, &total);
  e.plan = bin >= 0 ? tf_topk::PlanForBin(bin, above, k)
                    : tf_topk::SelectAllPlan(total);
  e.plan.tie_low = tf_topk::GaussianTieLow(e.plan, hist.data(), moments);
  return e;
}

// PlanExactKernel levels 1 to 3, levels 2 and 3 over the candidates when
// level 1 planned from them.
Emulated PlanExact(const Input& x, int64_t n, long long k, long long capacity) {
  Emulated e;
  std::vector<uint32_t> hist;
  tf_topk::Moments moments;
  long long above, total;
  tf_topk::ExactState state{0u, 0, 0, 0, 0};
  e.plan = tf_topk::SelectAllPlan(0);
  int bin = Level1(x, n, k, capacity, &e, &hist, &moments, &above, &total);
  const Source source{&x, n, e.use_candidates ? &e.candidates : nullptr};
  for (int level = 1; level <= 3; ++level) {
    if (level > 1) {
      const int bins = level == 3 ? tf_topk::kL3Bins : tf_topk::kL2Bins;
      hist.assign(bins, 0u);
      for (int64_t i = 0; i < source.size(); ++i) {
        const uint32_t key = x.Key(source.Index(i));
        if (!tf_topk::Qualifies(key) ||
            !tf_topk::InExactLevel(key, level, state.prefix)) {
          continue;
        }
        ++hist[tf_topk::ExactLevelBin(key, level)];
      }
      bin = tf_topk::FindCrossingSerial(hist.data(), bins, state.k_rem, &above,
                                        &total);
    }
    if (tf_topk::ExactLevelStep(level, bin, above, total, k, &state, &e.plan)) {
      break;
    }
  }
  e.error = state.error;
  return e;
}

}  // namespace

extern "C" {

// Selects k of the n entries at `x` (raw bits: float32, float16 or bfloat16
// by `dtype` 0/1/2) with `method` (0 gaussian, 1 exact) as the CUDA kernels
// do. `capacity`: the candidate list's size (-1: CandidateCapacity(n, k), as
// the kernels; 0: no prefilter). Writes values[0:k] (raw bits, widened to
// 32) and indices[0:k], and state[0:14]: above, need, sure_count, tie_count,
// fill_count, filled slots, error (0 ok, 1 exact level lost the rank, 2 a
// sure slot >= k), bin, tie_low, sure_above, prefilter_key, candidate_count,
// use_candidates, fallback. Returns 0, or -1 for bad arguments.
int tf_topk_emulate_gpu_select(const void* x, int dtype, long long n,
                               long long k, int method, long long capacity,
                               uint32_t* values, int32_t* indices,
                               long long* state) {
  if (x == nullptr || values == nullptr || indices == nullptr ||
      state == nullptr || dtype < 0 || dtype > 2 || n < 1 || k < 1 || k > n ||
      (method != 0 && method != 1) || capacity < -1) {
    return -1;
  }
  if (capacity == -1) capacity = tf_topk::CandidateCapacity(n, k);
  const Input input{x, dtype};
  Emulated e = method == 0 ? PlanGaussian(input, n, k, capacity)
                           : PlanExact(input, n, k, capacity);
  const Plan& plan = e.plan;
  const Source source{&input, n, e.use_candidates ? &e.candidates : nullptr};

  // CompactKernel.
  int error = e.error;
  const unsigned long long need =
      plan.need > 0 ? static_cast<unsigned long long>(plan.need) : 0ull;
  unsigned long long sure_counter = 0, tie_counter = 0, fill_counter = 0;
  std::vector<int32_t> fill_list(static_cast<size_t>(k));
  for (int64_t i = 0; i < source.size(); ++i) {
    const int64_t index = source.Index(i);
    const EntryClass c = tf_topk::Classify(input.Key(index), plan.sure_above,
                                           plan.tie_low, plan.bin_low);
    if (c == EntryClass::kSure) {
      const unsigned long long slot = sure_counter++;
      if (slot < static_cast<unsigned long long>(k)) {
        values[slot] = input.Raw(index);
        indices[slot] = static_cast<int32_t>(index);
      } else {
        error = 2;
      }
    } else if (c == EntryClass::kTie) {
      const unsigned long long t = tie_counter++;
      if (t < need) {
        values[plan.above + t] = input.Raw(index);
        indices[plan.above + t] = static_cast<int32_t>(index);
      }
    } else if (c == EntryClass::kFill) {
      const unsigned long long f = fill_counter++;
      if (f < need) fill_list[f] = static_cast<int32_t>(index);
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
                           plan.sure_above,
                           e.prefilter_key,
                           e.candidate_count,
                           e.use_candidates ? 1 : 0,
                           e.fallback ? 1 : 0};
  std::memcpy(state, out, sizeof(out));
  return 0;
}

// SampleIndex, for tests that place data where the sample looks.
long long tf_topk_sample_index(long long s, long long n) {
  return tf_topk::SampleIndex(s, n);
}

}  // extern "C"
