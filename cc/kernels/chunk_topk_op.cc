// The chunk-wise error-feedback selection (ErrorFeedbackChunkTopK) on the CPU:
// the chunks run in parallel on the intra-op pool, each read once for its sums,
// then, in cache, for the entries above a threshold guessed from a sample, of which
// a partial sort keeps the k largest; those are zeroed in `remaining`. The
// statistics are summed per chunk, then over chunks in order, so they do not
// depend on the number of threads. No GPU kernel: the exchange selects
// chunk-wise with TensorFlow's own top_k there (tf_topk/routes/chunked.py).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "chunk_grid.h"
#include "error_feedback_cpu.h"
#include "remaining_buffers.h"
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

using Key = uint32_t;  // cpu::KeyOf: the magnitude's float32 bits, in the order of magnitude

// Ranks candidates (cpu::Candidate: index and value) by magnitude, then by
// the earlier index (ties to the earlier entry).
template <typename R>
bool Better(const cpu::Candidate<R>& a, const cpu::Candidate<R>& b) {
  const R x = std::abs(a.value), y = std::abs(b.value);
  return x > y || (x == y && a.index < b.index);
}

constexpr int64_t kSample = 256;  // entries a chunk's threshold is guessed from
constexpr int64_t kSmallRank = 16;  // below it the sample's rank is found by insertion

// A key with about `wanted` of the chunk's entries at or above it, guessed
// from kSample of x[begin, end) evenly spaced, whatever their distribution;
// 1 (every finite non-zero entry) where the guess would keep them all.
template <typename R>
Key SampledKey(const R* x, int64_t begin, int64_t end, double wanted) {
  const int64_t length = end - begin;
  const int64_t stride = std::max<int64_t>(1, length / kSample);
  const int64_t samples = std::min(kSample, (length + stride - 1) / stride);
  const int64_t rank = static_cast<int64_t>(wanted * static_cast<double>(samples) / static_cast<double>(length));
  if (rank >= samples) return 1u;
  Key keys[kSample];
  int64_t taken = 0;
  if (rank < kSmallRank) {  // the rank + 1 largest keys, descending, by insertion: most keys fail one test
    for (int64_t s = 0; s < samples; ++s) {
      const Key key = cpu::KeyOf(x[begin + s * stride]);
      if (key >= kInfBits || (taken > rank && key <= keys[rank])) continue;
      int64_t j = std::min(taken, rank);
      for (; j > 0 && keys[j - 1] < key; --j) keys[j] = keys[j - 1];
      keys[j] = key;
      taken = std::min(taken + 1, rank + 1);
    }
  } else {
    for (int64_t s = 0; s < samples; ++s) {
      const Key key = cpu::KeyOf(x[begin + s * stride]);
      if (key < kInfBits) keys[taken++] = key;
    }
    if (taken > rank) std::nth_element(keys, keys + rank, keys + taken, [](Key a, Key b) { return a > b; });
  }
  return taken > rank ? std::max(keys[rank], Key{1}) : 1u;
}

// Chunk [begin, end): accumulated into remaining, its k largest finite
// non-zero magnitudes into slots (values, indices), zeroed in remaining;
// partial statistics into stats[0:3]. The fused op's passes read the chunk
// once (cpu::AccumulateChunk: the sums, float32 four wide), then, in cache,
// collect the candidates at or above a key guessed from a sample of it
// (cpu::PrefilterBlock, groups of 16 with none above it skipped; SampledKey:
// about 2k + 16 of them, then 8k + 64, then every entry). The k best
// candidates are the chunk's k best whatever the guess, which only decides
// how many entries the partial sort sees. (A guess from the root mean square,
// as if the entries were normal, kept thousands of candidates a chunk once
// error feedback had flattened the distribution.)
template <typename T, typename R>
void SelectChunk(const T* gradient, const R* residual, int64_t begin, int64_t end, int64_t k,
                 std::vector<cpu::Candidate<R>>* kept, R* values, int32_t* indices, R* remaining, double* stats) {
  cpu::BlockSums sums;
  cpu::AccumulateChunk(gradient, residual, begin, end, /*low_key=*/0u, remaining, &sums);
  for (int attempt = 0;; ++attempt) {
    const Key low_key = attempt == 2 ? 1u : SampledKey(remaining, begin, end, attempt == 0 ? 2.0 * k + 16.0
                                                                                          : 8.0 * k + 64.0);
    kept->clear();
    cpu::PrefilterBlock(remaining, begin, end, low_key, end - begin, kept);
    if (static_cast<int64_t>(kept->size()) >= k || low_key == 1u) break;
  }
  int64_t count = static_cast<int64_t>(kept->size());
  const double accumulated_squares = sums.accumulated_squares;
  const int64_t non_finite = sums.non_finite;
  if (count > k) {
    std::nth_element(kept->begin(), kept->begin() + k, kept->end(), Better<R>);
    count = k;
  }
  std::sort(kept->begin(), kept->begin() + count, Better<R>);
  int64_t slot = 0;
  double selected_squares = 0.0;
  for (; slot < count; ++slot) {
    const cpu::Candidate<R>& c = (*kept)[slot];
    values[slot] = c.value;
    indices[slot] = c.index;
    selected_squares += static_cast<double>(c.value) * static_cast<double>(c.value);
    remaining[c.index] = R(0);
  }
  for (; slot < k; ++slot) {
    values[slot] = R(0);
    indices[slot] = static_cast<int32_t>(begin);
  }
  stats[0] = accumulated_squares;
  stats[1] = std::max(0.0, accumulated_squares - selected_squares);
  stats[2] = static_cast<double>(non_finite);
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
    levels_ = value_bits == 0 ? 0 : ChunkLevels(value_bits);
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
    OP_REQUIRES_OK(ctx, remaining_buffers_.Output(ctx, 2, residual.dtype(), n, &remaining));
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
      std::vector<cpu::Candidate<R>> candidates;
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
      const int member = *std::max_element(exponents.begin(), exponents.end());  // e_m
      std::vector<double> error_squares(chunks, 0.0);
      pool->ParallelFor(chunks, 8 * k, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          const int step = member - ChunkOffset(member, exponents[c]);
          error_squares[c] = RoundChunk(v + c * k, idx + c * k, k, step, levels_,
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
  RemainingBuffers remaining_buffers_;  // as ErrorFeedbackTopK's: no fresh pages a step
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
