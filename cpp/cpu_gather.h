// Table reads for the CPU engine's 8-bit states, with the gather instructions
// of the CPU it runs on ([Note: CPU gathers]).
#pragma once

#include <cstdint>

namespace shardadam {

// [Note: CPU gathers] The 8-bit states read tables with an index per element
// (decoding: the map's value of each code; encoding: each element's cell,
// [Note: settling cells] in dtype.h). GCC does not emit gather instructions
// in the engine's target_clones code (cpu_chunks.h) and reads such loops
// lane by lane. These functions read them with AVX-512 or AVX2 gathers where
// the CPU has them, chosen once when the library loads; the engine calls
// them once per block of a tile. The same bits either way: a table read, and
// for decoding one multiplication. Measured (benchmarks/RESULTS.md, "Storage
// kinds"): the 8-bit step 1.2-1.4x faster on an Intel Xeon host; on an AMD
// Zen 4 host the gathers take as long as the lane-by-lane reads.

// out[k] = table[codes[k]] * scale for k < n.
using DecodeCodes = void (*)(const float* table, const uint8_t* codes, float scale, float* out, int n);
// out[k] = table[index[k]] for k < n; every index below 2^31.
using Gather32 = void (*)(const uint32_t* table, const uint32_t* index, uint32_t* out, int n);

extern const DecodeCodes decode_codes;
extern const Gather32 gather32;

// Which gathers these are: "plain", "avx2" or "avx512".
const char* cpu_gathers();

}  // namespace shardadam
