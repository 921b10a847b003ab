// Standalone C entry points around the op's CUDA kernels (no TensorFlow), so
// benchmarks/gpu_check.py can check and time the exact code the TF op runs,
// on device memory owned by PyTorch. Build (gpu_check.py does this):
//
//   nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -arch=sm_90 \
//        benchmarks/gpu/harness.cu -o libtf_topk_harness.so
//
// Pointers are device pointers; `stream` is a cudaStream_t (0: the legacy
// default stream). Every select call returns a cudaError_t as int (0: ok).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../cc/kernels/approx_topk.cuh"

namespace {

template <typename T>
int Select(const void* x, long long n, long long k, int method, void* values,
           void* indices, void* scratch, void* stream) {
  if (method != static_cast<int>(tf_topk::Method::kGaussian) &&
      method != static_cast<int>(tf_topk::Method::kExact)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(tf_topk::cuda::LaunchApproxTopK<T>(
      static_cast<const T*>(x), static_cast<int64_t>(n),
      static_cast<int64_t>(k), static_cast<tf_topk::Method>(method),
      static_cast<T*>(values), static_cast<int32_t*>(indices), scratch,
      static_cast<cudaStream_t>(stream)));
}

}  // namespace

extern "C" {

size_t tf_topk_scratch_bytes(long long n, long long k) {
  return tf_topk::cuda::ScratchBytes(static_cast<int64_t>(n), static_cast<int64_t>(k));
}

// 1 when built with -DTF_TOPK_DEBUG_CHECKS (device-side plan cross-checks).
int tf_topk_debug_checks() {
#if defined(TF_TOPK_DEBUG_CHECKS)
  return 1;
#else
  return 0;
#endif
}

int tf_topk_select_f32(const void* x, long long n, long long k, int method,
                       void* values, void* indices, void* scratch,
                       void* stream) {
  return Select<float>(x, n, k, method, values, indices, scratch, stream);
}

int tf_topk_select_f16(const void* x, long long n, long long k, int method,
                       void* values, void* indices, void* scratch,
                       void* stream) {
  return Select<__half>(x, n, k, method, values, indices, scratch, stream);
}

int tf_topk_select_bf16(const void* x, long long n, long long k, int method,
                        void* values, void* indices, void* scratch,
                        void* stream) {
  return Select<__nv_bfloat16>(x, n, k, method, values, indices, scratch,
                               stream);
}

// SampleIndex: where the sample of the prefilter looks.
long long tf_topk_sample_index(long long s, long long n) {
  return tf_topk::SampleIndex(s, n);
}

// Copies the device-side state left by the last select on `scratch` into
// out[0:17] (waits for `stream`): sure_above, tie_low, bin_low, above, need,
// done, error, count (qualifying, gaussian two-pass only), sure_counter,
// tie_counter, fill_counter, prefix, hist1 total (the entries the plan was
// made from: candidates or all qualifying), prefilter_key, candidate_count,
// use_candidates, fallback.
int tf_topk_read_state(const void* scratch, long long* out, void* stream) {
  using tf_topk::cuda::Scratch;
  Scratch* host = new Scratch;
  cudaError_t err = cudaMemcpyAsync(host, scratch, sizeof(Scratch),
                                    cudaMemcpyDeviceToHost,
                                    static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) {
    const tf_topk::cuda::State& st = host->state;
    long long qualifying = 0;
    for (int b = 0; b < tf_topk::kNumBins; ++b) qualifying += host->hist1[b];
    const long long fields[] = {
        st.sure_above, st.tie_low, st.bin_low, st.above, st.need,
        st.exact.done, st.error, static_cast<long long>(st.count),
        static_cast<long long>(st.sure_counter),
        static_cast<long long>(st.tie_counter),
        static_cast<long long>(st.fill_counter), st.exact.prefix, qualifying,
        st.prefilter_key, static_cast<long long>(st.candidate_count),
        st.use_candidates, st.fallback};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); ++i) out[i] = fields[i];
  }
  delete host;
  return static_cast<int>(err);
}

const char* tf_topk_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // extern "C"
