// The fused error-feedback selection's OpKernel (argument checks, output
// allocation, the `remaining` buffers) and its CPU functor; the CPU algorithm
// itself is in error_feedback_cpu.h.
//
// The residual is an input, not modified: the exchange assigns `remaining`
// to the residual variable only when every replica's step was finite (an
// assignment hands over the buffer, it copies nothing), so a skipped step
// leaves the residual exactly as it was. `remaining` lives in buffers the
// kernel recycles (RemainingBuffers), so a step repeated at the same size
// allocates no fresh memory.
#define EIGEN_USE_THREADS

#include "error_feedback_topk_op.h"

#include <string>
#include <utility>
#include <vector>

#include "error_feedback_cpu.h"
#include "remaining_buffers.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "selection_arguments.h"
#include "topk_cpu.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_topk {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

template <typename T, typename R>
void ErrorFeedbackTopKFunctor<CPUDevice, T, R>::operator()(
    OpKernelContext* ctx, const T* gradient, const R* residual, int64_t n,
    int64_t k, Method method, R* values, int32_t* indices, R* remaining,
    double* stats, double* profile, double profile_density) {
  const cpu::Blocks blocks(ctx, n);  // no block when n == 0
  cpu::ErrorFeedbackTopK(blocks, gradient, residual, n, k, method, values,
                         indices, remaining, stats, profile, profile_density);
}

template <typename Device, typename T, typename R>
class ErrorFeedbackTopKOp : public OpKernel {
 public:
  explicit ErrorFeedbackTopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, MethodAttr(ctx, &method_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_profile", &with_profile_));
    float profile_density = 1.0f;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("profile_density", &profile_density));
    OP_REQUIRES(ctx, profile_density > 0.0f && profile_density <= 1.0f,
                absl::InvalidArgumentError("profile_density must be in (0, 1], got " +
                                           std::to_string(profile_density)));
    profile_density_ = profile_density;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& gradient = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const int64_t n = gradient.NumElements();
    OP_REQUIRES(ctx, residual.NumElements() == n,
                absl::InvalidArgumentError(
                    "residual must have as many entries as gradient (" +
                    std::to_string(n) + "), got shape " +
                    residual.shape().DebugString()));
    int64_t k = 0;
    OP_REQUIRES_OK(ctx, CheckSelectionArguments(ctx->input(2), n, "gradient", &k));
    Tensor* values = nullptr;
    Tensor* indices = nullptr;
    Tensor* remaining = nullptr;
    Tensor* stats = nullptr;
    Tensor* profile = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    OP_REQUIRES_OK(ctx, remaining_buffers_.Output(ctx, 2, residual.dtype(), n, &remaining));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            3, TensorShape({kNumErrorFeedbackStats}), &stats));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            4, TensorShape({kProfileRows, with_profile_ ? kNumBins : 0}),
                            &profile));
    // n == 0 too: the functor zeroes the statistics on its device.
    ErrorFeedbackTopKFunctor<Device, T, R>()(
        ctx, gradient.flat<T>().data(), residual.flat<R>().data(), n, k,
        method_, values->flat<R>().data(), indices->flat<int32_t>().data(),
        remaining->flat<R>().data(), stats->flat<double>().data(),
        with_profile_ ? profile->flat<double>().data() : nullptr, profile_density_);
  }

 private:
  Method method_ = Method::kGaussian;
  bool with_profile_ = false;
  double profile_density_ = 1.0;
  RemainingBuffers remaining_buffers_;
};

#define TF_TOPK_REGISTER_CPU(T, R)                                      \
  template struct ErrorFeedbackTopKFunctor<CPUDevice, T, R>;            \
  REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ErrorFeedbackTopK")        \
                              .Device(::tensorflow::DEVICE_CPU)         \
                              .TypeConstraint<T>("T")                   \
                              .TypeConstraint<R>("R"),                  \
                          ErrorFeedbackTopKOp<CPUDevice, T, R>);
TF_TOPK_REGISTER_CPU(float, float);
TF_TOPK_REGISTER_CPU(Eigen::half, float);
TF_TOPK_REGISTER_CPU(Eigen::bfloat16, float);
TF_TOPK_REGISTER_CPU(double, double);
#undef TF_TOPK_REGISTER_CPU

#if GOOGLE_CUDA
#define TF_TOPK_REGISTER_GPU(T)                                         \
  extern template struct ErrorFeedbackTopKFunctor<GPUDevice, T, float>; \
  REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ErrorFeedbackTopK")        \
                              .Device(::tensorflow::DEVICE_GPU)         \
                              .TypeConstraint<T>("T")                   \
                              .TypeConstraint<float>("R")               \
                              .HostMemory("k"),                         \
                          ErrorFeedbackTopKOp<GPUDevice, T, float>);
TF_TOPK_REGISTER_GPU(float);
TF_TOPK_REGISTER_GPU(Eigen::half);
TF_TOPK_REGISTER_GPU(Eigen::bfloat16);
#undef TF_TOPK_REGISTER_GPU
#endif  // GOOGLE_CUDA

}  // namespace tf_topk
