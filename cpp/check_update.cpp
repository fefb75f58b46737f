#include "launch.h"

namespace shardadam {
namespace {

bool is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16; }

}  // namespace

void check_update_table(const TensorTable& t, uint32_t scaled, const std::string& rule,
                        uint32_t required, uint32_t unused) {
  const bool scaled_master = scaled & (1u << kScaledMaster);
  SHARDADAM_CHECK(t.num_lists() == kUpdateLists,
                  rule + ": a table needs the 9 update lists (UpdateList in cpp/update_rule.h)");
  SHARDADAM_CHECK(t.list(kExpAvgBlocks).blocks_of == kExpAvg && t.list(kExpAvgSqBlocks).blocks_of == kExpAvgSq,
                  rule + ": the block maxima lists must be marked as those of exp_avg and exp_avg_sq");
  for (int l = 0; l < kUpdateLists; ++l)
    SHARDADAM_CHECK(!(unused & list_bit(l)) || !t.has_list(l),
                    rule + ": " + t.list(l).name + " must not be given: " + rule + " keeps no such state");
  if (t.num_tensors() == 0) return;  // nothing to update: every list is empty
  for (int l = 0; l < kUpdateLists; ++l)
    SHARDADAM_CHECK(!(required & list_bit(l)) || t.has_list(l), rule + ": " + t.list(l).name + " must be given");
  const bool rem = t.has_list(kRemainder);
  SHARDADAM_CHECK(!(rem && scaled_master),
                  rule + ": param_remainders and master_scales exclude each other: the remainder "
                         "already makes the bf16 param an exact fp32 master");
  // FP8 states exist only scaled, every tensor of the list alike (the
  // scale's top exponent follows the list's dtype: launch.h).
  for (int i = kScaledExpAvg; i < kScaledStates; ++i) {
    const int l = kScaledList[i];
    if (!t.has_list(l)) continue;
    bool any = false;
    for (uint8_t d : t.list(l).dtypes) any |= DType(d) == DType::F8E4M3;
    SHARDADAM_CHECK(!any || ((scaled & (1u << i)) && t.list_dtype_is(l, DType::F8E4M3)),
                    rule + ": float8_e4m3fn " + t.list(l).name + " need per-tensor scales, and every tensor of "
                    "the list in float8_e4m3fn");
  }
  // Blockwise 8-bit states: exp_avg in the signed map, exp_avg_sq in the
  // unsigned one (its values are never negative), never with scales.
  for (int i = kScaledExpAvg; i < kScaledStates; ++i) {
    const int l = kScaledList[i];
    if (!t.has_list(l)) continue;
    const DType want = l == kExpAvg ? DType::Q8S : DType::Q8U;
    for (int64_t k = 0; k < t.num_tensors(); ++k) {
      const DType d = DType(t.list(l).dtypes[k]);
      if (!is_blockwise(d)) continue;
      const std::string at = t.list(l).name + "[" + std::to_string(k) + "]";
      SHARDADAM_CHECK(d == want, at + " is " + dtype_name(d) + "; " + t.list(l).name + " takes " + dtype_name(want));
      SHARDADAM_CHECK(!(scaled & (1u << i)), at + " is blockwise 8-bit, which has block maxima, not per-tensor scales");
    }
  }
  for (int l = 0; l < kUpdateLists; ++l) {
    if (!t.has_list(l) || l == kExpAvgBlocks || l == kExpAvgSqBlocks) continue;  // blocks: the table checked them
    const ListSpec& spec = t.list(l);
    for (int64_t i = 0; i < t.num_tensors(); ++i) {
      const DType d = DType(spec.dtypes[i]);
      const std::string at = spec.name + "[" + std::to_string(i) + "]";
      if (l == kRemainder) {
        SHARDADAM_CHECK(d == DType::I16, at + " must be int16 (the low half of an fp32 master)");
        SHARDADAM_CHECK(DType(t.list(kParam).dtypes[i]) == DType::BF16,
                        t.list(kParam).name + "[" + std::to_string(i) +
                            "] must be bfloat16 when param_remainders are given");
      } else if (is_blockwise(d)) {
        SHARDADAM_CHECK(l == kExpAvg || l == kExpAvgSq,
                        at + " is blockwise 8-bit: it stores exp_avg and exp_avg_sq only");
      } else if (d == DType::F8E4M3) {
        SHARDADAM_CHECK(l == kExpAvg || l == kExpAvgSq,
                        at + " is float8_e4m3fn: FP8 stores exp_avg and exp_avg_sq only (with their scales)");
      } else {
        SHARDADAM_CHECK(is_float(d), at + " has dtype " + dtype_name(d) +
                                         "; supported: float32, float16, bfloat16");
      }
    }
  }
}

}  // namespace shardadam
