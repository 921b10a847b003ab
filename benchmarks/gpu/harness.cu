// Standalone C entry points around the ops' CUDA kernels (no TensorFlow), so
// benchmarks/gpu_check.py can check and time the exact code the TF ops run,
// on device memory owned by PyTorch. Build (gpu_check.py does this):
//
//   nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -arch=sm_90 \
//        benchmarks/gpu/harness.cu -o libtf_topk_harness.so
//
// Pointers are device pointers; `stream` is a cudaStream_t (0: the legacy
// default stream). Every select call returns a cudaError_t as int (0: ok).
//
// The fused error-feedback selection (cc/kernels/error_feedback.cuh) has its
// own entry points (tf_topk_error_feedback_*, with its optional magnitude
// profile) and a self-contained check with a host reference and timings
// (tf_topk_error_feedback_check, no PyTorch needed), which the same file
// builds as a program:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -DTF_TOPK_HARNESS_MAIN benchmarks/gpu/harness.cu -o tf_topk_harness
//   ./tf_topk_harness [--no-timing | --small]    # exit status 0: every check passed
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../cc/kernels/approx_topk.cuh"
#include "../../cc/kernels/error_feedback.cuh"

namespace {

template <typename T>
int Select(const void* x, long long n, long long k, int method, void* values,
           void* indices, void* scratch, void* stream) {
  if (method != static_cast<int>(tf_topk::Method::kGaussian) &&
      method != static_cast<int>(tf_topk::Method::kExact)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(tf_topk::cuda::LaunchApproxTopK<T>(
      static_cast<const T*>(x), static_cast<int64_t>(n),
      static_cast<int64_t>(k), static_cast<tf_topk::Method>(method),
      static_cast<T*>(values), static_cast<int32_t*>(indices), scratch,
      static_cast<cudaStream_t>(stream)));
}

template <typename T>
int ErrorFeedback(const void* gradient, const void* residual, long long n,
                  long long k, int method, void* values, void* indices,
                  void* remaining, void* stats, void* profile, void* scratch,
                  void* stream) {
  if (method != static_cast<int>(tf_topk::Method::kGaussian) &&
      method != static_cast<int>(tf_topk::Method::kExact)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(tf_topk::cuda::LaunchErrorFeedbackTopK<T>(
      static_cast<const T*>(gradient), static_cast<const float*>(residual),
      static_cast<int64_t>(n), static_cast<int64_t>(k),
      static_cast<tf_topk::Method>(method), static_cast<float*>(values),
      static_cast<int32_t*>(indices), static_cast<float*>(remaining),
      static_cast<double*>(stats), static_cast<double*>(profile), scratch,
      static_cast<cudaStream_t>(stream)));
}

// The gradient's element type, as the tf_topk_error_feedback_* suffixes.
enum Dtype : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

int ErrorFeedbackAnyDtype(int dtype, const void* gradient, const void* residual,
                          long long n, long long k, int method, void* values,
                          void* indices, void* remaining, void* stats,
                          void* profile, void* scratch, void* stream) {
  switch (dtype) {
    case kF32:
      return ErrorFeedback<float>(gradient, residual, n, k, method, values,
                                  indices, remaining, stats, profile, scratch,
                                  stream);
    case kF16:
      return ErrorFeedback<__half>(gradient, residual, n, k, method, values,
                                   indices, remaining, stats, profile, scratch,
                                   stream);
    case kBF16:
      return ErrorFeedback<__nv_bfloat16>(gradient, residual, n, k, method,
                                          values, indices, remaining, stats,
                                          profile, scratch, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

namespace {
// ---------------------------------------------------------------------------
// The error-feedback check (tf_topk_error_feedback_check): random gradient and
// residual, the fused launch, and a host reference of everything it returns:
//   selection  the first min(k, qualifying) slots hold distinct indices and
//              the accumulated value there, bit for bit; the other slots
//              value 0, index 0. Every entry above the threshold bin of the
//              k-th largest magnitude is selected and none below it (exact:
//              above and below the k-th largest magnitude itself). Against
//              LaunchApproxTopK on a copy of the host's accumulated buffer
//              the sets may differ only inside that bin (exact: among
//              entries equal to the k-th), where the choice among tied
//              entries is not deterministic: those differences are counted
//              and printed, not failed;
//   remaining  0 at the selected entries, accumulated elsewhere (bit for bit;
//              NaN for NaN);
//   stats      double sums on the host; relative 1e-4 (stats[1], a
//              difference of sums the size of stats[0], relative to at
//              least 1% of stats[0]); the non-finite count exactly;
//   profile    (the cases marked so; the buffer is filled with NaN first,
//              so the launcher's zeroing is checked too) per magnitude bin,
//              the count of the qualifying (finite, non-zero) accumulated
//              entries exactly and their sum of squares relative 1e-4,
//              against double sums on the host.
// Then, with timing, two lines per density and method: the fused op
// (float32 and half gradient) against LaunchApproxTopK alone and a plain
// copy pass, n = 25M; and the fused op with the profile on, against without.
namespace check {

constexpr long long kTimingN = 25000000;

const char* DtypeName(int dtype) {
  return dtype == kF16 ? "f16" : dtype == kBF16 ? "bf16" : "f32";
}

size_t DtypeBytes(int dtype) { return dtype == kF32 ? 4 : 2; }

// What the inputs hold besides normal values.
enum Special : int {
  kPlain = 0,       // N(0, 1) gradient + N(0, 0.5^2) residual
  kNonFinite = 1,   // plus NaN, +-Inf and exact zeros sprinkled in
  kMostlyZero = 2,  // three accumulated entries in four exactly 0: < k qualify
  kWideRange = 3,   // float32 only: each entry scaled by 2^u, u in [-149, 40]
};

struct Case {
  long long n;
  long long k;
  int dtype;  // the gradient's
  tf_topk::Method method;
  bool in_place;  // remaining is the residual buffer
  int offset;     // entries every buffer starts past an aligned address
  int special;
  bool profile;   // ask for the profile, and check it
};

std::string Describe(const Case& c) {
  char text[200];
  snprintf(text, sizeof(text), "n=%lld k=%lld %s gradient, %s%s%s%s%s", c.n,
           c.k, DtypeName(c.dtype),
           c.method == tf_topk::Method::kExact ? "exact" : "gaussian",
           c.in_place ? ", in place" : "", c.offset != 0 ? ", misaligned" : "",
           c.special == kNonFinite    ? ", non-finite entries"
           : c.special == kMostlyZero ? ", mostly zero"
           : c.special == kWideRange  ? ", wide range"
                                      : "",
           c.profile ? ", profile" : "");
  return text;
}

// Prints a failure of case c; returns 1 (a failure to count).
int Fail(const Case& c, const char* format, ...) {
  va_list args;
  va_start(args, format);
  printf("FAIL %s: ", Describe(c).c_str());
  vprintf(format, args);
  printf("\n");
  va_end(args);
  return 1;
}

#define TF_TOPK_CHECK_CUDA(expr)                                          \
  do {                                                                    \
    const cudaError_t check_err_ = (expr);                                \
    if (check_err_ != cudaSuccess) {                                      \
      printf("CUDA error %s (%s) at %s:%d: %s\n",                         \
             cudaGetErrorName(check_err_), cudaGetErrorString(check_err_), \
             __FILE__, __LINE__, #expr);                                  \
      return false;                                                       \
    }                                                                     \
  } while (0)

// Device memory freed when it goes out of scope.
struct DeviceBuffer {
  void* ptr = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  cudaError_t Allocate(size_t bytes) {
    return cudaMalloc(&ptr, bytes > 0 ? bytes : 1);
  }
  // The address `entries` elements of T past the start.
  template <typename T>
  T* At(size_t entries = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(ptr) + entries * sizeof(T));
  }
};

// Host inputs and the reference accumulated = float(gradient) + residual.
struct Inputs {
  std::vector<float> gradient;       // float32, or the 16-bit values as float
  std::vector<uint16_t> gradient16;  // the bits of a 16-bit gradient
  std::vector<float> residual;
  std::vector<float> accumulated;
};

// x rounded to `dtype`: its float value, and its bits in *bits (16-bit types).
float RoundTo(int dtype, float x, uint16_t* bits) {
  if (dtype == kF16) {
    const __half h = __float2half_rn(x);
    std::memcpy(bits, &h, sizeof(*bits));
    return __half2float(h);
  }
  if (dtype == kBF16) {
    const __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(bits, &h, sizeof(*bits));
    return __bfloat162float(h);
  }
  return x;
}

Inputs MakeInputs(const Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // kWideRange: subnormals to 2^40 (squares stay far from float32's limits,
  // so the float partial sums of the stats stay exact enough).
  std::uniform_int_distribution<int> exponent(-149, 40);
  const float kNonFiniteValues[] = {NAN, INFINITY, -INFINITY};
  const size_t n = static_cast<size_t>(c.n);
  Inputs in;
  in.gradient.resize(n);
  in.gradient16.resize(c.dtype == kF32 ? 0 : n);
  in.residual.resize(n);
  in.accumulated.resize(n);
  uint16_t unused = 0;
  for (size_t i = 0; i < n; ++i) {
    float g = normal(rng);
    float r = 0.5f * normal(rng);
    if (c.special == kWideRange) {
      const int u = exponent(rng);
      g = std::ldexp(g, u);
      r = std::ldexp(r, u);
    }
    if (c.special == kNonFinite && i % 9973 == 17) {
      g = kNonFiniteValues[(i / 9973) % 3];
    }
    g = RoundTo(c.dtype, g, c.dtype == kF32 ? &unused : &in.gradient16[i]);
    // Exact zeros: never selected (with an infinite gradient: NaN).
    if ((c.special == kNonFinite && i % 7919 == 5) ||
        (c.special == kMostlyZero && i % 4 != 0)) {
      r = -g;
    }
    in.gradient[i] = g;
    in.residual[i] = r;
    in.accumulated[i] = g + r;  // float addition, as on the device
  }
  return in;
}

// What the device returned: the fused op's outputs, and the selection of
// LaunchApproxTopK alone on the host's accumulated buffer.
struct Outputs {
  std::vector<float> values;
  std::vector<int32_t> indices;
  std::vector<float> remaining;
  double stats[tf_topk::cuda::kNumStats] = {};
  std::vector<double> profile;  // kProfileRows * kNumBins, when asked for
  std::vector<float> alone_values;
  std::vector<int32_t> alone_indices;
};

bool RunOnDevice(const Case& c, const Inputs& in, Outputs* out) {
  const size_t n = static_cast<size_t>(c.n), k = static_cast<size_t>(c.k);
  const size_t off = static_cast<size_t>(c.offset);
  const size_t gradient_bytes = DtypeBytes(c.dtype);
  constexpr size_t kProfileEntries =
      static_cast<size_t>(tf_topk::cuda::kProfileRows) * tf_topk::kNumBins;
  DeviceBuffer gradient, residual, remaining, values, indices, stats, profile,
      scratch;
  TF_TOPK_CHECK_CUDA(gradient.Allocate((n + off) * gradient_bytes));
  TF_TOPK_CHECK_CUDA(residual.Allocate((n + off) * sizeof(float)));
  if (!c.in_place) TF_TOPK_CHECK_CUDA(remaining.Allocate((n + off) * sizeof(float)));
  TF_TOPK_CHECK_CUDA(values.Allocate(k * sizeof(float)));
  TF_TOPK_CHECK_CUDA(indices.Allocate(k * sizeof(int32_t)));
  TF_TOPK_CHECK_CUDA(stats.Allocate(sizeof(out->stats)));
  if (c.profile) {
    TF_TOPK_CHECK_CUDA(profile.Allocate(kProfileEntries * sizeof(double)));
    // All-ones bytes: NaN doubles, which the launcher must clear.
    TF_TOPK_CHECK_CUDA(
        cudaMemset(profile.ptr, 0xff, kProfileEntries * sizeof(double)));
  }
  TF_TOPK_CHECK_CUDA(
      scratch.Allocate(tf_topk::cuda::ErrorFeedbackScratchBytes(c.n, c.k)));
  const void* host_gradient = c.dtype == kF32
                                  ? static_cast<const void*>(in.gradient.data())
                                  : static_cast<const void*>(in.gradient16.data());
  void* device_gradient = static_cast<char*>(gradient.ptr) + off * gradient_bytes;
  float* device_residual = residual.At<float>(off);
  float* device_remaining = c.in_place ? device_residual : remaining.At<float>(off);
  TF_TOPK_CHECK_CUDA(cudaMemcpy(device_gradient, host_gradient,
                                n * gradient_bytes, cudaMemcpyHostToDevice));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(device_residual, in.residual.data(),
                                n * sizeof(float), cudaMemcpyHostToDevice));
  TF_TOPK_CHECK_CUDA(static_cast<cudaError_t>(ErrorFeedbackAnyDtype(
      c.dtype, device_gradient, device_residual, c.n, c.k,
      static_cast<int>(c.method), values.ptr, indices.ptr, device_remaining,
      stats.ptr, profile.ptr, scratch.ptr, nullptr)));
  TF_TOPK_CHECK_CUDA(cudaDeviceSynchronize());
  out->values.resize(k);
  out->indices.resize(k);
  out->remaining.resize(n);
  TF_TOPK_CHECK_CUDA(cudaMemcpy(out->values.data(), values.ptr,
                                k * sizeof(float), cudaMemcpyDeviceToHost));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(out->indices.data(), indices.ptr,
                                k * sizeof(int32_t), cudaMemcpyDeviceToHost));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(out->remaining.data(), device_remaining,
                                n * sizeof(float), cudaMemcpyDeviceToHost));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(out->stats, stats.ptr, sizeof(out->stats),
                                cudaMemcpyDeviceToHost));
  if (c.profile) {
    out->profile.resize(kProfileEntries);
    TF_TOPK_CHECK_CUDA(cudaMemcpy(out->profile.data(), profile.ptr,
                                  kProfileEntries * sizeof(double),
                                  cudaMemcpyDeviceToHost));
  }
  if (k == 0) return true;
  // The selection alone, on the accumulated buffer the host computed.
  DeviceBuffer accumulated;
  TF_TOPK_CHECK_CUDA(accumulated.Allocate(n * sizeof(float)));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(accumulated.ptr, in.accumulated.data(),
                                n * sizeof(float), cudaMemcpyHostToDevice));
  TF_TOPK_CHECK_CUDA(tf_topk::cuda::LaunchApproxTopK<float>(
      accumulated.At<float>(), c.n, c.k, c.method, values.At<float>(),
      indices.At<int32_t>(), scratch.ptr, nullptr));
  TF_TOPK_CHECK_CUDA(cudaDeviceSynchronize());
  out->alone_values.resize(k);
  out->alone_indices.resize(k);
  TF_TOPK_CHECK_CUDA(cudaMemcpy(out->alone_values.data(), values.ptr,
                                k * sizeof(float), cudaMemcpyDeviceToHost));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(out->alone_indices.data(), indices.ptr,
                                k * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return true;
}

// The host's view of accumulated: what a selection of k must contain.
struct Reference {
  long long filled = 0;          // min(k, qualifying entries)
  uint32_t kth_bits = 0;         // magnitude bits of the filled-th largest
  long long above_kth = 0;       // qualifying entries of larger magnitude
  long long above_kth_bin = 0;   // qualifying entries in higher bins
  double accumulated_squares = 0.0;
  long long non_finite = 0;
};

Reference MakeReference(const std::vector<float>& accumulated, long long k) {
  Reference ref;
  std::vector<uint32_t> qualifying;
  for (const float a : accumulated) {
    const uint32_t bits = tf_topk::MagnitudeBits(a);
    if (bits >= tf_topk::kInfBits) {
      ++ref.non_finite;
      continue;
    }
    ref.accumulated_squares += static_cast<double>(a) * a;
    if (tf_topk::Qualifies(bits)) qualifying.push_back(bits);
  }
  ref.filled = std::min<long long>(k, static_cast<long long>(qualifying.size()));
  if (ref.filled == 0) return ref;
  std::nth_element(qualifying.begin(), qualifying.begin() + (ref.filled - 1),
                   qualifying.end(), [](uint32_t a, uint32_t b) { return a > b; });
  ref.kth_bits = qualifying[ref.filled - 1];
  const int kth_bin = tf_topk::BinOf(ref.kth_bits);
  for (const uint32_t bits : qualifying) {
    ref.above_kth += bits > ref.kth_bits ? 1 : 0;
    ref.above_kth_bin += tf_topk::BinOf(bits) > kth_bin ? 1 : 0;
  }
  return ref;
}

// Whether magnitude bits may be selected, and whether they must be: at or
// above the threshold (the k-th largest's bin, exact: itself), and above it.
bool MayBeSelected(const Case& c, const Reference& ref, uint32_t bits) {
  return c.method == tf_topk::Method::kExact
             ? bits >= ref.kth_bits
             : tf_topk::BinOf(bits) >= tf_topk::BinOf(ref.kth_bits);
}

bool MustBeSelected(const Case& c, const Reference& ref, uint32_t bits) {
  return c.method == tf_topk::Method::kExact
             ? bits > ref.kth_bits
             : tf_topk::BinOf(bits) > tf_topk::BinOf(ref.kth_bits);
}

// The fused op's slots against the reference; marks the selected entries.
int CheckSelection(const Case& c, const Inputs& in, const Reference& ref,
                   const Outputs& out, std::vector<char>* selected) {
  selected->assign(static_cast<size_t>(c.n), 0);
  long long must = 0;  // selected entries that had to be
  for (long long j = 0; j < c.k; ++j) {
    const float v = out.values[j];
    const int32_t index = out.indices[j];
    if (j >= ref.filled) {
      if (v != 0.0f || index != 0) {
        return Fail(c, "spare slot %lld holds value %g at index %d", j, v, index);
      }
      continue;
    }
    if (index < 0 || index >= c.n || (*selected)[index]) {
      return Fail(c, "slot %lld: index %d out of range or repeated", j, index);
    }
    (*selected)[index] = 1;
    if (std::memcmp(&v, &in.accumulated[index], sizeof(v)) != 0) {
      return Fail(c, "slot %lld: value %.9g, accumulated[%d] = %.9g", j, v,
                  index, in.accumulated[index]);
    }
    const uint32_t bits = tf_topk::MagnitudeBits(v);
    if (!MayBeSelected(c, ref, bits)) {
      return Fail(c, "slot %lld: |%g| is below the threshold", j, v);
    }
    must += MustBeSelected(c, ref, bits) ? 1 : 0;
  }
  const long long want = c.method == tf_topk::Method::kExact
                             ? ref.above_kth
                             : ref.above_kth_bin;
  if (ref.filled > 0 && must != want) {
    return Fail(c, "%lld entries above the threshold selected, want all %lld",
                must, want);
  }
  return 0;
}

// The fused selection against LaunchApproxTopK alone on the host's
// accumulated buffer: the same entries outside the threshold (the k-th
// largest's bin; exact: its value); inside it, *differences counts the
// entries the fused op took and the selection alone did not.
int CompareWithSelectionAlone(const Case& c, const Inputs& in,
                              const Reference& ref, const Outputs& out,
                              const std::vector<char>& selected,
                              long long* differences) {
  *differences = 0;
  if (c.k == 0) return 0;
  std::vector<char> alone(static_cast<size_t>(c.n), 0);
  long long filled = 0;
  for (long long j = 0; j < c.k; ++j) {
    const int32_t index = out.alone_indices[j];
    if (out.alone_values[j] == 0.0f || index < 0 || index >= c.n) continue;
    alone[index] = 1;
    ++filled;
  }
  if (filled != ref.filled) {
    return Fail(c, "LaunchApproxTopK alone filled %lld slots, want %lld",
                filled, ref.filled);
  }
  for (long long i = 0; i < c.n; ++i) {
    if (selected[i] == alone[i]) continue;
    const uint32_t bits = tf_topk::MagnitudeBits(in.accumulated[i]);
    if (MustBeSelected(c, ref, bits) || !MayBeSelected(c, ref, bits)) {
      return Fail(c, "entry %lld (%g) selected only by %s, outside the "
                  "threshold", i, in.accumulated[i],
                  selected[i] ? "the fused op" : "LaunchApproxTopK alone");
    }
    if (selected[i]) ++*differences;
  }
  return 0;
}

int CheckRemaining(const Case& c, const Inputs& in, const Outputs& out,
                   const std::vector<char>& selected) {
  long long wrong = 0, first = -1;
  for (long long i = 0; i < c.n; ++i) {
    const float want = selected[i] ? 0.0f : in.accumulated[i];
    const float got = out.remaining[i];
    const bool same = (std::isnan(want) && std::isnan(got)) ||
                      std::memcmp(&want, &got, sizeof(got)) == 0;
    if (same) continue;
    if (first < 0) first = i;
    ++wrong;
  }
  if (wrong == 0) return 0;
  return Fail(c, "remaining differs at %lld entries, first [%lld] = %.9g, want %.9g",
              wrong, first, out.remaining[first],
              selected[first] ? 0.0f : in.accumulated[first]);
}

bool Close(double got, double want, double scale) {
  return std::fabs(got - want) <= 1e-4 * scale;
}

int CheckStats(const Case& c, const Inputs& in, const Reference& ref,
               const Outputs& out, const std::vector<char>& selected) {
  double remaining_squares = 0.0;
  for (long long i = 0; i < c.n; ++i) {
    const float a = in.accumulated[i];
    if (!selected[i] && tf_topk::MagnitudeBits(a) < tf_topk::kInfBits) {
      remaining_squares += static_cast<double>(a) * a;
    }
  }
  const double want[] = {ref.accumulated_squares, remaining_squares,
                         static_cast<double>(ref.non_finite)};
  const double scale[] = {
      std::fabs(want[0]),
      std::max(std::fabs(want[1]), 0.01 * std::fabs(want[0])), 0.0};
  int failures = 0;
  for (int s = 0; s < tf_topk::cuda::kNumStats; ++s) {
    if (!(Close(out.stats[s], want[s], scale[s]) || out.stats[s] == want[s])) {
      failures += Fail(c, "stats[%d] = %.9g, want %.9g", s, out.stats[s], want[s]);
    }
  }
  return failures;
}

// The profile against double sums on the host: counts exactly, sums of
// squares relative 1e-4, per bin; *bins = the non-empty bins.
int CheckProfile(const Case& c, const Inputs& in, const Outputs& out,
                 int* bins) {
  *bins = 0;
  if (!c.profile) return 0;
  constexpr int kBins = tf_topk::kNumBins;
  std::vector<double> counts(kBins, 0.0), squares(kBins, 0.0);
  for (const float a : in.accumulated) {
    const uint32_t bits = tf_topk::MagnitudeBits(a);
    if (!tf_topk::Qualifies(bits)) continue;
    const int bin = tf_topk::BinOf(bits);
    counts[bin] += 1.0;
    squares[bin] += static_cast<double>(a) * a;
  }
  int wrong_counts = 0, wrong_squares = 0, first_count = -1, first_square = -1;
  for (int bin = 0; bin < kBins; ++bin) {
    const double count = out.profile[bin];
    const double square = out.profile[kBins + bin];
    *bins += counts[bin] != 0.0 ? 1 : 0;
    if (count != counts[bin]) {  // NaN: never cleared
      if (first_count < 0) first_count = bin;
      ++wrong_counts;
    }
    if (!(Close(square, squares[bin], squares[bin]) || square == squares[bin])) {
      if (first_square < 0) first_square = bin;
      ++wrong_squares;
    }
  }
  int failures = 0;
  if (wrong_counts != 0) {
    failures += Fail(c, "profile counts differ in %d bins, first bin %d: "
                     "%.17g, want %.0f", wrong_counts, first_count,
                     out.profile[first_count], counts[first_count]);
  }
  if (wrong_squares != 0) {
    failures += Fail(c, "profile sums of squares differ in %d bins, first bin "
                     "%d: %.9g, want %.9g", wrong_squares, first_square,
                     out.profile[kBins + first_square], squares[first_square]);
  }
  return failures;
}

int CheckCase(const Case& c, unsigned seed) {
  const Inputs in = MakeInputs(c, seed);
  Outputs out;
  if (!RunOnDevice(c, in, &out)) return Fail(c, "the device run failed");
  const Reference ref = MakeReference(in.accumulated, c.k);
  std::vector<char> selected;
  int failures = CheckSelection(c, in, ref, out, &selected);
  if (failures != 0) return failures;  // the checks below need the marks
  long long differences = 0;
  failures += CompareWithSelectionAlone(c, in, ref, out, selected, &differences);
  failures += CheckRemaining(c, in, out, selected);
  failures += CheckStats(c, in, ref, out, selected);
  int profile_bins = 0;
  failures += CheckProfile(c, in, out, &profile_bins);
  if (failures == 0) {
    char profile_text[64] = "";
    if (c.profile) {
      snprintf(profile_text, sizeof(profile_text), "; profile: %d bins",
               profile_bins);
    }
    printf("ok   %s: %lld filled, %lld tied entries chosen differently than "
           "LaunchApproxTopK alone; stats %.6g %.6g %.0f%s\n",
           Describe(c).c_str(), ref.filled, differences, out.stats[0],
           out.stats[1], out.stats[2], profile_text);
  }
  return failures;
}

// Mean milliseconds of one fn() call over `reps` calls after two warm-up
// calls, timed by events on the legacy default stream; negative on error.
template <typename Fn>
float MeanMs(Fn fn, int reps) {
  for (int i = 0; i < 2; ++i) {
    if (fn() != cudaSuccess) return -1.0f;
  }
  cudaEvent_t start, stop;
  if (cudaEventCreate(&start) != cudaSuccess) return -1.0f;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return -1.0f;
  }
  cudaError_t err = cudaEventRecord(start, nullptr);
  for (int i = 0; i < reps && err == cudaSuccess; ++i) err = fn();
  if (err == cudaSuccess) err = cudaEventRecord(stop, nullptr);
  if (err == cudaSuccess) err = cudaEventSynchronize(stop);
  float ms = -1.0f;
  if (err == cudaSuccess && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) {
    ms /= static_cast<float>(reps);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

// Two lines per density and method at n = kTimingN: the fused op with a
// float32 and a half gradient, LaunchApproxTopK alone on the accumulated
// buffer, and a plain copy pass (cudaMemcpyAsync of n floats: 8 bytes an
// entry, where the fused op's accumulate pass moves 12, or 10 with a half
// gradient); then the fused op with the profile on (both gradients) and what
// the profile adds.
bool TimeErrorFeedback() {
  using tf_topk::cuda::LaunchApproxTopK;
  using tf_topk::cuda::LaunchErrorFeedbackTopK;
  const long long n = kTimingN;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  // A half gradient; the float32 runs use its values as float.
  const Case shape{n, 0, kF16, tf_topk::Method::kGaussian, false, 0, kPlain,
                   false};
  const Inputs in = MakeInputs(shape, 12345u);
  DeviceBuffer gradient32, gradient16, residual, remaining, accumulated, copy;
  TF_TOPK_CHECK_CUDA(gradient32.Allocate(bytes));
  TF_TOPK_CHECK_CUDA(gradient16.Allocate(n * sizeof(uint16_t)));
  TF_TOPK_CHECK_CUDA(residual.Allocate(bytes));
  TF_TOPK_CHECK_CUDA(remaining.Allocate(bytes));
  TF_TOPK_CHECK_CUDA(accumulated.Allocate(bytes));
  TF_TOPK_CHECK_CUDA(copy.Allocate(bytes));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(gradient32.ptr, in.gradient.data(), bytes,
                                cudaMemcpyHostToDevice));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(gradient16.ptr, in.gradient16.data(),
                                n * sizeof(uint16_t), cudaMemcpyHostToDevice));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(residual.ptr, in.residual.data(), bytes,
                                cudaMemcpyHostToDevice));
  TF_TOPK_CHECK_CUDA(cudaMemcpy(accumulated.ptr, in.accumulated.data(), bytes,
                                cudaMemcpyHostToDevice));
  constexpr int kReps = 20;
  for (const double density : {0.01, 0.001}) {
    const long long k = std::llround(density * static_cast<double>(n));
    DeviceBuffer values, indices, stats, profile, scratch;
    TF_TOPK_CHECK_CUDA(values.Allocate(k * sizeof(float)));
    TF_TOPK_CHECK_CUDA(indices.Allocate(k * sizeof(int32_t)));
    TF_TOPK_CHECK_CUDA(stats.Allocate(tf_topk::cuda::kNumStats * sizeof(double)));
    TF_TOPK_CHECK_CUDA(profile.Allocate(tf_topk::cuda::kProfileRows *
                                        tf_topk::kNumBins * sizeof(double)));
    TF_TOPK_CHECK_CUDA(
        scratch.Allocate(tf_topk::cuda::ErrorFeedbackScratchBytes(n, k)));
    for (const tf_topk::Method method :
         {tf_topk::Method::kGaussian, tf_topk::Method::kExact}) {
      // with_profile: the profile's buffer, else nullptr.
      auto fused32 = [&](double* with_profile) {
        return LaunchErrorFeedbackTopK<float>(
            gradient32.At<float>(), residual.At<float>(), n, k, method,
            values.At<float>(), indices.At<int32_t>(), remaining.At<float>(),
            stats.At<double>(), with_profile, scratch.ptr, nullptr);
      };
      auto fused16 = [&](double* with_profile) {
        return LaunchErrorFeedbackTopK<__half>(
            gradient16.At<__half>(), residual.At<float>(), n, k, method,
            values.At<float>(), indices.At<int32_t>(), remaining.At<float>(),
            stats.At<double>(), with_profile, scratch.ptr, nullptr);
      };
      auto alone = [&] {
        return LaunchApproxTopK<float>(accumulated.At<float>(), n, k, method,
                                       values.At<float>(), indices.At<int32_t>(),
                                       scratch.ptr, nullptr);
      };
      auto copy_pass = [&] {
        return cudaMemcpyAsync(copy.ptr, accumulated.ptr, bytes,
                               cudaMemcpyDeviceToDevice, nullptr);
      };
      double* const on = profile.At<double>();
      const float fused32_ms = MeanMs([&] { return fused32(nullptr); }, kReps);
      const float fused16_ms = MeanMs([&] { return fused16(nullptr); }, kReps);
      const float alone_ms = MeanMs(alone, kReps);
      const float copy_ms = MeanMs(copy_pass, kReps);
      const float profile32_ms = MeanMs([&] { return fused32(on); }, kReps);
      const float profile16_ms = MeanMs([&] { return fused16(on); }, kReps);
      if (fused32_ms < 0.0f || fused16_ms < 0.0f || alone_ms < 0.0f ||
          copy_ms < 0.0f || profile32_ms < 0.0f || profile16_ms < 0.0f) {
        printf("FAIL timing n=%lld k=%lld: a launch failed: %s\n", n, k,
               cudaGetErrorString(cudaGetLastError()));
        return false;
      }
      printf("timing n=%lld k=%lld (density %g, %s): fused %.3f ms (half "
             "gradient %.3f ms), LaunchApproxTopK alone %.3f ms, copy pass "
             "%.3f ms (%.0f GB/s); fused - alone = %.3f ms = %.2f copy "
             "passes\n",
             n, k, density,
             method == tf_topk::Method::kExact ? "exact" : "gaussian",
             fused32_ms, fused16_ms, alone_ms, copy_ms,
             2.0 * bytes / (copy_ms * 1e6), fused32_ms - alone_ms,
             (fused32_ms - alone_ms) / copy_ms);
      printf("timing n=%lld k=%lld (density %g, %s): fused with profile "
             "%.3f ms (half gradient %.3f ms); the profile adds %.3f ms "
             "(half gradient %.3f ms) = %.2f copy passes\n",
             n, k, density,
             method == tf_topk::Method::kExact ? "exact" : "gaussian",
             profile32_ms, profile16_ms, profile32_ms - fused32_ms,
             profile16_ms - fused16_ms, (profile32_ms - fused32_ms) / copy_ms);
    }
  }
  return true;
}

#undef TF_TOPK_CHECK_CUDA

// small: only the cases up to about a million entries (for compute-sanitizer,
// which slows every access down).
int RunErrorFeedbackCheck(bool timing, bool small) {
  using tf_topk::Method;
  const Method kG = Method::kGaussian, kE = Method::kExact;
  const long long kBig = kTimingN;
  constexpr bool kP = true;  // with the profile
  // n, k, gradient dtype, method, in place, offset, special, profile.
  const Case cases[] = {
      {1000, 10, kF32, kG, false, 0, kPlain, false},
      {1000, 10, kF32, kE, false, 0, kNonFinite, kP},
      {4096, 4096, kF32, kE, false, 0, kPlain, false},        // k = n
      {5000, 0, kF32, kG, false, 0, kNonFinite, kP},          // k = 0
      {2000, 1000, kF32, kG, false, 0, kMostlyZero, kP},      // < k qualify
      {100001, 100, kF32, kG, false, 1, kNonFinite, false},   // scalar accumulate
      {100001, 100, kF16, kE, true, 1, kPlain, kP},           // scalar, 16-bit
      {100000, 1000, kF32, kE, false, 0, kWideRange, kP},     // subnormals
      {1000003, 1000, kF32, kE, true, 0, kNonFinite, false},  // prefilter, odd tail
      {1000003, 10000, kF16, kG, false, 0, kNonFinite, kP},
      {1000003, 10000, kBF16, kE, true, 0, kPlain, false},
      {kBig, kBig / 100, kF32, kG, false, 0, kPlain, false},
      {kBig, kBig / 1000, kF32, kG, true, 0, kNonFinite, kP},
      {kBig, kBig / 100, kF16, kE, false, 0, kPlain, false},
      {kBig, kBig / 1000, kBF16, kG, false, 0, kPlain, false},
  };
  int failures = 0;
  unsigned seed = 1;
  for (const Case& c : cases) {
    const unsigned case_seed = seed++;
    if (small && c.n > 1100000) continue;
    failures += CheckCase(c, case_seed);
  }
  if (timing && !TimeErrorFeedback()) ++failures;
  printf("error feedback: %d failure(s)\n", failures);
  return failures;
}

}  // namespace check
}  // namespace

extern "C" {

size_t tf_topk_scratch_bytes(long long n, long long k) {
  return tf_topk::cuda::ScratchBytes(static_cast<int64_t>(n), static_cast<int64_t>(k));
}

// 1 when built with -DTF_TOPK_DEBUG_CHECKS (device-side plan cross-checks).
int tf_topk_debug_checks() {
#if defined(TF_TOPK_DEBUG_CHECKS)
  return 1;
#else
  return 0;
#endif
}

int tf_topk_select_f32(const void* x, long long n, long long k, int method,
                       void* values, void* indices, void* scratch,
                       void* stream) {
  return Select<float>(x, n, k, method, values, indices, scratch, stream);
}

int tf_topk_select_f16(const void* x, long long n, long long k, int method,
                       void* values, void* indices, void* scratch,
                       void* stream) {
  return Select<__half>(x, n, k, method, values, indices, scratch, stream);
}

int tf_topk_select_bf16(const void* x, long long n, long long k, int method,
                        void* values, void* indices, void* scratch,
                        void* stream) {
  return Select<__nv_bfloat16>(x, n, k, method, values, indices, scratch,
                               stream);
}

// SampleIndex: where the sample of the prefilter looks.
long long tf_topk_sample_index(long long s, long long n) {
  return tf_topk::SampleIndex(s, n);
}

// Copies the device-side state left by the last select on `scratch` into
// out[0:17] (waits for `stream`): sure_above, tie_low, bin_low, above, need,
// done, error, count (qualifying, gaussian two-pass only), sure_counter,
// tie_counter, fill_counter, prefix, hist1 total (the entries the plan was
// made from: candidates or all qualifying), prefilter_key, candidate_count,
// use_candidates, fallback.
int tf_topk_read_state(const void* scratch, long long* out, void* stream) {
  using tf_topk::cuda::Scratch;
  Scratch* host = new Scratch;
  cudaError_t err = cudaMemcpyAsync(host, scratch, sizeof(Scratch),
                                    cudaMemcpyDeviceToHost,
                                    static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) {
    const tf_topk::cuda::State& st = host->state;
    long long qualifying = 0;
    for (int b = 0; b < tf_topk::kNumBins; ++b) qualifying += host->hist1[b];
    const long long fields[] = {
        st.sure_above, st.tie_low, st.bin_low, st.above, st.need,
        st.exact.done, st.error, static_cast<long long>(st.count),
        static_cast<long long>(st.sure_counter),
        static_cast<long long>(st.tie_counter),
        static_cast<long long>(st.fill_counter), st.exact.prefix, qualifying,
        st.prefilter_key, static_cast<long long>(st.candidate_count),
        st.use_candidates, st.fallback};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); ++i) out[i] = fields[i];
  }
  delete host;
  return static_cast<int>(err);
}

// The fused error-feedback selection (error_feedback.cuh): the gradient in
// the suffix's dtype; residual, values and remaining float32 (remaining may
// be the residual); stats 3 doubles; profile null (none) or 2 * 2048
// doubles (per magnitude bin: the counts, then the sums of squares of the
// finite, non-zero accumulated entries); all in device memory.
size_t tf_topk_error_feedback_scratch_bytes(long long n, long long k) {
  return tf_topk::cuda::ErrorFeedbackScratchBytes(static_cast<int64_t>(n),
                                                  static_cast<int64_t>(k));
}

int tf_topk_error_feedback_f32(const void* gradient, const void* residual,
                               long long n, long long k, int method,
                               void* values, void* indices, void* remaining,
                               void* stats, void* profile, void* scratch,
                               void* stream) {
  return ErrorFeedbackAnyDtype(kF32, gradient, residual, n, k, method, values,
                               indices, remaining, stats, profile, scratch,
                               stream);
}

int tf_topk_error_feedback_f16(const void* gradient, const void* residual,
                               long long n, long long k, int method,
                               void* values, void* indices, void* remaining,
                               void* stats, void* profile, void* scratch,
                               void* stream) {
  return ErrorFeedbackAnyDtype(kF16, gradient, residual, n, k, method, values,
                               indices, remaining, stats, profile, scratch,
                               stream);
}

int tf_topk_error_feedback_bf16(const void* gradient, const void* residual,
                                long long n, long long k, int method,
                                void* values, void* indices, void* remaining,
                                void* stats, void* profile, void* scratch,
                                void* stream) {
  return ErrorFeedbackAnyDtype(kBF16, gradient, residual, n, k, method, values,
                               indices, remaining, stats, profile, scratch,
                               stream);
}

// The self-contained check of the fused op (host reference, no PyTorch; see
// `namespace check` above) on the current device, and with timing != 0 its
// timings at n = 25M; with small != 0 only the cases up to about a million
// entries. Prints to stdout; returns the number of failures.
int tf_topk_error_feedback_check(int timing, int small) {
  return check::RunErrorFeedbackCheck(timing != 0, small != 0);
}

const char* tf_topk_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // extern "C"

#if defined(TF_TOPK_HARNESS_MAIN)
// The program build (see the top of this file): the error-feedback check.
// Flags: --no-timing (checks only), --small (the cases up to about a million
// entries, no timing: for compute-sanitizer).
int main(int argc, char** argv) {
  bool timing = true, small = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-timing") == 0) {
      timing = false;
    } else if (std::strcmp(argv[i], "--small") == 0) {
      small = true;
      timing = false;
    } else {
      fprintf(stderr, "unknown flag %s (flags: --no-timing, --small)\n", argv[i]);
      return 2;
    }
  }
  return tf_topk_error_feedback_check(timing ? 1 : 0, small ? 1 : 0) == 0 ? 0 : 1;
}
#endif  // TF_TOPK_HARNESS_MAIN
