// The CPU engine's hot loops, one overload per op: cpu_run_chunks
// (cpu_engine.h) compiled once per instruction set, in one file per op
// (cpu_chunks_*.cpp) so that a build compiles them in parallel.
#pragma once

#include "cpu_engine.h"
#include "lion_math.h"

namespace shardadam {

// [Note: CPU instruction sets] Each overload is compiled once per instruction
// set and chosen at load time by the CPU's abilities (the widest vectors it
// has, as torch's CPU kernels do): one build runs everywhere and still uses
// AVX2/AVX-512 where present. `flatten` inlines the whole chunk loop into each
// clone, so no shared out-of-line helper carries one instruction set's code
// into another's path.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDADAM_CPU_CLONES \
  __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4"), flatten))
#else
#define SHARDADAM_CPU_CLONES
#endif

void run_chunks(const TableView& tv, int64_t b, int64_t e, const AdamOp& op);
void run_chunks(const TableView& tv, int64_t b, int64_t e, const UpdateOp<LionRule>& op);
// Muon's rules are declared only: their math (muon_math.h) is compiled where
// it is used, so a change to it rebuilds neither Adam's nor Lion's loops.
struct MuonMomentumRule;
struct MuonUpdateRule;
void run_chunks(const TableView& tv, int64_t b, int64_t e, const UpdateOp<MuonMomentumRule>& op);
void run_chunks(const TableView& tv, int64_t b, int64_t e, const UpdateOp<MuonUpdateRule>& op);
void run_chunks(const TableView& tv, int64_t b, int64_t e, const ScaleOp& op);
void run_chunks(const TableView& tv, int64_t b, int64_t e, const SplitRemaindersOp& op);
void run_chunks(const TableView& tv, int64_t b, int64_t e, const JoinRemaindersOp& op);
void run_chunks(const TableView& tv, int64_t b, int64_t e, const SumSqOp& op);

}  // namespace shardadam
