// The CPU engine's Adam update ([Note: CPU instruction sets] in cpu_chunks.h).
#include "cpu_chunks.h"

namespace shardadam {

SHARDADAM_CPU_CLONES void run_chunks(const TableView& tv, int64_t b, int64_t e, const AdamOp& op) {
  cpu_run_chunks(tv, b, e, op);
}

}  // namespace shardadam
