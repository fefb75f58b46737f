// The CPU engine's Muon passes ([Note: CPU instruction sets] in cpu_chunks.h).
#include "cpu_chunks.h"
#include "muon_math.h"

namespace shardadam {

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e,
                                     const UpdateOp<MuonMomentumRule>& op) {
  cpu_run_chunks(tv, b, e, op);
}

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e, const UpdateOp<MuonUpdateRule>& op) {
  cpu_run_chunks(tv, b, e, op);
}

}  // namespace shardadam
