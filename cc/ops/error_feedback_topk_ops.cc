// Registers the fused error-feedback selection op and its shape function.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_topk {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("ImportTfTopk>ErrorFeedbackTopK")
    .Input("gradient: T")
    .Input("residual: R")
    .Input("k: int32")
    .Output("values: R")
    .Output("indices: int32")
    .Output("remaining: R")
    .Output("stats: double")
    .Output("profile: double")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("R: {float, double}")
    .Attr("method: {'gaussian', 'exact'} = 'gaussian'")
    .Attr("with_profile: bool = false")
    .Attr("profile_density: float = 1.0")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      c->set_output(2, c->Vector(c->NumElements(c->input(0))));
      c->set_output(3, c->Vector(3));
      bool with_profile = false;
      TF_RETURN_IF_ERROR(c->GetAttr("with_profile", &with_profile));
      c->set_output(4, c->Matrix(2, with_profile ? 2048 : 0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Error feedback and selection in one pass: accumulated = gradient + residual
(in R, the residual's dtype), the ~k entries of largest magnitude of it
selected as ApproxTopK selects them, and remaining = accumulated with the
selected entries set to zero, flat. stats = [sum of squares of the finite
entries of accumulated, the same of remaining, number of non-finite entries
of accumulated]. With with_profile, profile[0, b] and profile[1, b] are the
number and the sum of squares of the finite non-zero accumulated entries in
magnitude bin b (the selection's 2048 logarithmic bins, 1/8 octave wide):
the energy of the top-k for every k, at bin resolution, for choosing k;
else profile is [2, 0]. With profile_density < 1 the CPU kernel may leave
out entries below the magnitude of about the (profile_density * n)-th
largest (estimated from its sample, with a margin): the profile is exact
from the top down to at least that rank. The residual input is not modified: the caller
assigns remaining to it when the step is kept.
)doc");

}  // namespace tf_topk
