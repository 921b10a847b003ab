// TensorFlow glue of the GPU kernel: scratch from TF's allocator, launch on
// the op's stream, errors through the context. The kernels themselves live in
// approx_topk.cuh (no TensorFlow include), shared with the standalone harness.
//
// No host synchronisation: LaunchApproxTopK only enqueues work; the outputs
// (allocated by the OpKernel) and the temp scratch are stream-ordered by TF's
// allocator, so freeing the scratch when Compute returns is safe.
//
// The CUDA selection is not deterministic (slots come from atomic counters):
// under tf.config.experimental.enable_op_determinism() the op refuses to run
// on the GPU, as TensorFlow's own nondeterministic GPU kernels do.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include "approx_topk_op.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "approx_topk.cuh"
#include "gpu_launch_hint.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/determinism.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_topk {
namespace {

// T is the TensorFlow element type, CudaT the CUDA type of the same bits.
template <typename T, typename CudaT>
void LaunchOnOpStream(::tensorflow::OpKernelContext* ctx, const T* input,
                      int64_t n, int64_t k, Method method, T* values,
                      int32_t* indices) {
  static_assert(sizeof(T) == sizeof(CudaT), "element types must match");
  OP_REQUIRES(
      ctx, !::tensorflow::OpDeterminismRequired(),
      absl::UnimplementedError(
          "ApproxTopK has no deterministic GPU kernel (its output order and "
          "the choice among tied entries vary from run to run), and op "
          "determinism is enabled (tf.config.experimental."
          "enable_op_determinism). Place the op on the CPU, whose kernel is "
          "deterministic: with tf.device('/CPU:0'): ..."));
  const int64_t bytes = static_cast<int64_t>(cuda::ScratchBytes(n, k));
  ::tensorflow::Tensor scratch;
  OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                         ::tensorflow::TensorShape({bytes}),
                                         &scratch));
  const cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
  const cudaError_t err = cuda::LaunchApproxTopK<CudaT>(
      reinterpret_cast<const CudaT*>(input), n, k, method,
      reinterpret_cast<CudaT*>(values), indices,
      static_cast<void*>(scratch.flat<int8_t>().data()), stream);
  // errors::Internal is deprecated in TF 2.21 in favour of this equivalent.
  OP_REQUIRES(ctx, err == cudaSuccess,
              absl::InternalError(absl::StrCat(
                  "ApproxTopK: launching the CUDA kernels failed: ",
                  cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                  LaunchFailureHint(err))));
}

}  // namespace

// Full explicit specializations of the member (strong symbols), then explicit
// instantiation definitions of the classes, matching the OpKernel's
// `extern template struct ApproxTopKFunctor<Eigen::GpuDevice, T>;`.
template <>
void ApproxTopKFunctor<Eigen::GpuDevice, float>::operator()(
    ::tensorflow::OpKernelContext* ctx, const float* input, int64_t n,
    int64_t k, Method method, float* values, int32_t* indices) {
  LaunchOnOpStream<float, float>(ctx, input, n, k, method, values, indices);
}

template <>
void ApproxTopKFunctor<Eigen::GpuDevice, Eigen::half>::operator()(
    ::tensorflow::OpKernelContext* ctx, const Eigen::half* input, int64_t n,
    int64_t k, Method method, Eigen::half* values, int32_t* indices) {
  LaunchOnOpStream<Eigen::half, __half>(ctx, input, n, k, method, values,
                                        indices);
}

template <>
void ApproxTopKFunctor<Eigen::GpuDevice, Eigen::bfloat16>::operator()(
    ::tensorflow::OpKernelContext* ctx, const Eigen::bfloat16* input,
    int64_t n, int64_t k, Method method, Eigen::bfloat16* values,
    int32_t* indices) {
  LaunchOnOpStream<Eigen::bfloat16, __nv_bfloat16>(ctx, input, n, k, method,
                                                   values, indices);
}

template struct ApproxTopKFunctor<Eigen::GpuDevice, float>;
template struct ApproxTopKFunctor<Eigen::GpuDevice, Eigen::half>;
template struct ApproxTopKFunctor<Eigen::GpuDevice, Eigen::bfloat16>;

}  // namespace tf_topk

#endif  // GOOGLE_CUDA
