// AVX-512 path for CPUs with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): the
// compact-moment loops of step_avx512.cpp, but the bf16 weights out are one vcvtneps2bf16.
// That instruction rounds to nearest even like store_out but reads denormals as zero (and quiets
// NaNs its own way), so a vector holding a NaN or a denormal takes the generic out instead: the
// bits are the other paths' bits. The fp32-moment loop and the probe are step_avx512.cpp's.
#include "step.h"

#if LZO_X86
#include <immintrin.h>

#include <algorithm>

#define LZO_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")))

namespace lzo {

namespace {

#include "avx512.h"

struct V16BF : V16 {
  template <Dtype O>
  LZO_TARGET static void out_finite(void* o, int64_t i, F x) {
    if constexpr (O == kBF16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o) + i),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    } else {
      V16::out_finite<O>(o, i, x);
    }
  }
  LZO_TARGET static bool needs_fix(F a) {  // QNaN 0x01, SNaN 0x80, denormal 0x20
    return _mm512_fpclass_ps_mask(a, 0x01 | 0x80 | 0x20) != 0;
  }
};

#include "compact.h"

template <Dtype G, Dtype O>
struct CLoop : CompactLoop<V16BF, G, O> {};
}  // namespace

void compact_avx512bf16(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<CLoop>(a, begin, end);
}

}  // namespace lzo

#endif  // LZO_X86
