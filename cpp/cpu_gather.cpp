// The CPU engine's table reads ([Note: CPU gathers] in cpu_gather.h).
#include "cpu_gather.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHARDADAM_X86_GATHERS 1
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
#else
const DecodeCodes decode_codes = decode_codes_plain;
const Gather32 gather32 = gather32_plain;
#endif

const char* cpu_gathers() { return kGatherIsaNames[int(kGatherIsa)]; }

}  // namespace shardadam
