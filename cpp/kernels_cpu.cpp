// CPU entry points: the shared sequencing (launch.h) over the CPU engine.
#include "kernels_cpu.h"

#include <cmath>
#include <cstring>

#include "cpu_chunks.h"
#include "muon_math.h"

namespace shardadam {
namespace {

struct CpuEngine {
  TableView tv;
  int threads;

  template <class Op>
  void apply(int64_t chunk_begin, int64_t chunk_end, const Op& op, const float* skip_if) const {
    cpu_apply(tv, chunk_begin, chunk_end, op, skip_if, threads,
              [](const TableView& v, int64_t b, int64_t e, const Op& o) { run_chunks(v, b, e, o); });
  }
  void zero(float* p, int64_t n) const { std::memset(p, 0, size_t(n) * sizeof(float)); }
  void commit_scales(const UpdateArgs& a, int64_t num_tensors, const float* skip_if) const {
    if (flag_is_set(skip_if)) return;
    for (int i = 0; i < kScaledStates; ++i)
      if (a.scales[i])
        for (int64_t t = 0; t < num_tensors; ++t)
          a.scales[i][t] = pow2_scale_for(a.amax[i][t], a.scales[i][t], a.scale_top[i]);
  }
  void finalize_norm(const float* partials, float* per_tensor, float* total) const {
    float sum = 0.0f;
    for (int64_t t = 0; t < tv.num_tensors; ++t) {
      float s = 0.0f;
      for (int64_t c = tv.tensor_chunks[t]; c < tv.tensor_chunks[t + 1]; ++c) s += partials[c];
      if (per_tensor) per_tensor[t] = std::sqrt(s);
      sum += s;
    }
    *total = std::sqrt(sum);
  }
};

}  // namespace

const char* cpu_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
  return "x86-64";
#else
  return "generic";
#endif
}

void cpu_adam(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
              int threads) {
  run_update<AdamRule>(CpuEngine{t.host_view(), threads}, t, groups, x);
}

void cpu_lion(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
              int threads) {
  run_update<LionRule>(CpuEngine{t.host_view(), threads}, t, groups, x);
}

void cpu_muon_momentum(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
                       int threads) {
  run_update<MuonMomentumRule>(CpuEngine{t.host_view(), threads}, t, groups, x);
}

void cpu_muon_update(const TensorTable& t, const std::vector<AdamGroup>& groups, const AdamExtras& x,
                     int threads) {
  run_update<MuonUpdateRule>(CpuEngine{t.host_view(), threads}, t, groups, x);
}

void cpu_scale(const TensorTable& t, ScalarSrc scale, uint64_t found_inf, uint64_t skip_if,
               int threads) {
  run_scale(CpuEngine{t.host_view(), threads}, t, scale, found_inf, skip_if);
}

void cpu_split_remainders(const TensorTable& t, int threads) {
  run_remainders<SplitRemaindersOp>(CpuEngine{t.host_view(), threads}, t);
}

void cpu_join_remainders(const TensorTable& t, int threads) {
  run_remainders<JoinRemaindersOp>(CpuEngine{t.host_view(), threads}, t);
}

void cpu_l2_norm(const TensorTable& t, uint64_t partials, uint64_t per_tensor, uint64_t total,
                 uint64_t nonfinite, int threads) {
  run_l2_norm(CpuEngine{t.host_view(), threads}, t, partials, per_tensor, total, nonfinite);
}

}  // namespace shardadam
