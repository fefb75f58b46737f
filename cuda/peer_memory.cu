// CUDA IPC for the copy-engine collectives: a rank exports the device
// allocation behind a tensor, its peers on the same host map it, and each
// rank then writes straight into the peers' buffers with cudaMemcpyAsync,
// which the copy engines carry over NVLink without using SMs. Counters in
// mapped memory, raised and awaited with stream memory operations, order
// those writes on the GPU without kernels. Host code only: compiled by nvcc
// for the static runtime.
#include <cuda.h>  // the driver API's types, for entry points found at run time

#include <cstring>
#include <string>

#include "cuda_api.h"
#include "cuda_check.cuh"

namespace shardadam {
namespace {

using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// Driver functions are looked up through the runtime, so the module never
// links libcuda and still imports where there is no driver.
template <class Fn>
Fn driver_function(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cuda_check(cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found),
             "cudaGetDriverEntryPointByVersion");
  if (found != cudaDriverEntryPointSuccess) throw std::runtime_error(std::string("the CUDA driver has no ") + name);
  return reinterpret_cast<Fn>(f);
}

void driver_check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) throw std::runtime_error(std::string(what) + " failed (CUresult " +
                                                       std::to_string(int(result)) + ")");
}

// cudaIpcGetMemHandle names a whole allocation, and torch's caching allocator
// hands out pieces of larger ones: the driver's cuMemGetAddressRange finds
// the allocation's base.
uint64_t allocation_base(uint64_t ptr) {
  static const AddressRangeFn fn = driver_function<AddressRangeFn>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  driver_check(fn(&base, &size, CUdeviceptr(ptr)), "cuMemGetAddressRange (is the address in a device allocation?)");
  return uint64_t(base);
}

}  // namespace

PeerExport cuda_ipc_export(int device, uint64_t ptr) {
  DeviceGuard guard(device);
  const uint64_t base = allocation_base(ptr);
  cudaIpcMemHandle_t handle;
  cuda_check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)),
             "cudaIpcGetMemHandle (memory from cudaMallocAsync or expandable segments cannot be shared)");
  return PeerExport{std::string(handle.reserved, sizeof(handle.reserved)), ptr - base};
}

uint64_t cuda_ipc_open(int device, const std::string& handle_bytes) {
  cudaIpcMemHandle_t handle;
  if (handle_bytes.size() != sizeof(handle.reserved))
    throw std::invalid_argument("cuda_ipc_open: handle must be the bytes cuda_ipc_export returned");
  std::memcpy(handle.reserved, handle_bytes.data(), sizeof(handle.reserved));
  DeviceGuard guard(device);
  void* base = nullptr;
  // Mapped into this device's context: no context on the peer's device, and
  // peer access from this device is enabled with it.
  cuda_check(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<uint64_t>(base);
}

void cuda_ipc_close(int device, uint64_t base) {
  DeviceGuard guard(device);
  cuda_check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(base)), "cudaIpcCloseMemHandle");
}

void cuda_copy_async(int device, uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream) {
  if (nbytes == 0) return;
  DeviceGuard guard(device);
  cuda_check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                             cudaMemcpyDeviceToDevice, reinterpret_cast<cudaStream_t>(stream)),
             "cudaMemcpyAsync (peer copy)");
}

void cuda_stream_write_value(int device, uint64_t addr, uint64_t value, uint64_t stream) {
  static const StreamValueFn fn = driver_function<StreamValueFn>("cuStreamWriteValue64");
  DeviceGuard guard(device);
  // The default flags fence first: what the stream wrote before (peer copies
  // included) is visible to whoever sees the new value.
  driver_check(fn(reinterpret_cast<CUstream>(stream), CUdeviceptr(addr), value, CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64");
}

void cuda_stream_wait_value(int device, uint64_t addr, uint64_t value, uint64_t stream) {
  static const StreamValueFn fn = driver_function<StreamValueFn>("cuStreamWaitValue64");
  DeviceGuard guard(device);
  // GEQ compares as (int64)(*addr - value) >= 0: counters only grow, and a
  // waiter that comes late still passes.
  driver_check(fn(reinterpret_cast<CUstream>(stream), CUdeviceptr(addr), value, CU_STREAM_WAIT_VALUE_GEQ),
               "cuStreamWaitValue64");
}

}  // namespace shardadam
