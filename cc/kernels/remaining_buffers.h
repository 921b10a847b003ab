// The `remaining` output of the error-feedback selections (ErrorFeedbackTopK,
// ErrorFeedbackChunkTopK), from buffers the kernel keeps.
//
// A fresh buffer of the residual's size every step would cost more than the
// whole pass (the allocator hands back unmapped memory for large tensors, and
// every page faults on first write). The caller assigns `remaining` to the
// residual variable, which then holds that buffer; a buffer comes back for
// reuse once nobody but this kernel holds it (the variable moved on to a
// newer one, or the step was skipped). Under TensorFlow's copy-on-write rule
// for variables a holder never sees the buffer change: an in-place write to a
// variable whose buffer is shared copies it first.
//
// What a kernel keeps is bounded: at most kMaxBuffers buffers, all of the
// last call's size; each call lets go of those nobody else holds but the one
// it writes into. A call of a new size keeps nothing and lets every buffer
// go: it is a one-off, or the kernel serves several sizes (an eager kernel is
// shared by every call with the same attributes and device), and either way
// nothing kept would be reused. So only a step repeated at one size (a
// tf.function's kernel runs once per step) holds buffers, and they are what
// that step needs.
#ifndef TF_TOPK_CC_KERNELS_REMAINING_BUFFERS_H_
#define TF_TOPK_CC_KERNELS_REMAINING_BUFFERS_H_

#include <utility>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/mutex.h"

namespace tf_topk {

class RemainingBuffers {
 public:
  // Output `index` of `ctx` as a vector of `n` entries of `dtype`, in a kept
  // buffer where one is free.
  absl::Status Output(::tensorflow::OpKernelContext* ctx, int index, ::tensorflow::DataType dtype, int64_t n,
                      ::tensorflow::Tensor** remaining) {
    ::tensorflow::mutex_lock lock(mu_);
    if (n != last_size_ || n == 0) {
      buffers_.clear();
      last_size_ = n;
      return ctx->allocate_output(index, ::tensorflow::TensorShape({n}), remaining);
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
        return ctx->allocate_output(index, ::tensorflow::TensorShape({n}), remaining);
      }
      ::tensorflow::Tensor buffer;
      TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, ::tensorflow::TensorShape({n}), &buffer));
      buffers_.push_back(std::move(buffer));
      spare = static_cast<int>(buffers_.size()) - 1;
    }
    ctx->set_output(index, buffers_[spare]);
    *remaining = ctx->mutable_output(index);
    return absl::OkStatus();
  }

 private:
  // The residual a variable holds and the one being computed; a third when
  // a step runs before the previous one released its buffer.
  static constexpr size_t kMaxBuffers = 3;

  ::tensorflow::mutex mu_;
  std::vector<::tensorflow::Tensor> buffers_ TF_GUARDED_BY(mu_);  // all of last_size_
  int64_t last_size_ TF_GUARDED_BY(mu_) = -1;  // entries of the last call
};

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_REMAINING_BUFFERS_H_
