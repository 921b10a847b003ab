// Registers the chunk route's wire format: ChunkPack writes a bucket's rounded
// slots as packed words, ChunkUnpack reads every replica's words back.
#include <algorithm>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_topk {

using ::tensorflow::Tensor;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

// The bits of the packed fields (after the members' exponent words) and the
// slots, where the slots per member are constant; false where they are not.
bool KnownLayout(InferenceContext* c, int lengths_input, int64_t* words, int64_t* slots) {
  const Tensor* lengths = c->input_tensor(lengths_input);
  std::vector<int64_t> sizes;
  int64_t chunk = 1, value_bits = 2;
  if (lengths == nullptr || !c->GetAttr("sizes", &sizes).ok() || !c->GetAttr("chunk", &chunk).ok() ||
      !c->GetAttr("value_bits", &value_bits).ok() || lengths->NumElements() != static_cast<int64_t>(sizes.size()) ||
      chunk < 1) {
    return false;
  }
  int index_bits = 1;
  while ((int64_t{1} << index_bits) < chunk) ++index_bits;
  int64_t chunks = 0;
  *slots = 0;
  for (size_t m = 0; m < sizes.size(); ++m) {
    const int64_t length = std::min(chunk, sizes[m]);
    if (length < 1) return false;
    chunks += (sizes[m] + length - 1) / length;
    *slots += lengths->flat<int32_t>()(m);
  }
  const int64_t bits = 4 * chunks + (index_bits + value_bits) * *slots;
  *words = static_cast<int64_t>(sizes.size()) + (bits + 31) / 32;
  return true;
}

}  // namespace

REGISTER_OP("ImportTfTopk>ChunkPack")
    .Input("values: R")
    .Input("indices: int32")
    .Input("lengths: int32")
    .Output("words: float")
    .Attr("R: {float, double}")
    .Attr("sizes: list(int)")
    .Attr("starts: list(int)")
    .Attr("chunk: int >= 1")
    .Attr("value_bits: int")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      int64_t words = 0, slots = 0;
      c->set_output(0, KnownLayout(c, 2, &words, &slots) ? c->Vector(words) : c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The chunk route's words of one bucket (tf_topk/routes/chunked.py's format):
one int32 word per member, its exponent e_m, then, packed least significant
bit first across words, 4 bits per chunk (its offset o) and, per slot, the
index inside its chunk (ceil(log2(chunk)) bits) with the code c above it
(value_bits bits, two's complement). values and indices are the bucket's
selected slots, member after member (lengths[m] of member m, the same number
in each of its chunks), already rounded on their chunk's grid, so that c * 2**(e_m
- o) gives each value back. Member m has sizes[m] entries from flat index
starts[m], in chunks of min(chunk, sizes[m]). Returned as float32 (bit-cast).
)doc");

REGISTER_OP("ImportTfTopk>ChunkUnpack")
    .Input("rows: float")
    .Input("lengths: int32")
    .Output("values: float")
    .Output("indices: int32")
    .Attr("sizes: list(int)")
    .Attr("starts: list(int)")
    .Attr("chunk: int >= 1")
    .Attr("value_bits: int")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      int64_t words = 0, slots = 0;
      DimensionHandle slot_dim = KnownLayout(c, 1, &words, &slots) ? c->MakeDim(slots) : c->UnknownDim();
      ShapeHandle out = c->Matrix(c->Dim(rows, 0), slot_dim);
      c->set_output(0, out);
      c->set_output(1, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
ChunkPack's words of every replica (rows [replicas, words]) read back: each
slot's value c * 2**(e_m - o) in float32 and its flat index, [replicas, slots].
)doc");

}  // namespace tf_topk
