// The selection op's OpKernel (argument checks, output allocation) and its
// CPU functor; the CPU algorithm itself is in topk_cpu.h.
#define EIGEN_USE_THREADS

#include "approx_topk_op.h"

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

template <typename T>
void ApproxTopKFunctor<CPUDevice, T>::operator()(OpKernelContext* ctx,
                                                 const T* input, int64_t n,
                                                 int64_t k, Method method,
                                                 T* values,
                                                 int32_t* indices) {
  const cpu::Blocks blocks(ctx, n);
  if (cpu::SelectFromCandidates(blocks, input, n, k, method, values,
                                indices)) {
    return;
  }
  cpu::SelectWithTwoPasses(blocks, input, k, method, values, indices);
}

template <typename Device, typename T>
class ApproxTopKOp : public OpKernel {
 public:
  explicit ApproxTopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, MethodAttr(ctx, &method_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int64_t n = x.NumElements();
    int64_t k = 0;
    OP_REQUIRES_OK(ctx, CheckSelectionArguments(ctx->input(1), n, "x", &k));
    Tensor* values = nullptr;
    Tensor* indices = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    if (k == 0) return;
    ApproxTopKFunctor<Device, T>()(ctx, x.flat<T>().data(), n, k, method_,
                                   values->flat<T>().data(),
                                   indices->flat<int32_t>().data());
  }

 private:
  Method method_ = Method::kGaussian;
};

#define TF_TOPK_REGISTER_CPU(T)                                      \
  template struct ApproxTopKFunctor<CPUDevice, T>;                   \
  REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ApproxTopK")            \
                              .Device(::tensorflow::DEVICE_CPU)      \
                              .TypeConstraint<T>("T"),               \
                          ApproxTopKOp<CPUDevice, T>);
TF_TOPK_REGISTER_CPU(float);
TF_TOPK_REGISTER_CPU(Eigen::half);
TF_TOPK_REGISTER_CPU(Eigen::bfloat16);
TF_TOPK_REGISTER_CPU(double);
#undef TF_TOPK_REGISTER_CPU

#if GOOGLE_CUDA
#define TF_TOPK_REGISTER_GPU(T)                                      \
  extern template struct ApproxTopKFunctor<GPUDevice, T>;            \
  REGISTER_KERNEL_BUILDER(Name("ImportTfTopk>ApproxTopK")            \
                              .Device(::tensorflow::DEVICE_GPU)      \
                              .TypeConstraint<T>("T")                \
                              .HostMemory("k"),                      \
                          ApproxTopKOp<GPUDevice, T>);
TF_TOPK_REGISTER_GPU(float);
TF_TOPK_REGISTER_GPU(Eigen::half);
TF_TOPK_REGISTER_GPU(Eigen::bfloat16);
#undef TF_TOPK_REGISTER_GPU
#endif  // GOOGLE_CUDA

}  // namespace tf_topk
