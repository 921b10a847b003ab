// What a user can do about a failed launch of this library's CUDA kernels:
// shared by the TF glue of the GPU ops (*_op_gpu.cu.cc).
#ifndef TF_TOPK_CC_KERNELS_GPU_LAUNCH_HINT_H_
#define TF_TOPK_CC_KERNELS_GPU_LAUNCH_HINT_H_

#if GOOGLE_CUDA

#include <cuda_runtime.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace tf_topk {

// A sentence to append to the error message for the launch failures a user
// can fix (no kernel for this GPU, a driver older than the runtime); empty
// for the others.
inline std::string LaunchFailureHint(cudaError_t err) {
  if (err == cudaErrorNoKernelImageForDevice ||
      err == cudaErrorUnsupportedPtxVersion) {
    int device = 0, major = 0, minor = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    return absl::StrCat(
        ". The op library has no kernel for this GPU (compute capability ",
        major, ".", minor, "): rebuild it with TF_TOPK_CUDA_ARCHS=", major,
        minor, " (and an nvcc that supports it) and: pip install "
        "--no-build-isolation -e . (or: python cc/build_ops.py)");
  }
  if (err == cudaErrorInsufficientDriver) {
    return ". The NVIDIA driver is older than the CUDA runtime the op library "
           "was built with (CUDA 13 needs driver 580 or newer): update the "
           "driver, or rebuild the library with the CUDA toolkit the driver "
           "supports";
  }
  return "";
}

}  // namespace tf_topk

#endif  // GOOGLE_CUDA

#endif  // TF_TOPK_CC_KERNELS_GPU_LAUNCH_HINT_H_
