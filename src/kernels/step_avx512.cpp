// AVX-512F+BW path, 16 floats per step; chosen at run time (see bindings.cpp).
// Same operations as adam_elem in step.h; the tail goes to the scalar path.
#include "step.h"

#if LZO_X86
#include <immintrin.h>

#include <algorithm>

#define LZO_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

namespace lzo {

namespace {

#include "avx512.h"

template <Dtype G, Dtype O>
LZO_TARGET void update(const AdamArgs& a, int64_t begin, int64_t end) {
  const AdamConsts& c = a.c;
  const __m512 gs = _mm512_set1_ps(c.grad_scale), decay = _mm512_set1_ps(c.decay);
  const __m512 wd = _mm512_set1_ps(c.wd), lw = _mm512_set1_ps(c.lerp_small ? c.lerp_w : c.lerp_w1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(c.bc2_sqrt), ns = _mm512_set1_ps(c.neg_step);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const bool dec = c.has_wd && c.decoupled, l2 = c.has_wd && !c.decoupled;
  const bool small = c.lerp_small;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 g = _mm512_mul_ps(load_grad<G>(a.grad, i), gs);
    __m512 p = _mm512_loadu_ps(a.param + i);
    __m512 m = _mm512_loadu_ps(a.exp_avg + i);
    __m512 v = _mm512_loadu_ps(a.exp_avg_sq + i);
    if (dec) p = _mm512_mul_ps(p, decay);
    if (l2) g = _mm512_fmadd_ps(p, wd, g);
    const __m512 d = _mm512_sub_ps(g, m);
    m = _mm512_fmadd_ps(lw, d, small ? m : g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(v, b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(ns, m), denom));
    _mm512_storeu_ps(a.param + i, p);
    _mm512_storeu_ps(a.exp_avg + i, m);
    _mm512_storeu_ps(a.exp_avg_sq + i, v);
    if constexpr (O != kNone) store_out<O>(a.out, i, p);
  }
  if (i < end) adamw_scalar(a, i, end);
}

template <Dtype G, Dtype O>
struct Loop {
  static void run(const AdamArgs& a, int64_t begin, int64_t end) { update<G, O>(a, begin, end); }
};


#include "compact.h"

template <Dtype G, Dtype O>
struct CLoop : CompactLoop<V16, G, O> {};

#include "lion.h"

template <Dtype G, Dtype O>
struct LLoop : LionLoop<V16, G, O> {};
}  // namespace

void adamw_avx512(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<Loop>(a, begin, end);
}

void compact_avx512(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<CLoop>(a, begin, end);
}

void lion_avx512(const LionArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<LLoop>(a, begin, end);
}

LZO_TARGET void probe_avx512(const ProbeArgs& a, int64_t begin, int64_t end) {
  const __m512 scale = _mm512_set1_ps(a.scale);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = _mm512_mul_ps(load_grad<kBF16>(a.g, i), scale);
    const __m512 x = _mm512_add_ps(_mm512_loadu_ps(a.a + i), g);
    _mm512_storeu_ps(a.a + i, x);
    _mm512_storeu_ps(a.b + i, _mm512_add_ps(_mm512_loadu_ps(a.b + i), g));
    if (a.c) _mm512_storeu_ps(a.c + i, _mm512_add_ps(_mm512_loadu_ps(a.c + i), g));
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.out + i), _mm512_cvtepi32_epi16(r));
  }
  if (i < end) probe_scalar(a, i, end);
}

}  // namespace lzo

#endif  // LZO_X86
