// Registers the chunk-wise error-feedback selection op and its shape function.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_topk {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("ImportTfTopk>ErrorFeedbackChunkTopK")
    .Input("gradient: T")
    .Input("residual: R")
    .Input("k: int32")
    .Output("values: R")
    .Output("indices: int32")
    .Output("remaining: R")
    .Output("stats: double")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("R: {float, double}")
    .Attr("chunk: int >= 1")
    .Attr("value_bits: int = 0")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      int64_t chunk = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("chunk", &chunk));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &k));
      DimensionHandle n = c->NumElements(c->input(0));
      DimensionHandle slots = c->UnknownDim();
      if (c->ValueKnown(n) && c->ValueKnown(k)) {
        slots = c->MakeDim((c->Value(n) + chunk - 1) / chunk * c->Value(k));
      }
      c->set_output(0, c->Vector(slots));
      c->set_output(1, c->Vector(slots));
      c->set_output(2, c->Vector(n));
      c->set_output(3, c->Vector(3));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Error feedback and a chunk-wise selection in one pass: accumulated = gradient +
residual (in R, the residual's dtype), cut into chunks of `chunk` entries (the
last one shorter); in chunk c, slots c*k to c*k + k - 1 hold the k entries of
largest magnitude among its finite non-zero ones, largest first (ties: the
earlier index), as values and flat indices into accumulated; spare slots
(fewer qualify) hold value 0 at the chunk's first index. remaining =
accumulated with the selected entries set to zero, flat. With value_bits 2,
3, 4 or 8 the selected values are rounded to c * 2**(e_m - o), c in [-L, L]
(L = 2**(value_bits - 1) - 1), o = min(15, e_m - e) for the chunk's own
exponent e (L = 1: the power of two nearest the mean magnitude of its selected
entries; else the smallest with max <= L * 2**e) and e_m the largest over the
chunks; each rounding error stays in remaining, and a slot rounded to 0 holds
value 0 at the chunk's first index. stats as
ErrorFeedbackTopK's: [sum of squares of the finite entries of accumulated, the
same of remaining, number of non-finite entries of accumulated]. 1 <= k <=
chunk. The residual input is not modified.
)doc");

}  // namespace tf_topk
