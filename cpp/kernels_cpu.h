// CPU entry points. `threads` bounds the threads a call may use.
#pragma once

#include "launch.h"

namespace shardadam {

void cpu_adam(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
              int threads);
void cpu_lion(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
              int threads);
void cpu_muon_momentum(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
                       int threads);
void cpu_muon_update(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
                     int threads);
void cpu_scale(const TensorTable& t, ScalarSrc scale, uint64_t found_inf, uint64_t skip_if,
               int threads);
void cpu_split_remainders(const TensorTable& t, int threads);
void cpu_join_remainders(const TensorTable& t, int threads);
void cpu_l2_norm(const TensorTable& t, uint64_t partials, uint64_t per_tensor, uint64_t total,
                 uint64_t nonfinite, int threads);

// The instruction set the CPU kernels run with on this machine.
const char* cpu_isa();

}  // namespace shardadam
