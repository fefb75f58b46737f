// Error checks and the device guard used by every CUDA entry point.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace shardadam {

inline void cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  // A failed call also leaves its error as this thread's last error, which the
  // next launch check (cudaGetLastError) would report as its own, long after
  // the caller caught this exception (a refused IPC export, say): clear it.
  // Sticky errors (a broken context) stay whatever this does.
  cudaGetLastError();
  throw std::runtime_error(std::string("shardadam CUDA error in ") + what + ": " + cudaGetErrorString(err));
}

// Launches go to the tensors' device: switch to it for the call, then back.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace shardadam
