// AVX2 + FMA + F16C path, 8 floats per step; chosen at run time (see bindings.cpp).
// Only the functions marked LZO_TARGET use these instructions; the tail goes to the scalar path,
// which computes the same formula (adam_elem) bit for bit.
#include "step.h"

#if LZO_X86
#include <immintrin.h>

#include <algorithm>

#define LZO_TARGET __attribute__((target("avx2,fma,f16c")))

namespace lzo {

namespace {

template <Dtype G>
LZO_TARGET inline __m256 load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <Dtype O>
LZO_TARGET inline void store_out(void* out, int64_t i, __m256 x) {
  __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (O == kF16) {
    _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), _mm256_castps_si256(nan));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(dst, _mm256_castsi256_si128(packed));
  }
}

template <Dtype G, Dtype O>
LZO_TARGET void update(const AdamArgs& a, int64_t begin, int64_t end) {
  const AdamConsts& c = a.c;
  const __m256 gs = _mm256_set1_ps(c.grad_scale), decay = _mm256_set1_ps(c.decay);
  const __m256 wd = _mm256_set1_ps(c.wd), lw = _mm256_set1_ps(c.lerp_small ? c.lerp_w : c.lerp_w1);
  const __m256 b2 = _mm256_set1_ps(c.beta2), omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2 = _mm256_set1_ps(c.bc2_sqrt), ns = _mm256_set1_ps(c.neg_step);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const bool dec = c.has_wd && c.decoupled, l2 = c.has_wd && !c.decoupled;
  const bool small = c.lerp_small;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_mul_ps(load_grad<G>(a.grad, i), gs);
    __m256 p = _mm256_loadu_ps(a.param + i);
    __m256 m = _mm256_loadu_ps(a.exp_avg + i);
    __m256 v = _mm256_loadu_ps(a.exp_avg_sq + i);
    if (dec) p = _mm256_mul_ps(p, decay);
    if (l2) g = _mm256_fmadd_ps(p, wd, g);
    const __m256 d = _mm256_sub_ps(g, m);
    m = _mm256_fmadd_ps(lw, d, small ? m : g);
    v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(v, b2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(ns, m), denom));
    _mm256_storeu_ps(a.param + i, p);
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    if constexpr (O != kNone) store_out<O>(a.out, i, p);
  }
  if (i < end) adamw_scalar(a, i, end);
}

template <Dtype G, Dtype O>
struct Loop {
  static void run(const AdamArgs& a, int64_t begin, int64_t end) { update<G, O>(a, begin, end); }
};


// The vector type of the generic compact-moment code (compact.h): 8 lanes.
struct V8 {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  using M = __m256i;
  LZO_TARGET static F setf(float x) { return _mm256_set1_ps(x); }
  LZO_TARGET static I seti(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  LZO_TARGET static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  LZO_TARGET static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  LZO_TARGET static void storef(float* p, F x) { _mm256_storeu_ps(p, x); }
  LZO_TARGET static I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  LZO_TARGET static I load_s8(const uint8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  LZO_TARGET static void store_u8(uint8_t* p, I x) {  // lanes hold 0..255
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(x, x), _mm256_setzero_si256());
    const __m256i d = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(d));
  }
  LZO_TARGET static F load_bf16(const uint16_t* p) { return load_grad<kBF16>(p, 0); }
  LZO_TARGET static void store_hi16(uint16_t* p, I x) {
    const __m256i h = _mm256_srli_epi32(x, 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  template <Dtype G>
  LZO_TARGET static F grad(const void* g, int64_t i) { return load_grad<G>(g, i); }
  template <Dtype O>
  LZO_TARGET static void out(void* o, int64_t i, F x) { store_out<O>(o, i, x); }
  template <Dtype O>
  LZO_TARGET static void out_finite(void* o, int64_t i, F x) { store_out<O>(o, i, x); }
  LZO_TARGET static bool needs_fix(F a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  LZO_TARGET static F add(F a, F b) { return _mm256_add_ps(a, b); }
  LZO_TARGET static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  LZO_TARGET static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  LZO_TARGET static F div(F a, F b) { return _mm256_div_ps(a, b); }
  LZO_TARGET static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  LZO_TARGET static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  LZO_TARGET static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  LZO_TARGET static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  LZO_TARGET static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  LZO_TARGET static I xori(I a, I b) { return _mm256_xor_si256(a, b); }
  LZO_TARGET static I xor_and(I a, I b, I c) { return _mm256_and_si256(_mm256_xor_si256(a, b), c); }
  LZO_TARGET static I or_and(I a, I b, I c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }
  LZO_TARGET static I minu(I a, I b) { return _mm256_min_epu32(a, b); }
  LZO_TARGET static I maxu(I a, I b) { return _mm256_max_epu32(a, b); }
  LZO_TARGET static uint32_t hmaxu(I a) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xb1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  }
  LZO_TARGET static M zero_bits(I a, I b) {
    return _mm256_cmpeq_epi32(_mm256_and_si256(a, b), _mm256_setzero_si256());
  }
  LZO_TARGET static M ltf(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  template <int K>
  LZO_TARGET static I srli(I a) { return _mm256_srli_epi32(a, K); }
  template <int K>
  LZO_TARGET static I slli(I a) { return _mm256_slli_epi32(a, K); }
  LZO_TARGET static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  LZO_TARGET static I asi(F a) { return _mm256_castps_si256(a); }
  LZO_TARGET static F asf(I a) { return _mm256_castsi256_ps(a); }
  LZO_TARGET static M lti(I a, I b) { return _mm256_cmpgt_epi32(b, a); }
  LZO_TARGET static F nan_to_default(F a) {
    return _mm256_blendv_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffc00000u))),
                            _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  LZO_TARGET static I seli(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }
  LZO_TARGET static F self(M m, F a, F b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
};

#include "compact.h"

template <Dtype G, Dtype O>
struct CLoop : CompactLoop<V8, G, O> {};

#include "lion.h"

template <Dtype G, Dtype O>
struct LLoop : LionLoop<V8, G, O> {};
}  // namespace

void adamw_avx2(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<Loop>(a, begin, end);
}

void compact_avx2(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<CLoop>(a, begin, end);
}

void lion_avx2(const LionArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<LLoop>(a, begin, end);
}

LZO_TARGET void probe_avx2(const ProbeArgs& a, int64_t begin, int64_t end) {
  const __m256 scale = _mm256_set1_ps(a.scale);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_mul_ps(load_grad<kBF16>(a.g, i), scale);
    const __m256 x = _mm256_add_ps(_mm256_loadu_ps(a.a + i), g);
    _mm256_storeu_ps(a.a + i, x);
    _mm256_storeu_ps(a.b + i, _mm256_add_ps(_mm256_loadu_ps(a.b + i), g));
    if (a.c) _mm256_storeu_ps(a.c + i, _mm256_add_ps(_mm256_loadu_ps(a.c + i), g));
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.out + i), _mm256_castsi256_si128(packed));
  }
  if (i < end) probe_scalar(a, i, end);
}

}  // namespace lzo

#endif  // LZO_X86
