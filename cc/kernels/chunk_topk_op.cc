// The chunk-wise error-feedback selection (ErrorFeedbackChunkTopK) on the CPU:
// the chunks run in parallel on the intra-op pool, each read once for its sums,
// then, in cache, for the entries above a threshold guessed from them, of which
// a partial sort keeps the k largest; those are zeroed in `remaining`. The
// statistics are summed per chunk, then over chunks in order, so they do not
// depend on the number of threads. No GPU kernel: the exchange selects
// chunk-wise with TensorFlow's own top_k there (tf_topk/routes/chunked.py).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_topk {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

namespace {

template <typename R, typename T>
R Widened(T x) {
  if constexpr (std::is_floating_point<T>::value) {
    return static_cast<R>(x);
  } else {  // Eigen::half, Eigen::bfloat16
    return static_cast<R>(static_cast<float>(x));
  }
}

// One candidate: its magnitude and its index. `Better` ranks by magnitude,
// then by the earlier index (ties to the earlier entry).
template <typename R>
struct Candidate {
  R magnitude;
  int64_t index;
};

template <typename R>
bool Better(const Candidate<R>& a, const Candidate<R>& b) {
  return a.magnitude > b.magnitude || (a.magnitude == b.magnitude && a.index < b.index);
}

// A magnitude about 0.8 of the one that `share` of normal entries of mean
// square `mean_square` exceed (Abramowitz and Stegun 26.2.23 for the normal
// quantile, within 5e-4): below the k-th largest for most chunks of gradients.
inline double NormalThreshold(double mean_square, double share) {
  const double tail = 0.5 * share;  // one side of |x|
  const double t = std::sqrt(-2.0 * std::log(tail));
  const double z = t - (2.515517 + 0.802853 * t + 0.010328 * t * t) /
                           (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t);
  return 0.8 * std::sqrt(mean_square) * std::max(z, 0.0);
}

// Chunk [begin, end): accumulated into remaining, its k largest finite
// non-zero magnitudes into slots (values, indices), zeroed in remaining;
// partial statistics into stats[0:3]. Two passes over the chunk, the second
// in cache: the sums (eight accumulators, no dependency chain), then the
// selection, where an entry costs one comparison with a threshold (NaN
// compares false).
template <typename T, typename R>
void SelectChunk(const T* gradient, const R* residual, int64_t begin, int64_t end, int64_t k,
                 std::vector<Candidate<R>>* candidates, R* values, int32_t* indices, R* remaining,
                 double* stats) {
  constexpr int kLanes = 8;
  double squares[kLanes] = {0.0};
  int64_t non_finite = 0;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) {
      const R a = Widened<R>(gradient[i + lane]) + residual[i + lane];
      remaining[i + lane] = a;
      const bool finite = std::isfinite(a);
      squares[lane] += finite ? static_cast<double>(a) * static_cast<double>(a) : 0.0;
      non_finite += finite ? 0 : 1;
    }
  }
  for (; i < end; ++i) {
    const R a = Widened<R>(gradient[i]) + residual[i];
    remaining[i] = a;
    const bool finite = std::isfinite(a);
    squares[0] += finite ? static_cast<double>(a) * static_cast<double>(a) : 0.0;
    non_finite += finite ? 0 : 1;
  }
  double accumulated_squares = 0.0;
  for (int lane = 0; lane < kLanes; ++lane) accumulated_squares += squares[lane];

  // Candidates above a threshold guessed from the chunk's root mean square as
  // if its entries were normal (`NormalThreshold`), lowered until k qualify:
  // the k best candidates are then the chunk's k best whatever the guess, which
  // only decides how many entries the final partial sort sees.
  const int64_t length = end - begin;
  const int64_t finite = length - non_finite;
  double threshold = (finite > 0 && 2 * k < finite)
                         ? NormalThreshold(accumulated_squares / static_cast<double>(finite),
                                           static_cast<double>(k) / static_cast<double>(finite))
                         : 0.0;
  for (int attempt = 0;; ++attempt) {
    candidates->clear();
    const R below = static_cast<R>(threshold);
    for (i = begin; i < end; ++i) {
      const R magnitude = std::abs(remaining[i]);
      if (magnitude > below && std::isfinite(magnitude)) candidates->push_back({magnitude, i});
    }
    if (static_cast<int64_t>(candidates->size()) >= k || threshold == 0.0) break;
    threshold = attempt < 2 ? threshold * 0.5 : 0.0;
  }
  if (static_cast<int64_t>(candidates->size()) > k) {
    std::nth_element(candidates->begin(), candidates->begin() + k, candidates->end(), Better<R>);
    candidates->resize(k);
  }
  std::sort(candidates->begin(), candidates->end(), Better<R>);
  int64_t slot = 0;
  double selected_squares = 0.0;
  for (const Candidate<R>& c : *candidates) {
    const R a = remaining[c.index];
    values[slot] = a;
    indices[slot] = static_cast<int32_t>(c.index);
    selected_squares += static_cast<double>(a) * static_cast<double>(a);
    remaining[c.index] = R(0);
    ++slot;
  }
  for (; slot < k; ++slot) {
    values[slot] = R(0);
    indices[slot] = static_cast<int32_t>(begin);
  }
  stats[0] = accumulated_squares;
  stats[1] = std::max(0.0, accumulated_squares - selected_squares);
  stats[2] = static_cast<double>(non_finite);
}

constexpr int kMinExponent = -149;  // float32's smallest subnormal is 2**-149
constexpr int kMaxExponent = 127;  // float32's largest power of two
constexpr int kMaxOffset = 15;      // 4 bits: a chunk's grid at most 2**15 below its member's

// The exponent e of a chunk's grid 2**e from its selected values (the slots
// [0, count)): with levels = 1 the power of two nearest the mean magnitude of
// the non-zero ones, else the smallest e with max <= levels * 2**e;
// kMinExponent for none, at most kMaxExponent. tf_topk/routes/chunked.py's `chunk_exponents`, whose
// rule this is: the route rebuilds the codes from the rounded values with it.
template <typename R>
int ChunkExponent(const R* values, int64_t count, int levels) {
  double sum = 0.0, largest = 0.0;
  int64_t nonzero = 0;
  for (int64_t j = 0; j < count; ++j) {
    const double magnitude = std::abs(static_cast<double>(values[j]));
    if (magnitude > 0.0) {
      sum += magnitude;
      largest = std::max(largest, magnitude);
      ++nonzero;
    }
  }
  if (nonzero == 0) return kMinExponent;
  double exponent;
  if (levels == 1) {
    exponent = std::nearbyint(std::log(sum / static_cast<double>(nonzero)) / std::log(2.0));
  } else {
    exponent = std::ceil(std::log(largest / levels) / std::log(2.0));
    if (largest > levels * std::ldexp(1.0, static_cast<int>(exponent))) exponent += 1;
    if (largest <= levels * std::ldexp(1.0, static_cast<int>(exponent) - 1)) exponent -= 1;
  }
  return std::min(std::max(static_cast<int>(exponent), kMinExponent), kMaxExponent);
}

// The chunk's selected values rounded to c * 2**step, c in [-levels, levels]:
// the values become the rounded ones, each rounding error goes back into
// `remaining` at its entry (zeroed by the selection), a slot that rounds to 0
// points at the chunk's start; returns the sum of the errors' squares.
template <typename R>
double RoundChunk(R* values, int32_t* indices, int64_t count, int step, int levels, int32_t start,
                  R* remaining) {
  const double unit = std::ldexp(1.0, step);
  double error_squares = 0.0;
  for (int64_t j = 0; j < count; ++j) {
    const double value = static_cast<double>(values[j]);
    if (value == 0.0) continue;  // a spare slot
    const double code = std::min<double>(levels, std::max<double>(-levels, std::nearbyint(value / unit)));
    const R rounded = static_cast<R>(code * unit);
    const R error = values[j] - rounded;
    remaining[indices[j]] = error;
    error_squares += static_cast<double>(error) * static_cast<double>(error);
    values[j] = rounded;
    if (rounded == R(0)) indices[j] = start;
  }
  return error_squares;
}

}  // namespace

template <typename T, typename R>
class ErrorFeedbackChunkTopKOp : public OpKernel {
 public:
  explicit ErrorFeedbackChunkTopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk_));
    int value_bits = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("value_bits", &value_bits));
    OP_REQUIRES(ctx, value_bits == 0 || value_bits == 2 || value_bits == 3 || value_bits == 4 || value_bits == 8,
                absl::InvalidArgumentError("value_bits must be 0, 2, 3, 4 or 8, got " + std::to_string(value_bits)));
    levels_ = value_bits == 0 ? 0 : (1 << (value_bits - 1)) - 1;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& gradient = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const Tensor& k_tensor = ctx->input(2);
    const int64_t n = gradient.NumElements();
    OP_REQUIRES(ctx, residual.NumElements() == n,
                absl::InvalidArgumentError("residual must have as many entries as gradient (" +
                                           std::to_string(n) + "), got shape " +
                                           residual.shape().DebugString()));
    OP_REQUIRES(ctx, n < (int64_t{1} << 31),
                absl::InvalidArgumentError("gradient must have fewer than 2**31 entries, got " +
                                           std::to_string(n)));
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(k_tensor.shape()),
                absl::InvalidArgumentError("k must be a scalar, got shape " +
                                           k_tensor.shape().DebugString()));
    const int64_t k = k_tensor.scalar<int32_t>()();
    OP_REQUIRES(ctx, k >= 1 && k <= chunk_,
                absl::InvalidArgumentError("k must be in [1, chunk=" + std::to_string(chunk_) +
                                           "], got " + std::to_string(k)));
    const int64_t chunks = (n + chunk_ - 1) / chunk_;
    Tensor* values = nullptr;
    Tensor* indices = nullptr;
    Tensor* remaining = nullptr;
    Tensor* stats = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({chunks * k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({chunks * k}), &indices));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &remaining));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({3}), &stats));
    const T* g = gradient.flat<T>().data();
    const R* r = residual.flat<R>().data();
    R* v = values->flat<R>().data();
    int32_t* idx = indices->flat<int32_t>().data();
    R* rem = remaining->flat<R>().data();
    std::vector<double> partial(3 * chunks, 0.0);
    const int64_t chunk = chunk_;
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pool->ParallelFor(chunks, 8 * chunk, [&](int64_t first, int64_t last) {
      std::vector<Candidate<R>> candidates;
      candidates.reserve(chunk);
      for (int64_t c = first; c < last; ++c) {
        SelectChunk(g, r, c * chunk, std::min(n, (c + 1) * chunk), k, &candidates, v + c * k, idx + c * k,
                    rem, partial.data() + 3 * c);
      }
    });
    if (levels_ > 0 && chunks > 0) {
      // The grid: each chunk's exponent, the member's (their largest), then each chunk rounded on
      // 2**(member - offset), its errors back in `remaining`.
      std::vector<int> exponents(chunks);
      pool->ParallelFor(chunks, 4 * k, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) exponents[c] = ChunkExponent(v + c * k, k, levels_);
      });
      const int member = *std::max_element(exponents.begin(), exponents.end());
      std::vector<double> error_squares(chunks, 0.0);
      pool->ParallelFor(chunks, 8 * k, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          const int offset = std::min(kMaxOffset, std::max(0, member - exponents[c]));
          error_squares[c] = RoundChunk(v + c * k, idx + c * k, k, member - offset, levels_,
                                        static_cast<int32_t>(c * chunk), rem);
        }
      });
      for (int64_t c = 0; c < chunks; ++c) partial[3 * c + 1] += error_squares[c];
    }
    double* s = stats->flat<double>().data();
    s[0] = s[1] = s[2] = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int j = 0; j < 3; ++j) s[j] += partial[3 * c + j];
    }
  }

 private:
  int64_t chunk_ = 1;
  int levels_ = 0;
};

#define REGISTER_CHUNK_CPU(T, R)                                                   \
  REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ErrorFeedbackChunkTopK")              \
                              .Device(::tensorflow::DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                              \
                              .TypeConstraint<R>("R"),                             \
                          ErrorFeedbackChunkTopKOp<T, R>);

REGISTER_CHUNK_CPU(float, float)
REGISTER_CHUNK_CPU(Eigen::half, float)
REGISTER_CHUNK_CPU(Eigen::bfloat16, float)
REGISTER_CHUNK_CPU(double, double)

#undef REGISTER_CHUNK_CPU

}  // namespace tf_topk
