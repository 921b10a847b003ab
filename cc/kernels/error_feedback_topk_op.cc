// The fused error-feedback selection's OpKernel (argument checks, output
// allocation, the `remaining` buffers) and its CPU functor; the CPU algorithm
// itself is in error_feedback_cpu.h.
//
// The residual is an input, not modified: the exchange assigns `remaining`
// to the residual variable only when every replica's step was finite (an
// assignment hands over the buffer, it copies nothing), so a skipped step
// leaves the residual exactly as it was. `remaining` lives in buffers the
// kernel recycles (RemainingBuffer), so a step repeated at the same size
// allocates no fresh memory.
#define EIGEN_USE_THREADS

#include "error_feedback_topk_op.h"

#include <string>
#include <utility>
#include <vector>

#include "error_feedback_cpu.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/platform/mutex.h"
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

  // The `remaining` output, from buffers this kernel keeps. A fresh buffer
  // of the residual's size every step would cost more than the whole pass
  // (the allocator hands back unmapped memory for large tensors, and every
  // page faults on first write). The caller assigns `remaining` to the
  // residual variable, which then holds that buffer; a buffer comes back for
  // reuse once nobody but this kernel holds it (the variable moved on to a
  // newer one, or the step was skipped). Under TensorFlow's copy-on-write
  // rule for variables a holder never sees the buffer change: an in-place
  // write to a variable whose buffer is shared copies it first.
  //
  // What the kernel keeps is bounded: at most kMaxBuffers buffers, all of
  // the last call's size; each call lets go of those nobody else holds but
  // the one it writes into. A call of a new size keeps nothing and lets
  // every buffer go: it is a one-off, or the kernel serves several sizes (an
  // eager kernel is shared by every call with the same attributes and
  // device), and either way nothing kept would be reused. So only a step
  // repeated at one size (a tf.function's kernel runs once per step) holds
  // buffers, and they are what that step needs.
  absl::Status RemainingBuffer(OpKernelContext* ctx,
                               ::tensorflow::DataType dtype, int64_t n,
                               Tensor** remaining) {
    ::tensorflow::mutex_lock lock(mu_);
    if (n != last_size_ || n == 0) {
      buffers_.clear();
      last_size_ = n;
      return ctx->allocate_output(2, TensorShape({n}), remaining);
    }
    // The first buffer nobody else holds becomes the output; other such
    // buffers are released (the variable moved on, or outputs were dropped).
    int spare = -1;
    for (int i = 0; i < static_cast<int>(buffers_.size());) {
      if (!buffers_[i].RefCountIsOne()) {
        ++i;
      } else if (spare < 0) {
        spare = i++;
      } else {
        buffers_.erase(buffers_.begin() + i);
      }
    }
    if (spare < 0) {
      if (buffers_.size() >= kMaxBuffers) {  // steps in flight: no reuse
        return ctx->allocate_output(2, TensorShape({n}), remaining);
      }
      Tensor buffer;
      TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, TensorShape({n}), &buffer));
      buffers_.push_back(std::move(buffer));
      spare = static_cast<int>(buffers_.size()) - 1;
    }
    ctx->set_output(2, buffers_[spare]);
    *remaining = ctx->mutable_output(2);
    return absl::OkStatus();
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
    OP_REQUIRES_OK(ctx, RemainingBuffer(ctx, residual.dtype(), n, &remaining));
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
  // The residual a variable holds and the one being computed; a third when
  // a step runs before the previous one released its buffer.
  static constexpr size_t kMaxBuffers = 3;

  Method method_ = Method::kGaussian;
  bool with_profile_ = false;
  double profile_density_ = 1.0;
  ::tensorflow::mutex mu_;
  std::vector<Tensor> buffers_ TF_GUARDED_BY(mu_);  // all of last_size_
  int64_t last_size_ TF_GUARDED_BY(mu_) = -1;  // entries of the last call
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
