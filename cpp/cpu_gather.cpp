// The CPU engine's table reads ([Note: CPU gathers] in cpu_gather.h).
#include "cpu_gather.h"

#include <cstdlib>
#include <cstring>

#include "dtype.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHARDADAM_X86_GATHERS 1
// GCC 12 warns of uninitialised values inside its own AVX-512 intrinsics
// (their _mm512_undefined_* placeholders; GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace shardadam {
namespace {

void decode_codes_plain(const float* table, const uint8_t* codes, float scale, float* out, int n) {
  for (int k = 0; k < n; ++k) out[k] = table[codes[k]] * scale;
}

void gather32_plain(const uint32_t* table, const uint32_t* index, uint32_t* out, int n) {
  for (int k = 0; k < n; ++k) out[k] = table[index[k]];
}

#ifdef SHARDADAM_X86_GATHERS
__attribute__((target("avx512f"))) void decode_codes_avx512(const float* table, const uint8_t* codes, float scale,
                                                            float* out, int n) {
  const __m512 s = _mm512_set1_ps(scale);
  int k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k)));
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_i32gather_ps(i, table, 4), s));
  }
  decode_codes_plain(table, codes + k, scale, out + k, n - k);
}

__attribute__((target("avx512f"))) void gather32_avx512(const uint32_t* table, const uint32_t* index,
                                                        uint32_t* out, int n) {
  int k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512i i = _mm512_loadu_si512(index + k);
    _mm512_storeu_si512(out + k, _mm512_i32gather_epi32(i, reinterpret_cast<const int*>(table), 4));
  }
  gather32_plain(table, index + k, out + k, n - k);
}

// encode_block: the maximum as the largest |x| bit pattern ([Note: block
// maxima as bits] in dtype.h), then each value's code as q8_encode with
// settling entries; lanes past the last whole 16 go one by one.
__attribute__((target("avx512f"))) float encode_block_avx512(const float* in, int n, const uint32_t* entries,
                                                             bool is_signed, uint8_t* out) {
  const __m512i magnitude_bits = _mm512_set1_epi32(0x7fffffff);
  __m512i top16 = _mm512_setzero_si512();
  int k = 0;
  for (; k + 16 <= n; k += 16)
    top16 = _mm512_max_epu32(top16, _mm512_and_si512(_mm512_loadu_si512(in + k), magnitude_bits));
  uint32_t top = _mm512_reduce_max_epu32(top16);
  for (; k < n; ++k) {
    const uint32_t a = float_bits(in[k]) & 0x7fffffffu;
    top = a > top ? a : top;
  }
  const float absmax = q8_block_max(bits_float(top));
  const float inv = q8_inverse(absmax);
  const __m512 inv16 = _mm512_set1_ps(inv);
  const __m512i first_cell = _mm512_set1_epi32(int(kQ8FirstCell)), last_cell = _mm512_set1_epi32(int(kQ8LastCell));
  const __m512i low15 = _mm512_set1_epi32(0x7fff), low8 = _mm512_set1_epi32(0xff);
  const __m512i one = _mm512_set1_epi32(1), sign_bit = _mm512_set1_epi32(0x80);
  for (k = 0; k + 16 <= n; k += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(in + k), inv16);
    const __m512i y_bits = _mm512_castps_si512(y);
    // q8_magnitude: |y| signed; y where y > 0 (not NaN) unsigned, else +0.
    const __m512i mag = is_signed ? _mm512_and_si512(y_bits, magnitude_bits)
                                  : _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                           y_bits);
    const __m512i cell = _mm512_sub_epi32(
        _mm512_min_epu32(_mm512_max_epu32(_mm512_srli_epi32(mag, 15), first_cell), last_cell), first_cell);
    const __m512i entry = _mm512_i32gather_epi32(cell, reinterpret_cast<const int*>(entries), 4);
    const __mmask16 past_mid = _mm512_cmpgt_epu32_mask(_mm512_and_si512(mag, low15), _mm512_srli_epi32(entry, 8));
    __m512i code = _mm512_and_si512(entry, low8);
    code = _mm512_mask_add_epi32(code, past_mid, code, one);
    if (is_signed)  // q8_with_sign: the sign in bit 7, zero always code 0
      code = _mm512_mask_or_epi32(code, _mm512_test_epi32_mask(code, code), code,
                                  _mm512_and_si512(_mm512_srli_epi32(y_bits, 24), sign_bit));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(code));
  }
  for (; k < n; ++k) {
    const float y = in[k] * inv;
    const uint32_t mag = float_bits(q8_magnitude(y, is_signed));
    out[k] = q8_with_sign(q8_settle_bits(mag, entries[q8_cell_index(mag)]), float_bits(y), is_signed);
  }
  return absmax;
}

__attribute__((target("avx2"))) void decode_codes_avx2(const float* table, const uint8_t* codes, float scale,
                                                       float* out, int n) {
  const __m256 s = _mm256_set1_ps(scale);
  int k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k)));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_i32gather_ps(table, i, 4), s));
  }
  decode_codes_plain(table, codes + k, scale, out + k, n - k);
}

__attribute__((target("avx2"))) void gather32_avx2(const uint32_t* table, const uint32_t* index, uint32_t* out,
                                                   int n) {
  int k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i i = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                        _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), i, 4));
  }
  gather32_plain(table, index + k, out + k, n - k);
}
#endif

enum class GatherIsa { Plain = 0, Avx2 = 1, Avx512 = 2 };
constexpr const char* kGatherIsaNames[] = {"plain", "avx2", "avx512"};

// The widest gathers the CPU has, capped by SHARDADAM_CPU_GATHERS (plain,
// avx2 or avx512; as ATEN_CPU_CAPABILITY caps torch's): to compare them, and
// to rule them out. The Python package refuses other values before it loads
// this library.
GatherIsa pick_gather_isa() {
  GatherIsa isa = GatherIsa::Plain;
#ifdef SHARDADAM_X86_GATHERS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) isa = GatherIsa::Avx512;
  else if (__builtin_cpu_supports("avx2")) isa = GatherIsa::Avx2;
#endif
  if (const char* cap = std::getenv("SHARDADAM_CPU_GATHERS")) {
    for (int i = 0; i < int(GatherIsa::Avx512); ++i)
      if (std::strcmp(cap, kGatherIsaNames[i]) == 0 && int(isa) > i) isa = GatherIsa(i);
  }
  return isa;
}

const GatherIsa kGatherIsa = pick_gather_isa();

template <class F>
F pick(F plain, F avx2, F avx512) {
  return kGatherIsa == GatherIsa::Avx512 ? avx512 : (kGatherIsa == GatherIsa::Avx2 ? avx2 : plain);
}

}  // namespace

#ifdef SHARDADAM_X86_GATHERS
const DecodeCodes decode_codes = pick<DecodeCodes>(decode_codes_plain, decode_codes_avx2, decode_codes_avx512);
const Gather32 gather32 = pick<Gather32>(gather32_plain, gather32_avx2, gather32_avx512);
const EncodeBlock encode_block = pick<EncodeBlock>(nullptr, nullptr, encode_block_avx512);
#else
const DecodeCodes decode_codes = decode_codes_plain;
const Gather32 gather32 = gather32_plain;
const EncodeBlock encode_block = nullptr;
#endif

const char* cpu_gathers() { return kGatherIsaNames[int(kGatherIsa)]; }

}  // namespace shardadam
