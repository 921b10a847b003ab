// The argument checks both selection ops make: the `method` attribute in the
// constructor; in Compute, k a scalar in [0, n] and n within int32 indices.
// The errors name the argument and the value, as the Python wrappers' do.
#ifndef TF_TOPK_CC_KERNELS_SELECTION_ARGUMENTS_H_
#define TF_TOPK_CC_KERNELS_SELECTION_ARGUMENTS_H_

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "topk_common.h"

namespace tf_topk {

// The `method` attribute as a Method, or the error. The op registrations
// already allow only these two names; the message is the Python wrappers'
// (tf_topk/ops.py) for the same mistake.
inline absl::Status MethodAttr(::tensorflow::OpKernelConstruction* ctx, Method* method) {
  std::string name;
  TF_RETURN_IF_ERROR(ctx->GetAttr("method", &name));
  if (name == "gaussian") {
    *method = Method::kGaussian;
  } else if (name == "exact") {
    *method = Method::kExact;
  } else {
    return absl::InvalidArgumentError("method must be one of ('gaussian', 'exact'), got '" + name + "'");
  }
  return absl::OkStatus();
}

// k from `k_tensor` for an input `what` of n entries, or the error.
inline absl::Status CheckSelectionArguments(const ::tensorflow::Tensor& k_tensor, int64_t n,
                                            const std::string& what, int64_t* k) {
  if (k_tensor.dims() != 0) {
    return absl::InvalidArgumentError("k must be a scalar, got shape " + k_tensor.shape().DebugString());
  }
  *k = k_tensor.scalar<int32_t>()();
  if (*k < 0) return absl::InvalidArgumentError("k must be >= 0, got k = " + std::to_string(*k));
  if (n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(what + " has " + std::to_string(n) +
                                      " entries; at most 2^31 - 1 are supported (indices are int32)");
  }
  if (*k > n) {
    return absl::InvalidArgumentError("k must be <= the number of entries of " + what + " (" + std::to_string(n) +
                                      "), got k = " + std::to_string(*k));
  }
  return absl::OkStatus();
}

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_SELECTION_ARGUMENTS_H_
