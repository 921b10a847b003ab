// The chunk route's grid, shared by the selection (chunk_topk_op.cc) and the
// wire format (chunk_wire_op.cc): the exponent of a chunk's grid from its
// selected values. tf_topk/routes/chunked.py's `chunk_exponents` is the same
// rule in the graph (the GPU path); the route rebuilds the codes from the
// rounded values with it, so both must agree bit for bit.
#ifndef TF_TOPK_CC_KERNELS_CHUNK_GRID_H_
#define TF_TOPK_CC_KERNELS_CHUNK_GRID_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tf_topk {

constexpr int kChunkMinExponent = -149;  // float32's smallest subnormal is 2**-149
constexpr int kChunkMaxExponent = 127;   // float32's largest power of two
constexpr int kChunkOffsetBits = 4;
constexpr int kChunkMaxOffset = (1 << kChunkOffsetBits) - 1;  // a chunk's grid at most 2**15 below its member's

// Levels L of a value of `value_bits` bits: codes in [-L, L].
inline int ChunkLevels(int value_bits) { return (1 << (value_bits - 1)) - 1; }

// The exponent e of a chunk's grid 2**e from its selected values (the slots
// [0, count)): with levels = 1 the power of two nearest the mean magnitude of
// the non-zero ones, else the smallest e with max <= levels * 2**e;
// kChunkMinExponent for none, at most kChunkMaxExponent.
template <typename R>
int ChunkExponent(const R* values, int64_t count, int levels) {
  double sum = 0.0, largest = 0.0;
  int64_t nonzero = 0;
  for (int64_t j = 0; j < count; ++j) {
    const double magnitude = std::abs(static_cast<double>(values[j]));
    if (magnitude > 0.0 && std::isfinite(magnitude)) {
      sum += magnitude;
      largest = std::max(largest, magnitude);
      ++nonzero;
    }
  }
  if (nonzero == 0) return kChunkMinExponent;
  double exponent;
  if (levels == 1) {
    exponent = std::nearbyint(std::log(sum / static_cast<double>(nonzero)) / std::log(2.0));
  } else {
    exponent = std::ceil(std::log(largest / levels) / std::log(2.0));
    if (largest > levels * std::ldexp(1.0, static_cast<int>(exponent))) exponent += 1;
    if (largest <= levels * std::ldexp(1.0, static_cast<int>(exponent) - 1)) exponent -= 1;
  }
  return std::min(std::max(static_cast<int>(exponent), kChunkMinExponent), kChunkMaxExponent);
}

// A chunk's offset below its member's exponent: o = min(15, e_m - e), at least 0.
inline int ChunkOffset(int member, int exponent) {
  return std::min(kChunkMaxOffset, std::max(0, member - exponent));
}

}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_CHUNK_GRID_H_
