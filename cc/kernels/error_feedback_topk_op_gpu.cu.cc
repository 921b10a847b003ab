// TensorFlow glue of the fused error-feedback selection's GPU kernels:
// scratch from TF's allocator, launch on the op's stream, errors through the
// context. The kernels live in error_feedback.cuh (no TensorFlow include),
// shared with the standalone harness.
//
// No host synchronisation: LaunchErrorFeedbackTopK only enqueues work; the
// outputs (allocated by the OpKernel, stats and profile included: they stay
// in device memory) and the temp scratch are stream-ordered by TF's
// allocator, so freeing the scratch when Compute returns is safe.
//
// The selection inside is the CUDA ApproxTopK, which is not deterministic
// (slots come from atomic counters; the sums of the statistics are atomics
// too): under tf.config.experimental.enable_op_determinism() the op refuses
// to run on the GPU, as the selection op does.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include "error_feedback_topk_op.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "error_feedback.cuh"
#include "gpu_launch_hint.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/determinism.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_topk {

static_assert(cuda::kStatAccumulatedSquares == kAccumulatedSquares &&
                  cuda::kStatRemainingSquares == kRemainingSquares &&
                  cuda::kStatNonFinite == kNonFinite &&
                  cuda::kNumStats == kNumErrorFeedbackStats,
              "the kernels' stats layout must match ErrorFeedbackStat");
static_assert(cuda::kProfileRows == kProfileRows,
              "the kernels' profile layout must match the op's");

namespace {

// T is the TensorFlow gradient type, CudaT the CUDA type of the same bits;
// the residual and every float output are float32; profile is nullptr when
// the op was built without it (with_profile=false).
template <typename T, typename CudaT>
void LaunchOnOpStream(::tensorflow::OpKernelContext* ctx, const T* gradient,
                      const float* residual, int64_t n, int64_t k,
                      Method method, float* values, int32_t* indices,
                      float* remaining, double* stats, double* profile) {
  static_assert(sizeof(T) == sizeof(CudaT), "element types must match");
  OP_REQUIRES(
      ctx, !::tensorflow::OpDeterminismRequired(),
      absl::UnimplementedError(
          "ErrorFeedbackTopK has no deterministic GPU kernel (its output "
          "order, the choice among tied entries and the last bits of its "
          "statistics vary from run to run), and op determinism is enabled "
          "(tf.config.experimental.enable_op_determinism). Place the op on "
          "the CPU, whose kernel is deterministic: with tf.device('/CPU:0'): "
          "..."));
  const cudaStream_t stream = ctx->eigen_device<Eigen::GpuDevice>().stream();
  if (n == 0) {  // an empty gradient: zero statistics, on the device
    cudaError_t err = cudaMemsetAsync(stats, 0, cuda::kNumStats * sizeof(double), stream);
    if (err == cudaSuccess && profile != nullptr) {
      err = cudaMemsetAsync(profile, 0, kProfileRows * kNumBins * sizeof(double), stream);
    }
    OP_REQUIRES(ctx, err == cudaSuccess,
                absl::InternalError(absl::StrCat("ErrorFeedbackTopK: zeroing the statistics failed: ",
                                                 cudaGetErrorName(err))));
    return;
  }
  const int64_t bytes =
      static_cast<int64_t>(cuda::ErrorFeedbackScratchBytes(n, k));
  ::tensorflow::Tensor scratch;
  OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                         ::tensorflow::TensorShape({bytes}),
                                         &scratch));
  const cudaError_t err = cuda::LaunchErrorFeedbackTopK<CudaT>(
      reinterpret_cast<const CudaT*>(gradient), residual, n, k, method, values,
      indices, remaining, stats, profile,
      bytes > 0 ? static_cast<void*>(scratch.flat<int8_t>().data()) : nullptr,
      stream);
  OP_REQUIRES(ctx, err == cudaSuccess,
              absl::InternalError(absl::StrCat(
                  "ErrorFeedbackTopK: launching the CUDA kernels failed: ",
                  cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                  LaunchFailureHint(err))));
}

}  // namespace

// Full explicit specializations of the member (strong symbols), then explicit
// instantiation definitions of the classes, matching the OpKernel's
// `extern template struct ErrorFeedbackTopKFunctor<GPUDevice, T, float>;`.
template <>
void ErrorFeedbackTopKFunctor<Eigen::GpuDevice, float, float>::operator()(
    ::tensorflow::OpKernelContext* ctx, const float* gradient,
    const float* residual, int64_t n, int64_t k, Method method, float* values,
    int32_t* indices, float* remaining, double* stats, double* profile,
    double /*profile_density: the CUDA kernel profiles every entry*/) {
  LaunchOnOpStream<float, float>(ctx, gradient, residual, n, k, method, values,
                                 indices, remaining, stats, profile);
}

template <>
void ErrorFeedbackTopKFunctor<Eigen::GpuDevice, Eigen::half, float>::operator()(
    ::tensorflow::OpKernelContext* ctx, const Eigen::half* gradient,
    const float* residual, int64_t n, int64_t k, Method method, float* values,
    int32_t* indices, float* remaining, double* stats, double* profile,
    double /*profile_density: the CUDA kernel profiles every entry*/) {
  LaunchOnOpStream<Eigen::half, __half>(ctx, gradient, residual, n, k, method,
                                        values, indices, remaining, stats,
                                        profile);
}

template <>
void ErrorFeedbackTopKFunctor<Eigen::GpuDevice, Eigen::bfloat16, float>::
operator()(::tensorflow::OpKernelContext* ctx, const Eigen::bfloat16* gradient,
           const float* residual, int64_t n, int64_t k, Method method,
           float* values, int32_t* indices, float* remaining, double* stats,
           double* profile,
           double /*profile_density: the CUDA kernel profiles every entry*/) {
  LaunchOnOpStream<Eigen::bfloat16, __nv_bfloat16>(
      ctx, gradient, residual, n, k, method, values, indices, remaining, stats,
      profile);
}

template struct ErrorFeedbackTopKFunctor<Eigen::GpuDevice, float, float>;
template struct ErrorFeedbackTopKFunctor<Eigen::GpuDevice, Eigen::half, float>;
template struct ErrorFeedbackTopKFunctor<Eigen::GpuDevice, Eigen::bfloat16,
                                         float>;

}  // namespace tf_topk

#endif  // GOOGLE_CUDA
