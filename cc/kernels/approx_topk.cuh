// CUDA kernels of the top-k selection op. No TensorFlow include: the TF glue
// (approx_topk_op_gpu.cu.cc) and the standalone harness (benchmarks/gpu/)
// both compile this header, so the code tested against torch.topk on a GPU
// machine is the code TensorFlow runs.
//
// Entry points (namespace tf_topk::cuda):
//   ScratchBytes(n, k)    bytes of device scratch LaunchApproxTopK needs.
//   LaunchApproxTopK<T>() zeroes the scratch's counters, then enqueues every
//                         kernel on `stream`. Nothing is read back to the host
//                         and nothing synchronises: each kernel takes its
//                         parameters (plan, prefix, flags) from scratch,
//                         written by the kernels before it on the same stream.
//
// One pass over x when the sampled prefilter works (inputs of at least
// kMinPrefilterSize entries, k at most about 1/16 of them; topk_common.h):
//   [sample] -> [pass: candidates at or above the sample's threshold, their
//   histogram] -> plan -> {exact: [histogram 19:9] -> plan -> [histogram 8:0]
//   -> plan, over the candidates} -> [compaction of the candidates]
// Otherwise, or when the candidates turn out too few or too many (the
// fallback kernels run, and do nothing when not needed):
//   gaussian: [histogram + moments] -> plan -> [compaction]          2 passes
//   exact:    [histogram 30:20] -> plan -> [histogram 19:9] -> plan
//             -> [histogram 8:0] -> plan -> [compaction]             4 passes
// then [finish], over the output slots only: the gaussian fill copies, from
// a list the compaction kept, entries of the threshold bin below the normal
// fit's threshold into the slots the entries above it left empty (k slots
// are filled whenever k entries qualify), and spare slots get zeros. All
// passes over x are grid-stride with 16-byte vector loads.
//
// The plan arithmetic (sample, crossing, exact radix levels, normal fit,
// entry classes, fill count) is in topk_common.h, shared with the CPU kernel
// and with the CPU emulation of this algorithm that the tests run without a
// GPU (cc/emulation/gpu_emulation.cc).
//
// The kernels live in one header per stage, included below in launch order;
// this header adds the host side. Include this one: the stage headers are
// its parts, not separate interfaces.
//   approx_topk_scratch.cuh     launch constants, device scratch layout
//   approx_topk_primitives.cuh  raw-bit element types, grid-stride loops,
//                               slot claims, block sums, crossing search
//   approx_topk_sample.cuh      [sample]
//   approx_topk_collect.cuh     [pass: candidates and their histogram]
//   approx_topk_histogram.cuh   the [histogram] passes
//   approx_topk_plan.cuh        plan
//   approx_topk_finish.cuh      [compaction], [finish]
//
// Not deterministic: slots come from atomic counters, so the output order,
// and which of several equal-priority tied entries fill the last slots,
// vary from run to run (the set above the threshold bin does not). The TF
// op refuses to run on the GPU under op determinism.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_CUH_

#include <cuda_runtime.h>  // before topk_common.h: erfc/sqrt resolve on device
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "topk_common.h"

// The stages, in launch order.
#include "approx_topk_scratch.cuh"
#include "approx_topk_primitives.cuh"
#include "approx_topk_sample.cuh"
#include "approx_topk_collect.cuh"
#include "approx_topk_histogram.cuh"
#include "approx_topk_plan.cuh"
#include "approx_topk_finish.cuh"

namespace tf_topk {
namespace cuda {

// Host side.

// Blocks for a streaming pass of `kernel`: as many as the GPU holds at once
// (one wave), fewer when the input is small (each block then does one
// iteration).
template <typename Kernel>
inline int StreamingBlocks(int64_t n, int vec, Kernel kernel) {
  int device = 0;
  int sms = 0;
  int blocks_per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      sms <= 0) {
    sms = 132;  // H100 SXM; only the speed depends on it
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                    kThreads, 0) != cudaSuccess ||
      blocks_per_sm <= 0) {
    (void)cudaGetLastError();  // the launch reports real trouble
    blocks_per_sm = 1;
  }
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll * vec;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sms) * blocks_per_sm;
  int64_t blocks = wanted < cap ? wanted : cap;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks);
}

// Selects k entries of x[0:n] (see the op's documentation): writes values[0:k]
// and indices[0:k]; spare slots hold 0. Everything is enqueued on `stream`;
// `scratch` (ScratchBytes(n, k) bytes of device memory, 8-byte aligned) must
// not be used by anything else until the stream has passed this work. Returns
// the first error seen while enqueuing.
template <typename T>
cudaError_t LaunchApproxTopK(const T* x, int64_t n, int64_t k, Method method,
                             T* values, int32_t* indices, void* scratch,
                             cudaStream_t stream) {
  if (x == nullptr || values == nullptr || indices == nullptr ||
      scratch == nullptr || n < 1 || n > 0x7fffffffLL || k < 1 || k > n ||
      (reinterpret_cast<uintptr_t>(scratch) & 7u) != 0u ||
      (reinterpret_cast<uintptr_t>(x) & (sizeof(T) - 1)) != 0u) {
    return cudaErrorInvalidValue;
  }
  // Clear a stale error left by an earlier failed call of this runtime (this
  // library's own: cudart is linked statically), so the result below is ours.
  (void)cudaGetLastError();
  // Neither the lists nor the outputs need clearing: only written candidates
  // and fill entries are read, and FinishKernel writes every slot the
  // compaction left.
  const cudaError_t err =
      cudaMemsetAsync(scratch, 0, ScratchHeaderBytes(), stream);
  if (err != cudaSuccess) return err;

  using Bits = typename Traits<T>::Bits;
  Scratch* s = static_cast<Scratch*>(scratch);
  Candidate* candidates = CandidateList(scratch);
  int32_t* fill_list = FillList(scratch, n, k);
  const long long capacity = CandidateCapacity(n, k);
  const bool prefilter = capacity > 0;  // else no sample and no fallback
  // Levels 1 (two-pass and fallback), 2 and 3 share their resources.
  const int blocks = StreamingBlocks(n, Traits<T>::kVec,
                                     HistogramKernel<T, 2, false, false>);
  const int compact_blocks =
      StreamingBlocks(n, Traits<T>::kVec, CompactKernel<T>);
  const long long kk = static_cast<long long>(k);
  if (prefilter) {
    SampleKernel<T><<<kSampleBlocks, kSampleThreads, 0, stream>>>(x, n, kk, s);
  }
  // The level-1 pass over x: the candidates (prefilter) or every entry. The
  // kernels after it check the state's flags themselves (fallback, done), so
  // the sequence is fixed at launch.
  const bool gaussian = method == Method::kGaussian;
  if (prefilter) {
    CollectKernel<T><<<StreamingBlocks(n, Traits<T>::kVec, CollectKernel<T>),
                       kThreads, 0, stream>>>(x, n, s, candidates, capacity);
  }
  if (gaussian) {
    if (!prefilter) {
      HistogramKernel<T, 1, true, false>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    }
    PlanGaussianKernel<false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    if (prefilter) {
      HistogramKernel<T, 1, true, true>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
      PlanGaussianKernel<true><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    }
  } else {
    if (!prefilter) {
      HistogramKernel<T, 1, false, false>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    }
    PlanExactKernel<1, false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    if (prefilter) {
      HistogramKernel<T, 1, false, true>
          <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
      PlanExactKernel<1, true><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    }
  }
  if (!gaussian) {  // levels 2 and 3, over the candidates or all of x
    HistogramKernel<T, 2, false, false>
        <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    PlanExactKernel<2, false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
    HistogramKernel<T, 3, false, false>
        <<<blocks, kThreads, 0, stream>>>(x, n, s, candidates, capacity);
    PlanExactKernel<3, false><<<1, kPlanThreads, 0, stream>>>(s, kk, capacity);
  }
  CompactKernel<T><<<compact_blocks, kThreads, 0, stream>>>(
      x, n, kk, s, candidates, capacity, fill_list,
      reinterpret_cast<Bits*>(values), indices);
  // At most k slots to finish, usually none or a few: a small grid.
  const int64_t wanted = (k + kThreads - 1) / kThreads;
  const int finish_blocks = static_cast<int>(wanted < 256 ? wanted : 256);
  FinishKernel<T><<<finish_blocks, kThreads, 0, stream>>>(
      x, kk, s, fill_list, reinterpret_cast<Bits*>(values), indices);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_CUH_
