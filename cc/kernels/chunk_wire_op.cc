// The chunk route's wire format on the CPU (ChunkPack, ChunkUnpack): the grid
// of each chunk rebuilt from its rounded values (chunk_grid.h, the rule the
// selection rounded with), then fields written and read least significant bit
// first across 32-bit words, one pass each. The same format as the graph's
// (tf_topk/routes/bitfields.py and chunked.py), which a GPU runs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "chunk_grid.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_topk {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

namespace {

// Fields appended least significant bit first, across 32-bit words.
class BitWriter {
 public:
  explicit BitWriter(uint32_t* words) : words_(words) {}
  void Write(uint64_t field, int width) {
    pending_ |= (field & ((uint64_t{1} << width) - 1)) << used_;
    used_ += width;
    while (used_ >= 32) {
      *words_++ = static_cast<uint32_t>(pending_);
      pending_ >>= 32;
      used_ -= 32;
    }
  }
  void Flush() {
    if (used_ > 0) *words_++ = static_cast<uint32_t>(pending_);
    pending_ = 0;
    used_ = 0;
  }

 private:
  uint32_t* words_;
  uint64_t pending_ = 0;
  int used_ = 0;
};

// BitWriter's fields read back in order; reads past `end` give zeros.
class BitReader {
 public:
  BitReader(const uint32_t* words, const uint32_t* end) : words_(words), end_(end) {}
  uint64_t Read(int width) {
    while (available_ < width) {
      const uint64_t word = words_ < end_ ? *words_++ : 0;
      pending_ |= word << available_;
      available_ += 32;
    }
    const uint64_t field = pending_ & ((uint64_t{1} << width) - 1);
    pending_ >>= width;
    available_ -= width;
    return field;
  }

 private:
  const uint32_t* words_;
  const uint32_t* end_;
  uint64_t pending_ = 0;
  int available_ = 0;
};

// The bucket's layout from the ops' attributes and `lengths`: per member its
// chunks' length and count and its slots per chunk.
struct Layout {
  std::vector<int64_t> sizes, starts, chunk_length, chunk_count, per_chunk;
  int index_bits = 1, value_bits = 2, levels = 1;
  int64_t chunks = 0, slots = 0;

  int64_t Members() const { return static_cast<int64_t>(sizes.size()); }
  int64_t Bits() const { return int64_t{kChunkOffsetBits} * chunks + (index_bits + value_bits) * slots; }
  int64_t Words() const { return Members() + (Bits() + 31) / 32; }
};

class ChunkWireOp : public OpKernel {
 public:
  explicit ChunkWireOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sizes", &layout_.sizes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("starts", &layout_.starts));
    int64_t chunk = 1;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("value_bits", &layout_.value_bits));
    const int bits = layout_.value_bits;
    OP_REQUIRES(ctx, bits == 2 || bits == 3 || bits == 4 || bits == 8,
                absl::InvalidArgumentError("value_bits must be 2, 3, 4 or 8, got " + std::to_string(bits)));
    OP_REQUIRES(ctx, layout_.sizes.size() == layout_.starts.size() && !layout_.sizes.empty(),
                absl::InvalidArgumentError("sizes and starts must name the same members, got " +
                                           std::to_string(layout_.sizes.size()) + " and " +
                                           std::to_string(layout_.starts.size())));
    while ((int64_t{1} << layout_.index_bits) < chunk) ++layout_.index_bits;
    OP_REQUIRES(ctx, layout_.index_bits + bits <= 32,
                absl::InvalidArgumentError("chunk=" + std::to_string(chunk) + " leaves no room for the values"));
    layout_.levels = ChunkLevels(bits);
    for (int64_t size : layout_.sizes) {
      OP_REQUIRES(ctx, size >= 1, absl::InvalidArgumentError("sizes must be >= 1, got " + std::to_string(size)));
      const int64_t length = std::min(chunk, size);
      layout_.chunk_length.push_back(length);
      layout_.chunk_count.push_back((size + length - 1) / length);
      layout_.chunks += layout_.chunk_count.back();
    }
  }

 protected:
  // The layout with `lengths` (slots per member) filled in.
  absl::Status WithLengths(const Tensor& lengths, Layout* layout) const {
    if (lengths.dims() != 1 || lengths.NumElements() != layout_.Members()) {
      return absl::InvalidArgumentError("lengths must have one entry per member (" +
                                        std::to_string(layout_.Members()) + "), got shape " +
                                        lengths.shape().DebugString());
    }
    *layout = layout_;
    for (int64_t m = 0; m < layout->Members(); ++m) {
      const int64_t length = lengths.flat<int32_t>()(m);
      if (length < 0 || length % layout->chunk_count[m] != 0 ||
          length / layout->chunk_count[m] > layout->chunk_length[m]) {
        return absl::InvalidArgumentError("member " + std::to_string(m) + " has " + std::to_string(length) +
                                          " slots: not the same number, at most a chunk's length, in each of its " +
                                          std::to_string(layout->chunk_count[m]) + " chunks");
      }
      layout->per_chunk.push_back(length / layout->chunk_count[m]);
      layout->slots += length;
    }
    return absl::OkStatus();
  }

  Layout layout_;
};

template <typename R>
class ChunkPackOp : public ChunkWireOp {
 public:
  explicit ChunkPackOp(OpKernelConstruction* ctx) : ChunkWireOp(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    Layout layout;
    OP_REQUIRES_OK(ctx, WithLengths(ctx->input(2), &layout));
    OP_REQUIRES(ctx, values.NumElements() == layout.slots && indices.NumElements() == layout.slots,
                absl::InvalidArgumentError("values and indices must have the " + std::to_string(layout.slots) +
                                           " slots lengths gives, got " + std::to_string(values.NumElements()) +
                                           " and " + std::to_string(indices.NumElements())));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({layout.Words()}), &out));
    uint32_t* words = reinterpret_cast<uint32_t*>(out->flat<float>().data());
    const R* v = values.flat<R>().data();
    const int32_t* idx = indices.flat<int32_t>().data();

    // Each chunk's exponent, its member's (the largest), each chunk's offset.
    std::vector<int> offsets(layout.chunks);
    std::vector<int> steps(layout.chunks);
    int64_t chunk = 0, slot = 0;
    for (int64_t m = 0; m < layout.Members(); ++m) {
      const int64_t first = chunk;
      int member = kChunkMinExponent;
      for (int64_t c = 0; c < layout.chunk_count[m]; ++c, ++chunk, slot += layout.per_chunk[m]) {
        offsets[chunk] = ChunkExponent(v + slot, layout.per_chunk[m], layout.levels);
        member = std::max(member, offsets[chunk]);
      }
      const int32_t exponent = member;
      std::memcpy(words + m, &exponent, sizeof(exponent));
      for (int64_t c = first; c < chunk; ++c) {
        offsets[c] = ChunkOffset(member, offsets[c]);
        steps[c] = member - offsets[c];
      }
    }
    std::fill(words + layout.Members(), words + layout.Words(), 0u);
    BitWriter writer(words + layout.Members());
    for (int offset : offsets) writer.Write(static_cast<uint64_t>(offset), kChunkOffsetBits);
    const uint64_t local_mask = (uint64_t{1} << layout.index_bits) - 1;
    chunk = 0;
    slot = 0;
    for (int64_t m = 0; m < layout.Members(); ++m) {
      for (int64_t c = 0; c < layout.chunk_count[m]; ++c, ++chunk) {
        const double unit = std::ldexp(1.0, steps[chunk]);
        const int64_t chunk_start = layout.starts[m] + c * layout.chunk_length[m];
        for (int64_t j = 0; j < layout.per_chunk[m]; ++j, ++slot) {
          const double value = static_cast<double>(v[slot]);
          const double code = std::isfinite(value)
                                  ? std::min<double>(layout.levels,
                                                     std::max<double>(-layout.levels, std::nearbyint(value / unit)))
                                  : 0.0;
          const uint64_t local = static_cast<uint64_t>(idx[slot] - chunk_start) & local_mask;
          const uint64_t bits = static_cast<uint64_t>(static_cast<int64_t>(code)) & ((uint64_t{1} << layout.value_bits) - 1);
          writer.Write(local | (bits << layout.index_bits), layout.index_bits + layout.value_bits);
        }
      }
    }
    writer.Flush();
  }
};

class ChunkUnpackOp : public ChunkWireOp {
 public:
  explicit ChunkUnpackOp(OpKernelConstruction* ctx) : ChunkWireOp(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    Layout layout;
    OP_REQUIRES_OK(ctx, WithLengths(ctx->input(1), &layout));
    OP_REQUIRES(ctx, rows.dims() == 2 && rows.dim_size(1) == layout.Words(),
                absl::InvalidArgumentError("rows must be [replicas, " + std::to_string(layout.Words()) +
                                           "] for this layout, got shape " + rows.shape().DebugString()));
    const int64_t replicas = rows.dim_size(0);
    Tensor* values = nullptr;
    Tensor* indices = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({replicas, layout.slots}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({replicas, layout.slots}), &indices));
    const uint32_t* all = reinterpret_cast<const uint32_t*>(rows.flat<float>().data());
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64_t words = layout.Words();
    pool->ParallelFor(replicas, 4 * layout.slots + 1, [&](int64_t first, int64_t last) {
      std::vector<int> steps(layout.chunks);
      for (int64_t r = first; r < last; ++r) {
        Read(layout, all + r * words, all + (r + 1) * words, &steps, values->flat<float>().data() + r * layout.slots,
             indices->flat<int32_t>().data() + r * layout.slots);
      }
    });
  }

 private:
  // One replica's words into its slots' values and flat indices.
  static void Read(const Layout& layout, const uint32_t* words, const uint32_t* end, std::vector<int>* steps,
                   float* values, int32_t* indices) {
    BitReader reader(words + layout.Members(), end);
    int64_t chunk = 0;
    for (int64_t m = 0; m < layout.Members(); ++m) {
      int32_t member;
      std::memcpy(&member, words + m, sizeof(member));
      for (int64_t c = 0; c < layout.chunk_count[m]; ++c, ++chunk) {
        (*steps)[chunk] = member - static_cast<int>(reader.Read(kChunkOffsetBits));
      }
    }
    const uint64_t local_mask = (uint64_t{1} << layout.index_bits) - 1;
    const int64_t wrap = int64_t{1} << layout.value_bits;
    chunk = 0;
    int64_t slot = 0;
    for (int64_t m = 0; m < layout.Members(); ++m) {
      for (int64_t c = 0; c < layout.chunk_count[m]; ++c, ++chunk) {
        const int64_t chunk_start = layout.starts[m] + c * layout.chunk_length[m];
        const int step = std::min(std::max((*steps)[chunk], kChunkMinExponent), kChunkMaxExponent);
        for (int64_t j = 0; j < layout.per_chunk[m]; ++j, ++slot) {
          const uint64_t field = reader.Read(layout.index_bits + layout.value_bits);
          const int64_t raw = static_cast<int64_t>(field >> layout.index_bits);
          const int64_t code = raw > layout.levels ? raw - wrap : raw;
          values[slot] = static_cast<float>(std::ldexp(static_cast<double>(code), step));
          indices[slot] = static_cast<int32_t>(chunk_start + static_cast<int64_t>(field & local_mask));
        }
      }
    }
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ChunkPack").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("R"),
                        ChunkPackOp<float>);
REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ChunkPack").Device(::tensorflow::DEVICE_CPU).TypeConstraint<double>("R"),
                        ChunkPackOp<double>);
REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ChunkUnpack").Device(::tensorflow::DEVICE_CPU), ChunkUnpackOp);

}  // namespace tf_topk
