// CUDA entry points as plain C++ declarations, so host files never include
// CUDA headers. `blob` is the device copy of the table's blob; `stream` is a
// cudaStream_t passed as an integer (the caller's current torch stream).
// Built from cuda/*.cu, or from cpp/cuda_stub.cpp when CUDA is not built.
#pragma once

#include <string>

#include "launch.h"

namespace shardadam {

struct CudaTarget {
  int device;
  uint64_t stream;
  uint64_t blob;
};

void cuda_adam(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
               const AdamExtras& x);
void cuda_lion(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
               const AdamExtras& x);
void cuda_muon_momentum(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
                        const AdamExtras& x);
void cuda_muon_update(const TensorTable& t, const CudaTarget& where, const std::vector<AdamGroup>& groups,
                      const AdamExtras& x);
void cuda_scale(const TensorTable& t, const CudaTarget& where, ScalarSrc scale, uint64_t found_inf,
                uint64_t skip_if);
void cuda_split_remainders(const TensorTable& t, const CudaTarget& where);
void cuda_join_remainders(const TensorTable& t, const CudaTarget& where);
void cuda_l2_norm(const TensorTable& t, const CudaTarget& where, uint64_t partials,
                  uint64_t per_tensor, uint64_t total, uint64_t nonfinite);

// CUDA IPC (cuda/peer_memory.cu): an exported allocation is the handle's 64
// bytes plus the tensor's offset in it.
struct PeerExport {
  std::string handle;
  uint64_t offset;
};
PeerExport cuda_ipc_export(int device, uint64_t ptr);
uint64_t cuda_ipc_open(int device, const std::string& handle);  // the allocation's base in this process
void cuda_ipc_close(int device, uint64_t base);
void cuda_copy_async(int device, uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream);
// Stream memory operations on 64-bit counters (mapped peer memory included):
// a write after the stream's earlier work, and a wait until *addr >= value.
void cuda_stream_write_value(int device, uint64_t addr, uint64_t value, uint64_t stream);
void cuda_stream_wait_value(int device, uint64_t addr, uint64_t value, uint64_t stream);

bool cuda_built();
std::string cuda_architectures();
int cuda_runtime_version();  // e.g. 13000; 0 when not built
int cuda_device_count();     // 0 without a driver or GPU

}  // namespace shardadam
