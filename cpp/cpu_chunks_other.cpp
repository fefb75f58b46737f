// The CPU engine's scale/copy, remainder and norm ops ([Note: CPU instruction sets] in cpu_chunks.h).
#include "cpu_chunks.h"

namespace shardadam {

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e, const ScaleOp& op) {
  cpu_run_chunks(tv, b, e, op);
}

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e, const SplitRemaindersOp& op) {
  cpu_run_chunks(tv, b, e, op);
}

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e, const JoinRemaindersOp& op) {
  cpu_run_chunks(tv, b, e, op);
}

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e, const SumSqOp& op) {
  cpu_run_chunks(tv, b, e, op);
}

}  // namespace shardadam
