// Registers the selection op and its shape function.
//
// The op's name starts with "ImportTfTopk>": a SavedModel or graph that uses
// it, loaded in a process that has not imported tf_topk, fails with
// "Op type not registered 'ImportTfTopk>ApproxTopK'", which tells the reader
// what to do.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_topk {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("ImportTfTopk>ApproxTopK")
    .Input("x: T")
    .Input("k: int32")
    .Output("values: T")
    .Output("indices: int32")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("method: {'gaussian', 'exact'} = 'gaussian'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      // A constant k (a Python int) gives the static shape [k].
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(1, &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Selects about k entries of largest magnitude from the flattened input x.

Always returns exactly k (value, index) pairs: values are x at the returned
int32 positions of the flattened x (signed). Only finite, non-zero entries are
selected; when fewer than k qualify, the spare slots hold value 0 at index 0.
method "exact" returns the k largest magnitudes (ties broken any way);
"gaussian" places the threshold from a 2048-bin magnitude histogram refined
with a normal fit inside the threshold bin, and may leave a few slots spare.
)doc");

}  // namespace tf_topk
