// The selection functor, one specialization per device (TensorFlow's custom
// op layout): the OpKernel in approx_topk_op.cc validates arguments and
// allocates outputs, then calls ApproxTopKFunctor<Device, T>.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_OP_H_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_OP_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

#include "topk_common.h"

namespace Eigen {
struct ThreadPoolDevice;
struct GpuDevice;
}  // namespace Eigen

namespace tf_topk {

// Fills values[0:k] and indices[0:k] (already allocated, k >= 1, the input
// holds n >= 1 entries, n < 2^31) with the selected entries of the flattened
// input. Slots left over when fewer than k entries qualify hold value 0 and
// index 0. Reports failures through ctx (OP_REQUIRES style).
template <typename Device, typename T>
struct ApproxTopKFunctor;

// CPU: approx_topk_op.cc. Multithreaded on the intra-op thread pool.
template <typename T>
struct ApproxTopKFunctor<Eigen::ThreadPoolDevice, T> {
  void operator()(::tensorflow::OpKernelContext* ctx, const T* input,
                  int64_t n, int64_t k, Method method, T* values,
                  int32_t* indices);
};

#if GOOGLE_CUDA
// GPU: approx_topk_op_gpu.cu.cc, launching the kernels of approx_topk.cuh on
// the op's stream. Explicitly instantiated there for float, half, bfloat16.
template <typename T>
struct ApproxTopKFunctor<Eigen::GpuDevice, T> {
  void operator()(::tensorflow::OpKernelContext* ctx, const T* input,
                  int64_t n, int64_t k, Method method, T* values,
                  int32_t* indices);
};
#endif  // GOOGLE_CUDA

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_OP_H_
