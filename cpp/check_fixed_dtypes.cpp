// Table rules of ops with one fixed dtype per list (run_remainders in launch.h).
#include "launch.h"

namespace shardadam {

void check_fixed_dtypes(const TensorTable& t, const std::string& op, const DType* dtypes, int num_lists,
                        uint32_t written) {
  std::string want;
  for (int l = 0; l < num_lists; ++l) want += std::string(l ? ", " : "") + dtype_name(dtypes[l]);
  SHARDADAM_CHECK(t.num_lists() == num_lists, op + ": a table needs " + std::to_string(num_lists) +
                                                  " lists, of " + want + " tensors");
  for (int l = 0; l < num_lists; ++l)
    SHARDADAM_CHECK(t.list(l).written == bool(written & list_bit(l)),
                    op + ": " + t.list(l).name + " must be marked " +
                        ((written & list_bit(l)) ? "written" : "read-only"));
  if (t.num_tensors() == 0) return;  // nothing to convert: every list is empty
  for (int l = 0; l < num_lists; ++l) {
    const ListSpec& spec = t.list(l);
    SHARDADAM_CHECK(t.has_list(l), op + ": " + spec.name + " must be given");
    for (int64_t i = 0; i < t.num_tensors(); ++i) {
      const DType d = DType(spec.dtypes[i]);
      SHARDADAM_CHECK(d == dtypes[l], op + ": " + spec.name + "[" + std::to_string(i) + "] has dtype " +
                                          dtype_name(d) + "; " + op + " needs " + dtype_name(dtypes[l]));
    }
  }
}

}  // namespace shardadam
