// Storage dtypes and conversions to and from float, usable on host and device.
// The math always runs in float; storage types only meet it through these.
#pragma once

#include <cmath>
#include <cstring>

#include "common.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace shardadam {

// Codes shared with Python (shardadam/_torch.py maps torch dtypes onto them).
enum class DType : uint8_t {
  None = 0,  // list absent for this tensor
  F32 = 1,
  F16 = 2,
  BF16 = 3,
  I16 = 4,  // raw 16-bit payload: the low half of an fp32 master (remainders)
  F64 = 5,  // scalar sources only
  I32 = 6,  // scalar sources only
  I64 = 7,  // scalar sources only
  F8E4M3 = 8,  // FP8 E4M3 (OCP "fn": no infinities) in one byte; scaled optimizer states
  Q8S = 9,     // 8-bit code of the signed dynamic map, scaled per block ([Note: blockwise 8-bit states])
  Q8U = 10,    // 8-bit code of the unsigned dynamic map, scaled per block
};

// The dtypes a tensor of a table may have (the others are scalar sources).
inline bool is_storage_dtype(uint8_t code) {
  return (code >= uint8_t(DType::F32) && code <= uint8_t(DType::I16)) ||
         (code >= uint8_t(DType::F8E4M3) && code <= uint8_t(DType::Q8U));
}

SHARDADAM_HD constexpr bool is_blockwise(DType d) { return d == DType::Q8S || d == DType::Q8U; }

SHARDADAM_HD constexpr int64_t dtype_size(DType d) {
  switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::F64: case DType::I64: return 8;
    case DType::F8E4M3: case DType::Q8S: case DType::Q8U: return 1;
    default: return 0;
  }
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::None: return "none";
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::I16: return "int16";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::F8E4M3: return "float8_e4m3fn";
    case DType::Q8S: return "blockwise8 (signed)";
    case DType::Q8U: return "blockwise8 (unsigned)";
  }
  return "unknown";
}

SHARDADAM_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

SHARDADAM_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

SHARDADAM_HD float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

// Round to nearest even; NaN stays a quiet NaN of the same sign.
SHARDADAM_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&b);
#else
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
#endif
}

SHARDADAM_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em < 0x0400u) {  // zero or subnormal: exact in float
    const float mag = float(em) * 5.9604644775390625e-08f;  // 2^-24
    return bits_float(sign | float_bits(mag));
  }
  return bits_float(sign | ((em << 13) + (112u << 23)));  // rebias 15 -> 127
#endif
}

// Round to nearest even, overflow to infinity, subnormals kept.
SHARDADAM_HD uint16_t float_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (u < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 makes the FPU round the
    // value to a multiple of 2^-24 (ties to even), which is the fp16 grid there.
    const float shifted = bits_float(u) + 0.5f;
    return sign | uint16_t(float_bits(shifted) - 0x3f000000u);
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias 127 -> 15 and round to nearest even
  return sign | uint16_t(u >> 13);
#endif
}

// [Note: stochastic rounding] A bf16 parameter that is its own master
// (no fp32 copy) loses every update smaller than half its ulp when rounded to
// nearest. Rounded stochastically it moves up with probability equal to the
// distance covered, so the expected value is the fp32 result: adding 16
// uniform random bits below the bf16 cut and truncating does exactly that.
// The bits come from a counter-based hash of (seed, step, tensor, element),
// the same on the CPU and the GPU, so a seeded run repeats bit for bit and
// needs no generator state.
SHARDADAM_HD uint16_t float_to_bf16_stochastic(float f, uint32_t random) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return float_to_bf16(f);  // NaN: as rounded to nearest
  if ((u & 0x7fffffffu) == 0x7f800000u) return uint16_t(u >> 16);  // infinity stays
  return uint16_t((u + (random & 0xffffu)) >> 16);
}

// MurmurHash3's 32-bit finaliser: 32-bit multiplies, which vectorise on
// every x86 CPU and cost one instruction each on a GPU.
SHARDADAM_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

// The key of one (seed, step, tensor), mixed once per chunk.
SHARDADAM_HD uint64_t rounding_key(uint64_t seed, uint64_t step, uint32_t tensor) {
  const uint32_t a = mix32(uint32_t(seed) ^ mix32(uint32_t(seed >> 32) ^ mix32(uint32_t(step) ^
                                                                              mix32(uint32_t(step >> 32) + tensor))));
  return (uint64_t(mix32(a + 0x9e3779b9u)) << 32) | a;
}

// Element i's bits: one 32-bit mix per element (the element index taken
// modulo 2^32: a tensor of more elements reuses the pattern 2^32 apart).
SHARDADAM_HD uint32_t rounding_bits(uint64_t key, int64_t index) {
  return mix32(uint32_t(key >> 32) ^ (uint32_t(index) * 0x9e3779b9u + uint32_t(key)));
}

// FP8 E4M3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; 0x7f and
// 0xff are NaN, no infinities; largest finite 448, subnormals down to 2^-9).
// Written out in integer and float steps so that the CPU and the GPU agree
// bit for bit, and with torch's float8_e4m3fn on every finite input up to
// 448: round to nearest even.
//
// NaN both ways, its sign kept: the float of a NaN code, the code of a NaN
// (or out of range) float.
SHARDADAM_HD float f8e4m3_nan_float(uint8_t b) { return bits_float((uint32_t(b & 0x80u) << 24) | 0x7fc00000u); }
SHARDADAM_HD uint8_t f8e4m3_nan_code(float f) { return uint8_t(((float_bits(f) >> 24) & 0x80u) | 0x7fu); }

SHARDADAM_HD float f8e4m3_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t em = b & 0x7fu;
  if (em == 0x7fu) return f8e4m3_nan_float(b);
  if (em < 0x08u) return bits_float(sign | float_bits(float(em) * 0.001953125f));  // subnormal: m * 2^-9
  return bits_float(sign | ((em << 20) + (120u << 23)));  // rebias 7 -> 127
}

// Round to nearest even. NaN, infinities and magnitudes past 448 (which the
// per-tensor scales keep far away) become NaN: a non-finite state stays
// visible instead of saturating into a finite one.
SHARDADAM_HD uint8_t float_to_f8e4m3(float f) {
  uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u >= 0x43e80000u) return f8e4m3_nan_code(f);  // >= 464 (halfway to 480) or not finite
  if (u < 0x3c800000u) {  // below 2^-6: the subnormal grid, multiples of 2^-9
    // + 2^-9 * 2^23 makes the FPU round the value to a multiple of 2^-9 (ties to even).
    const float shifted = bits_float(u) + 16384.0f;  // 2^14: its ulp is 2^-9
    return sign | uint8_t(float_bits(shifted) - 0x46800000u);
  }
  const uint32_t odd = (u >> 20) & 1u;
  u += 0x7ffffu + odd;  // round the mantissa to 3 bits, ties to even
  return sign | uint8_t(((u >> 20) - (120u << 3)) & 0x7fu);
}

// [Note: blockwise 8-bit states] The 8-bit optimizers of Dettmers et al.
// ("8-bit Optimizers via Block-wise Quantization", 2022): a state is cut into
// blocks of 256 elements in memory order (from each tensor's first element);
// a block stores its absolute maximum as one fp32 and each element as an
// 8-bit code of value / absmax in a dynamic map. The map spends its codes
// like a float with a variable-length exponent: decades 10^-z (z = 0 is
// (0.1, 1]) each hold a linear grid, the top decade the finest, so that
// relative precision stays even across seven decades. Signed map (exp_avg):
// a sign bit and 7 magnitude bits, decades z = 0..6 holding 2^(6-z) values;
// unsigned map (exp_avg_sq): 8 magnitude bits, decades 0..7 holding
// 2^(7-z). Magnitude code 0 is 0; code c in [2^k, 2^(k+1)) is decade
// z = top - k, value lower_z + (c - 2^k + 1) * step_z, where lower_z is
// 10^-(z+1) (0 for the bottom decade, which reaches down to 0) and the top
// code of each decade is exactly 10^-z (1.0 for z = 0, so a block's largest
// element is stored exactly).
//
// Encoding rounds value / absmax to the nearest map value with no search:
// the float's exponent and its top 8 mantissa bits index a table of cells
// (relative width 2^-8, narrower than the map's finest relative step, so a
// cell holds at most one midpoint between map values), which gives the code
// nearest the cell's start; one comparison with the midpoint above that code
// settles it. Two table reads and a comparison, the same on the CPU and the
// GPU bit for bit; encoding a decoded value gives back its code. A block's
// update decodes, steps and re-encodes in one pass: its new maximum is
// reduced over the block (one warp on the GPU) before any code is written.
constexpr int kQuantBlock = 256;
constexpr int kQ8Octaves = 32;  // octave o: |y| in [2^-o, 2^(1-o)); the first also takes everything above, the last below
// A cell is y's exponent and top 8 mantissa bits (y_bits >> 15 for y >= 0),
// clamped to the octaves' range and counted from the first cell of the last
// octave: cell (31 - o) * 256 + m. So the index is a shift, a clamp and a
// subtraction; clamping the whole (not the exponent alone) sends values of 2
// and up to the top cell of octave 0 and those below 2^-31 to the bottom
// cell of octave 31, cells of the same code as their own would have
// (q8_map.cpp checks that no midpoint lies in either octave).
constexpr uint32_t kQ8FirstCell = uint32_t(127 - (kQ8Octaves - 1)) << 8;
constexpr uint32_t kQ8LastCell = (127u << 8) | 0xffu;
SHARDADAM_HD constexpr uint32_t q8_cell_of(int octave, int mantissa_top) {
  return uint32_t((kQ8Octaves - 1 - octave) << 8) | uint32_t(mantissa_top);
}

struct Q8Map {
  float decode[256];  // code -> value in [-1, 1] (signed) or [0, 1]
  float mid[128 * 2];  // magnitude code c -> midpoint to the next larger value (+inf past the top)
  uint8_t cell[kQ8Octaves * 256];  // cell (q8_cell_of) -> magnitude code nearest the cell's start
};
struct Q8Maps {
  Q8Map map[2];  // [0] signed (Q8S), [1] unsigned (Q8U)
};
static_assert(sizeof(Q8Maps) % 16 == 0, "Q8Maps is copied in 16-byte words");

// The maps, built once on the host (cpp/q8_map.cpp).
const Q8Maps& q8_maps();
// [Note: settling cells] The CPU engine's cells: 32-bit entries (its compiler
// vectorises table reads of 32-bit entries, not of bytes) that also carry
// the comparison with the midpoint. A cell holds at most one midpoint; where
// the midpoint above the cell's code lies inside the cell, it shares the
// cell's exponent and top 8 mantissa bits with every y there, so y > midpoint
// is a comparison of the low 15 bits. An entry is the code in bits 0-7 and
// those 15 bits of the midpoint in bits 8-23, or 0xffff there where the
// midpoint lies beyond the cell (never passed): one table read settles the
// code instead of two (q8_settle_bits), with q8_settle's result, checked for
// every cell when the table is built.
const int32_t* q8_cell_entries(DType d);

SHARDADAM_HD const Q8Map& q8_map_of(const Q8Maps& maps, DType d) { return maps.map[d == DType::Q8U ? 1 : 0]; }

// The magnitude code of y >= 0 (y = value / absmax, at most 1 but for
// rounding; NaN gives a code too, which its block's NaN maximum makes
// decode to NaN).
// In two steps (the CPU engine runs each as a loop of its own): the cell's
// code from y's bits (q8_cell_index, then a read of a table of any integer
// type: Q8Map's bytes, or the CPU's entries, q8_cell_entries, whose low byte
// is the code), then the comparison that settles it.
SHARDADAM_HD uint32_t q8_cell_index(uint32_t y_bits) {
  const uint32_t top = y_bits >> 15;
  return (top < kQ8FirstCell ? kQ8FirstCell : (top > kQ8LastCell ? kQ8LastCell : top)) - kQ8FirstCell;
}
template <class Cell>
SHARDADAM_HD uint32_t q8_cell_code(uint32_t y_bits, const Cell* cells) {
  return uint32_t(cells[q8_cell_index(y_bits)]);
}
SHARDADAM_HD uint32_t q8_settle(float y, uint32_t cell_code, const Q8Map& q) {
  return cell_code + (y > q.mid[cell_code] ? 1u : 0u);
}
// The same from an entry of q8_cell_entries ([Note: settling cells]).
SHARDADAM_HD uint32_t q8_settle_bits(uint32_t y_bits, uint32_t entry) {
  return (entry & 0xffu) + ((y_bits & 0x7fffu) > (entry >> 8) ? 1u : 0u);
}
SHARDADAM_HD uint32_t q8_magnitude_code(float y, const Q8Map& q) {
  return q8_settle(y, q8_cell_code(float_bits(y), q.cell), q);
}

// The magnitude q8_encode codes: |y| in the signed map, y (negative, -0 and NaN as +0) in the
// unsigned one. A select, not fmaxf, whose result for -0 and +0 may be either zero.
SHARDADAM_HD float q8_magnitude(float y, bool is_signed) { return is_signed ? fabsf(y) : (y > 0.0f ? y : 0.0f); }

// A magnitude code with the sign of y (given as its bits): bit 7 in the
// signed map (zero always as code 0).
SHARDADAM_HD uint8_t q8_with_sign(uint32_t mag, uint32_t y_bits, bool is_signed) {
  return uint8_t(!is_signed || mag == 0 ? mag : (mag | ((y_bits >> 24) & 0x80u)));
}

// The code of y = value / absmax: the signed map keeps the sign in bit 7
// (zero always as code 0); the unsigned map takes negative values as 0.
SHARDADAM_HD uint8_t q8_encode(float y, const Q8Map& q, bool is_signed) {
  return q8_with_sign(q8_magnitude_code(q8_magnitude(y, is_signed), q), float_bits(y), is_signed);
}

// The maximum a block stores: NaN when the block holds an infinity or a
// NaN, so that every element of it decodes to NaN (a non-finite state stays
// visible instead of turning into finite values).
// [Note: block maxima as bits] Both engines find a block's largest |x| as
// the largest of the bit patterns x & 0x7fffffff, integer maxima (one
// instruction each, one warp reduction on the GPU): non-negative floats
// order like their bits, and every NaN and infinity lies above every finite
// value, so the largest pattern is the largest magnitude, or a non-finite
// one that this turns into the NaN maximum whatever its payload.
SHARDADAM_HD float q8_block_max(float absmax) {
  return (float_bits(absmax) & 0x7f800000u) != 0x7f800000u ? absmax : bits_float(0x7fc00000u);
}

// 1 / the stored maximum, or 0 for a block of zeros (every code 0) and for a
// NaN maximum (the codes are then irrelevant).
SHARDADAM_HD float q8_inverse(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

// An fp32 master stored as a bf16 model param (high half, rounded to nearest)
// plus an int16 remainder (low half). Rounding up is recorded by the sign of
// the remainder, so join(split(x)) == x bit for bit for every fp32 x.
SHARDADAM_HD float join_remainder(uint16_t bf16_bits, uint16_t remainder) {
  uint32_t hi = bf16_bits;
  if (remainder & 0x8000u) hi -= 1u;  // the split rounded the high half up
  return bits_float((hi << 16) | remainder);
}

SHARDADAM_HD void split_remainder(float x, uint16_t& bf16_bits, uint16_t& remainder) {
  const uint32_t u = float_bits(x);
  remainder = uint16_t(u & 0xffffu);
  uint32_t hi = u >> 16;
  if (remainder & 0x8000u) hi += 1u;  // low half >= 0.5 ulp of bf16: round up
  bf16_bits = uint16_t(hi);
}

}  // namespace shardadam
