// Stand-ins for the CUDA entry points in a build without CUDA: the module
// exposes the same functions either way, and GPU calls say why they fail.
#include <stdexcept>

#include "cuda_api.h"

namespace shardadam {
namespace {

[[noreturn]] void no_cuda() {
  throw std::runtime_error(
      "shardadam was built without CUDA kernels; rebuild with SHARDADAM_CUDA=ON on a machine "
      "with nvcc (see README, 'Install')");
}

}  // namespace

void cuda_adam(const TensorTable&, const CudaTarget&, const std::vector<AdamGroup>&, const AdamExtras&) {
  no_cuda();
}
void cuda_lion(const TensorTable&, const CudaTarget&, const std::vector<AdamGroup>&, const AdamExtras&) {
  no_cuda();
}
void cuda_muon_momentum(const TensorTable&, const CudaTarget&, const std::vector<AdamGroup>&, const AdamExtras&) {
  no_cuda();
}
void cuda_muon_update(const TensorTable&, const CudaTarget&, const std::vector<AdamGroup>&, const AdamExtras&) {
  no_cuda();
}
void cuda_scale(const TensorTable&, const CudaTarget&, ScalarSrc, uint64_t, uint64_t) { no_cuda(); }
void cuda_split_remainders(const TensorTable&, const CudaTarget&) { no_cuda(); }
void cuda_join_remainders(const TensorTable&, const CudaTarget&) { no_cuda(); }
void cuda_l2_norm(const TensorTable&, const CudaTarget&, uint64_t, uint64_t, uint64_t, uint64_t) {
  no_cuda();
}
PeerExport cuda_ipc_export(int, uint64_t) { no_cuda(); }
uint64_t cuda_ipc_open(int, const std::string&) { no_cuda(); }
void cuda_ipc_close(int, uint64_t) { no_cuda(); }
void cuda_copy_async(int, uint64_t, uint64_t, uint64_t, uint64_t) { no_cuda(); }
void cuda_stream_write_value(int, uint64_t, uint64_t, uint64_t) { no_cuda(); }
void cuda_stream_wait_value(int, uint64_t, uint64_t, uint64_t) { no_cuda(); }
bool cuda_built() { return false; }
std::string cuda_architectures() { return ""; }
int cuda_runtime_version() { return 0; }
int cuda_device_count() { return 0; }

}  // namespace shardadam
