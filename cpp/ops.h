// The element-wise operations, written once against two small interfaces that
// each engine (cpp/cpu_engine.h, cuda/multi_tensor_apply.cuh) implements:
//
//   IO (one tile of up to K elements of one tensor):
//     dtype(l), count(), lanes(), index(), load(l, float[K]), store(l, const float[K]),
//     load_bits(l, uint16[K]), store_bits(l, const uint16[K])
//     index() is lane 0's element index in its tensor.
//     count() elements are real. Ops compute lanes() of them: the CPU engine
//     gives count() (no work on padding) but in blockwise tables, the GPU
//     engine K (a constant trip count keeps tiles in registers); padding
//     lanes load as zeros and are never stored. Absent lists load zeros and store nothing.
//   Reducer (once per chunk, all threads of a chunk call it together):
//     max_to(float*, v), sum_to(float*, v), flag_if(float*, bool)
//
//     For blockwise 8-bit lists ([Note: blockwise 8-bit states] in dtype.h)
//     load and store decode and encode through the list's block maxima; a
//     store reduces each block's maximum first, so every lane of a block
//     stores each such list together.
// An op has kLists, kBlockwise (whether it takes blockwise lists), a GroupState computed once per parameter group (the CPU
// engine reuses it across a group's chunks), a per-chunk State<K>, and
// group_state / begin / tile / finish. Blockwise ops also name kReadLists
// (list_bit mask), the lists their tiles load element by element: the GPU
// engine's blockwise kernels fetch those ahead ([Note: next-tile prefetch]
// in cuda/multi_tensor_apply.cuh).
#pragma once

#include <cmath>

#include "adam_math.h"
#include "tensor_table.h"

namespace shardadam {

// Sum of n lanes as a balanced tree; recursion on a constant keeps GPU
// register arrays in registers (no dynamic indexing).
template <int N>
SHARDADAM_HD float pairwise_sum(const float* x) {
  if constexpr (N == 1) {
    return x[0];
  } else {
    return pairwise_sum<N / 2>(x) + pairwise_sum<N - N / 2>(x + N / 2);
  }
}

struct ChunkCtx {
  uint32_t tensor;
  uint32_t group;
  int64_t chunk;
};

// ---------------------------------------------------------------- update rules

// Scaled low-precision states: index into UpdateArgs::scales / amax.
enum ScaledState : int { kScaledMaster = 0, kScaledExpAvg = 1, kScaledExpAvgSq = 2, kScaledStates = 3 };
constexpr int kScaledList[kScaledStates] = {kParam, kExpAvg, kExpAvgSq};

// Scaled low-precision states keep value * scale with scale a power of two,
// so scaling and unscaling are exact. The scale maps the tensor's absolute
// maximum just under 2^top: for fp16 2^15, far from its overflow (65504),
// with values 2^39 below the maximum still on its subnormal grid; for FP8
// E4M3 2^8 (its largest value is 448), down to 2^-17 of the maximum.
constexpr int kF16ScaleTop = 15;
constexpr int kF8ScaleTop = 8;
SHARDADAM_HD float pow2_scale_for(float amax, float old_scale, int top = kF16ScaleTop) {
  if (!(amax > 0.0f) || !is_finite(amax)) return old_scale;
  int e;
  frexpf(amax, &e);  // amax < 2^e
  int k = top - e;
  k = k > 126 ? 126 : (k < -126 ? -126 : k);
  return ldexpf(1.0f, k);
}

// Groups travel inside the kernel arguments; more groups than this take
// several launches (one per slice of groups).
constexpr int kMaxGroupsPerLaunch = 32;

enum class UpdatePhase : int {
  Apply = 0,    // plain update
  Measure = 1,  // scaled states, pass 1: compute the update, record per-tensor amax, write nothing
  ApplyScaled = 2,  // scaled states, pass 2: recompute, store under scales derived from amax
};

struct UpdateArgs {
  AdamGroup groups[kMaxGroupsPerLaunch];
  uint32_t group_base = 0;  // group index of groups[0]
  ScalarSrc grad_scale;     // multiplies every gradient
  float* scales[kScaledStates] = {nullptr, nullptr, nullptr};  // [num_tensors] each, or null
  float* amax[kScaledStates] = {nullptr, nullptr, nullptr};    // scratch [num_tensors] each
  int scale_top[kScaledStates] = {kF16ScaleTop, kF16ScaleTop, kF16ScaleTop};  // by the state's storage dtype
  UpdatePhase phase = UpdatePhase::Apply;
  // Store grad * grad_scale back into the grad list (a GradScaler's
  // gradients come out unscaled, as torch's fused Adam leaves them); like
  // every other write it is skipped when found_inf is set.
  bool unscale_grads = false;
  // bf16 parameters that are their own master round stochastically
  // ([Note: stochastic rounding] in dtype.h), keyed by this seed.
  bool stochastic_rounding = false;
  uint64_t rounding_seed = 0;
  // Scaled states: the Measure pass stores the parameters, and ApplyScaled
  // then updates the states only ([Note: params in the measure pass]).
  bool params_in_measure = false;
};

// [Note: params in the measure pass] Scaled states take two passes: Measure
// computes the step to find each tensor's new maxima, ApplyScaled computes it
// again and stores under the scales those maxima give. A parameter whose
// master has no scale does not wait for them, and where no group's states
// read the parameter (Adam's L2 mode does, through the gradient) ApplyScaled
// needs neither the parameter nor the update's division: Measure stores the
// parameters and ApplyScaled recomputes only the states from the same
// gradients and old states (the rule's states(), element()'s own arithmetic,
// so the maxima measured are those of the values stored). FP8 states then
// move 22 bytes per fp32 element instead of 26.

// One optimizer step over the lists of UpdateList for any rule (see
// update_rule.h): the rule computes one element, the op does the rest.
template <class Rule>
struct UpdateOp {
  static constexpr int kLists = kUpdateLists;
  static constexpr bool kBlockwise = true;  // takes blockwise 8-bit states (the IO decodes and encodes them)
  static constexpr uint32_t kReadLists = list_bit(kParam) | list_bit(kGrad) | list_bit(kExpAvg) |
                                         list_bit(kExpAvgSq) | list_bit(kMaxExpAvgSq) | list_bit(kRemainder);
  using Coeffs = typename Rule::Coeffs;
  UpdateArgs a;

  template <int K>
  struct State {
    Coeffs c;
    float unscale[kScaledStates];  // stored -> true value
    float rescale[kScaledStates];  // true value -> stored
    float amax[kScaledStates];
    float grad_scale;  // for unscale_grads
    uint64_t rounding_key;  // stochastic rounding: this tensor's at this step
  };

  using GroupState = Coeffs;
  SHARDADAM_HD GroupState group_state(uint32_t group) const {
    return Rule::coeffs(a.groups[group - a.group_base], a.grad_scale.read());
  }

  template <int K>
  SHARDADAM_HD State<K> begin(const ChunkCtx& ctx, const GroupState& coeffs) const {
    State<K> s;
    s.c = coeffs;
    for (int i = 0; i < kScaledStates; ++i) {
      const float old_scale = a.scales[i] ? a.scales[i][ctx.tensor] : 1.0f;
      s.unscale[i] = 1.0f / old_scale;  // exact: scales are powers of two
      s.rescale[i] = (a.phase == UpdatePhase::ApplyScaled && a.scales[i])
                         ? pow2_scale_for(a.amax[i][ctx.tensor], old_scale, a.scale_top[i])
                         : 1.0f;
      s.amax[i] = 0.0f;
    }
    s.grad_scale = a.unscale_grads ? float(a.grad_scale.read()) : 1.0f;
    s.rounding_key = a.stochastic_rounding
                         ? rounding_key(a.rounding_seed, uint64_t(a.groups[ctx.group - a.group_base].step.read()),
                                        ctx.tensor)
                         : 0;
    return s;
  }

  template <int K, class IO>
  SHARDADAM_HD void tile(const IO& io, State<K>& s) const {
    float p[K], g[K], m[K], v[K], vmax[K];
    const bool has_rem = io.dtype(kRemainder) != DType::None;
    const bool has_max = io.dtype(kMaxExpAvgSq) != DType::None;
    const bool states_only = a.phase == UpdatePhase::ApplyScaled && a.params_in_measure;
    if (states_only) {
      for (int k = 0; k < io.lanes(); ++k) p[k] = 0.0f;  // not read: no group's states read it
    } else if (has_rem) {
      uint16_t hi[K], lo[K];
      io.load_bits(kParam, hi);
      io.load_bits(kRemainder, lo);
      for (int k = 0; k < io.lanes(); ++k) p[k] = join_remainder(hi[k], lo[k]);
    } else {
      io.load(kParam, p);
    }
    io.load(kGrad, g);
    io.load(kExpAvg, m);
    io.load(kExpAvgSq, v);
    io.load(kMaxExpAvgSq, vmax);
    const float m_unscale = state_factor(io, kExpAvg, s.unscale[kScaledExpAvg]);
    const float v_unscale = state_factor(io, kExpAvgSq, s.unscale[kScaledExpAvgSq]);
    if (states_only) {
      for (int k = 0; k < io.lanes(); ++k) {
        m[k] *= m_unscale;
        v[k] *= v_unscale;
        Rule::states(p[k], g[k], m[k], v[k], vmax[k], has_max, s.c);
      }
    } else {
      for (int k = 0; k < io.lanes(); ++k) {
        p[k] *= s.unscale[kScaledMaster];
        m[k] *= m_unscale;
        v[k] *= v_unscale;
        Rule::element(p[k], g[k], m[k], v[k], vmax[k], has_max, s.c);
      }
    }
    if (a.phase == UpdatePhase::Measure) {
      // A fixed trip count with a select (not k < count()) keeps the tile in
      // GPU registers; lanes past count() hold padding and must not count.
      const int n = io.count();
      for (int k = 0; k < io.lanes(); ++k) {
        s.amax[kScaledMaster] = nan_max(s.amax[kScaledMaster], k < n ? fabsf(p[k]) : 0.0f);
        s.amax[kScaledExpAvg] = nan_max(s.amax[kScaledExpAvg], k < n ? fabsf(m[k]) : 0.0f);
        s.amax[kScaledExpAvgSq] = nan_max(s.amax[kScaledExpAvgSq], k < n ? fabsf(v[k]) : 0.0f);
      }
      if (a.params_in_measure) store_params(io, s, p);
      return;
    }
    if (a.unscale_grads) {
      for (int k = 0; k < io.lanes(); ++k) g[k] *= s.grad_scale;
      io.store(kGrad, g);
    }
    if (!states_only) store_params(io, s, p);
    const float m_rescale = state_factor(io, kExpAvg, s.rescale[kScaledExpAvg]);
    const float v_rescale = state_factor(io, kExpAvgSq, s.rescale[kScaledExpAvgSq]);
    for (int k = 0; k < io.lanes(); ++k) {
      m[k] *= m_rescale;
      v[k] *= v_rescale;
    }
    io.store(kExpAvg, m);
    io.store(kExpAvgSq, v);
    if (has_max) io.store(kMaxExpAvgSq, vmax);
  }

  // A state's scale factor: 1 for blockwise states, which keep block maxima
  // instead of per-tensor scales (check_update.cpp), so that their
  // fixed-dtype kernels drop the multiplies.
  template <class IO>
  SHARDADAM_HD static float state_factor(const IO& io, int list, float factor) {
    return is_blockwise(io.dtype(list)) ? 1.0f : factor;
  }

  // The new parameter p (true values) into the param list (rescaled, or as
  // bf16 high half and remainder, or rounded stochastically) and param_out.
  template <int K, class IO>
  SHARDADAM_HD void store_params(const IO& io, const State<K>& s, float (&p)[K]) const {
    io.store(kParamOut, p);  // true values, before the master is rescaled
    if (io.dtype(kRemainder) != DType::None) {
      uint16_t hi[K], lo[K];
      for (int k = 0; k < io.lanes(); ++k) split_remainder(p[k], hi[k], lo[k]);
      io.store_bits(kParam, hi);
      io.store_bits(kRemainder, lo);
    } else if (a.stochastic_rounding && io.dtype(kParam) == DType::BF16) {
      uint16_t hi[K];
      for (int k = 0; k < io.lanes(); ++k)
        hi[k] = float_to_bf16_stochastic(p[k], rounding_bits(s.rounding_key, io.index() + k));
      io.store_bits(kParam, hi);
    } else {
      for (int k = 0; k < io.lanes(); ++k) p[k] *= s.rescale[kScaledMaster];
      io.store(kParam, p);
    }
  }

  template <int K, class R>
  SHARDADAM_HD void finish(const ChunkCtx& ctx, State<K>& s, R& red) const {
    if (a.phase != UpdatePhase::Measure) return;
    for (int i = 0; i < kScaledStates; ++i)
      if (a.scales[i]) red.max_to(&a.amax[i][ctx.tensor], s.amax[i]);
  }
};

using AdamOp = UpdateOp<AdamRule>;

// ---------------------------------------------------------------- scale / copy

// out = in * scale, in any float dtypes, blockwise 8-bit included (lists 2
// and 3 hold their block maxima). Flags non-finite input.
struct ScaleOp {
  static constexpr int kLists = 4;  // 0: in, 1: out, 2: in's block maxima, 3: out's
  static constexpr bool kBlockwise = true;
  static constexpr uint32_t kReadLists = list_bit(0);
  ScalarSrc scale;
  float* found_inf = nullptr;

  template <int K>
  struct State {
    float factor;
    bool nonfinite;
  };

  using GroupState = float;  // the scale factor
  SHARDADAM_HD GroupState group_state(uint32_t) const { return float(scale.read()); }

  template <int K>
  SHARDADAM_HD State<K> begin(const ChunkCtx&, const GroupState& factor) const {
    return State<K>{factor, false};
  }

  template <int K, class IO>
  SHARDADAM_HD void tile(const IO& io, State<K>& s) const {
    float x[K];
    io.load(0, x);
    bool bad = false;
    for (int k = 0; k < io.lanes(); ++k) {
      bad |= !is_finite(x[k]);  // padding lanes load as 0, which is finite
      x[k] *= s.factor;
    }
    s.nonfinite |= bad;
    io.store(1, x);
  }

  template <int K, class R>
  SHARDADAM_HD void finish(const ChunkCtx&, State<K>& s, R& red) const {
    if (found_inf) red.flag_if(found_inf, s.nonfinite);
  }
};

// ---------------------------------------------------------------- remainders

// The hooks of an op that keeps nothing per group or chunk.
struct StatelessOp {
  static constexpr bool kBlockwise = false;
  struct GroupState {};
  template <int K>
  struct State {};
  SHARDADAM_HD GroupState group_state(uint32_t) const { return {}; }
  template <int K>
  SHARDADAM_HD State<K> begin(const ChunkCtx&, const GroupState&) const { return {}; }
  template <int K, class R>
  SHARDADAM_HD void finish(const ChunkCtx&, State<K>&, R&) const {}
};

// fp32 masters <-> bf16 params + int16 remainders through split_remainder and
// join_remainder (dtype.h), the functions the update uses, so checkpoints
// convert exactly as the optimizer stores. Bit moves only: every pattern,
// NaN payloads included, survives join(split(x)). kDtypes and kWritten are
// the table rules launch.h checks before each run.
struct SplitRemaindersOp : StatelessOp {
  static constexpr int kLists = 3;  // 0: fp32 masters (read), 1: bf16 params, 2: int16 remainders
  static constexpr const char* kName = "split_remainders";
  static constexpr DType kDtypes[kLists] = {DType::F32, DType::BF16, DType::I16};
  static constexpr uint32_t kWritten = list_bit(1) | list_bit(2);

  template <int K, class IO>
  SHARDADAM_HD void tile(const IO& io, State<K>&) const {
    float x[K];
    uint16_t hi[K], lo[K];
    io.load(0, x);
    for (int k = 0; k < io.lanes(); ++k) split_remainder(x[k], hi[k], lo[k]);
    io.store_bits(1, hi);
    io.store_bits(2, lo);
  }
};

struct JoinRemaindersOp : StatelessOp {
  static constexpr int kLists = 3;  // 0: bf16 params, 1: int16 remainders (read), 2: fp32 masters
  static constexpr const char* kName = "join_remainders";
  static constexpr DType kDtypes[kLists] = {DType::BF16, DType::I16, DType::F32};
  static constexpr uint32_t kWritten = list_bit(2);

  template <int K, class IO>
  SHARDADAM_HD void tile(const IO& io, State<K>&) const {
    uint16_t hi[K], lo[K];
    float x[K];
    io.load_bits(0, hi);
    io.load_bits(1, lo);
    for (int k = 0; k < io.lanes(); ++k) x[k] = join_remainder(hi[k], lo[k]);
    io.store(2, x);
  }
};

// ---------------------------------------------------------------- L2 norm

// Sum of squares per chunk in fp32, written to partials[chunk]; the engine's
// finalize step adds chunks per tensor in a fixed order (deterministic).
struct SumSqOp {
  static constexpr int kLists = 1;
  static constexpr bool kBlockwise = false;
  float* partials = nullptr;  // [num_chunks]
  float* nonfinite = nullptr;

  template <int K>
  struct State {
    float acc[K];  // one lane per tile slot: vectorises on the CPU
    bool bad;
  };

  struct GroupState {};
  SHARDADAM_HD GroupState group_state(uint32_t) const { return {}; }

  template <int K>
  SHARDADAM_HD State<K> begin(const ChunkCtx&, const GroupState&) const {
    State<K> s;
    for (int k = 0; k < K; ++k) s.acc[k] = 0.0f;
    s.bad = false;
    return s;
  }

  template <int K, class IO>
  SHARDADAM_HD void tile(const IO& io, State<K>& s) const {
    float x[K];
    io.load(0, x);
    bool bad = false;
    for (int k = 0; k < io.lanes(); ++k) {
      bad |= !is_finite(x[k]);
      s.acc[k] += x[k] * x[k];
    }
    s.bad |= bad;
  }

  template <int K, class R>
  SHARDADAM_HD void finish(const ChunkCtx& ctx, State<K>& s, R& red) const {
    // Pairwise sum of the lanes, then across threads inside the reducer.
    red.sum_to(&partials[ctx.chunk], pairwise_sum<K>(s.acc));
    if (nonfinite) red.flag_if(nonfinite, s.bad);
  }
};

}  // namespace shardadam
