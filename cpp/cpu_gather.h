// Table reads and the block encode for the CPU engine's 8-bit states, with
// the gather instructions of the CPU it runs on ([Note: CPU gathers]).
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
// With AVX-512 a block's whole encode is one function too (encode_block):
// the maximum, then one pass of 16 lanes at a time from the values to the
// code bytes (1.25x the 8-bit step on the Intel host). Elsewhere the engine
// keeps its portable form, six loops over the block through arrays on the
// stack, inside its target_clones code so that each clone vectorises them;
// so encode_block has no plain or AVX2 version (null there).

// out[k] = table[codes[k]] * scale for k < n.
using DecodeCodes = void (*)(const float* table, const uint8_t* codes, float scale, float* out, int n);
// out[k] = table[index[k]] for k < n; every index below 2^31.
using Gather32 = void (*)(const uint32_t* table, const uint32_t* index, uint32_t* out, int n);

// The codes of one block of n <= kQuantBlock values into out, as the
// engine's loops store them (cpu_engine.h, [Note: settling cells] in
// dtype.h): `entries` is q8_cell_entries of the block's map; returns the
// block maximum to store.
using EncodeBlock = float (*)(const float* in, int n, const uint32_t* entries, bool is_signed, uint8_t* out);

extern const DecodeCodes decode_codes;
extern const Gather32 gather32;
// Null without AVX-512 (or where the cap rules it out): the engine's loops encode.
extern const EncodeBlock encode_block;

// Which gathers these are: "plain", "avx2" or "avx512".
const char* cpu_gathers();

}  // namespace shardadam
