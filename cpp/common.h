// Shared macros for host and device code. No CUDA or nanobind headers here, so
// every host translation unit can include it.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

// Functions marked SHARDADAM_HD compile for both the CPU engine and the CUDA
// engine: this is how the element-wise math is written exactly once.
#if defined(__CUDACC__)
#define SHARDADAM_HD __host__ __device__ __forceinline__
#else
#define SHARDADAM_HD inline
#endif

namespace shardadam {

// Validation failures raise std::invalid_argument, which nanobind turns into a
// Python ValueError carrying the message.
#define SHARDADAM_CHECK(cond, msg)                                   \
  do {                                                               \
    if (!(cond)) throw std::invalid_argument(std::string(msg));      \
  } while (0)

}  // namespace shardadam
