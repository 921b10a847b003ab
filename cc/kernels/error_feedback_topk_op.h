// The fused error-feedback selection functor, one specialization per device:
// the OpKernel in error_feedback_topk_op.cc validates arguments and allocates
// outputs, then calls ErrorFeedbackTopKFunctor<Device, T, R>.
#ifndef TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_TOPK_OP_H_
#define TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_TOPK_OP_H_

#include "tensorflow/core/framework/op_kernel.h"

#include "topk_common.h"

namespace Eigen {
struct ThreadPoolDevice;
struct GpuDevice;
}  // namespace Eigen

namespace tf_topk {

// The three statistics the op returns, in this order.
enum ErrorFeedbackStat : int {
  kAccumulatedSquares = 0,  // sum of squares of the finite accumulated entries
  kRemainingSquares = 1,    // the same after the selected entries are zeroed
  kNonFinite = 2,           // number of non-finite accumulated entries
  kNumErrorFeedbackStats = 3,
};

// The profile (with_profile): count and sum of squares of the finite,
// non-zero accumulated entries per magnitude bin (BinOf), row 0 and row 1 of
// a [2, kNumBins] double array.
constexpr int kProfileRows = 2;

// accumulated = R(gradient) + residual over n >= 0 entries, written to
// `remaining` (which may be `residual` itself); values[0:k] and
// indices[0:k] get the selection of ApproxTopK on accumulated (spare slots:
// value 0 at index 0); the selected entries of `remaining` are then zeroed;
// stats[0:3] as ErrorFeedbackStat; profile (nullptr: not wanted) as above,
// exact at least for the entries down to the rank profile_density * n from
// the top (a kernel may profile more). Reports failures through ctx.
template <typename Device, typename T, typename R>
struct ErrorFeedbackTopKFunctor;

// CPU: error_feedback_topk_op.cc, running the algorithm of error_feedback_cpu.h.
template <typename T, typename R>
struct ErrorFeedbackTopKFunctor<Eigen::ThreadPoolDevice, T, R> {
  void operator()(::tensorflow::OpKernelContext* ctx, const T* gradient,
                  const R* residual, int64_t n, int64_t k, Method method,
                  R* values, int32_t* indices, R* remaining, double* stats,
                  double* profile, double profile_density);
};

#if GOOGLE_CUDA
// GPU: error_feedback_topk_op_gpu.cu.cc, for T float, half, bfloat16 and
// R float; stats stay in device memory.
template <typename T, typename R>
struct ErrorFeedbackTopKFunctor<Eigen::GpuDevice, T, R> {
  void operator()(::tensorflow::OpKernelContext* ctx, const T* gradient,
                  const R* residual, int64_t n, int64_t k, Method method,
                  R* values, int32_t* indices, R* remaining, double* stats,
                  double* profile, double profile_density);
};
#endif  // GOOGLE_CUDA

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_TOPK_OP_H_
