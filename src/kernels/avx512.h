// The AVX-512 vector helpers shared by step_avx512.cpp and step_avx512bf16.cpp: each includes
// this inside `namespace lzo { namespace { ... } }` after defining LZO_TARGET (so each file
// compiles its own copy for its own target).

template <Dtype G>
LZO_TARGET inline __m512 load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <Dtype O>
LZO_TARGET inline void store_out(void* out, int64_t i, __m512 x) {
  __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (O == kF16) {
    _mm256_storeu_si256(dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff));
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(r));
  }
}

// The vector type of the generic compact-moment code (compact.h): 16 lanes.
struct V16 {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  LZO_TARGET static F setf(float x) { return _mm512_set1_ps(x); }
  LZO_TARGET static I seti(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  LZO_TARGET static I iota() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  LZO_TARGET static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  LZO_TARGET static void storef(float* p, F x) { _mm512_storeu_ps(p, x); }
  LZO_TARGET static I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  LZO_TARGET static I load_s8(const uint8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  LZO_TARGET static void store_u8(uint8_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  // bf16 <-> fp32 as one word permutation each (AVX-512BW): the 16 words go to the odd
  // (high) halves of the lanes, low halves zeroed; and back, the lanes' high halves packed.
  LZO_TARGET static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, widen_idx(), w));
  }
  LZO_TARGET static void store_hi16(uint16_t* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_castsi512_si256(_mm512_permutexvar_epi16(narrow_idx(), x)));
  }
  template <Dtype G>
  LZO_TARGET static F grad(const void* g, int64_t i) {
    if constexpr (G == kBF16) return load_bf16(static_cast<const uint16_t*>(g) + i);
    return load_grad<G>(g, i);
  }
  template <Dtype O>
  LZO_TARGET static void out(void* o, int64_t i, F x) { store_out<O>(o, i, x); }
  template <Dtype O>
  LZO_TARGET static void out_finite(void* o, int64_t i, F x) {
    if constexpr (O == kBF16) {  // store_out's rounding without its NaN fix, packed as store_hi16
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      store_hi16(static_cast<uint16_t*>(o) + i,
                 _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb));
    } else {
      store_out<O>(o, i, x);
    }
  }
  LZO_TARGET static bool needs_fix(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
  LZO_TARGET static __m512i widen_idx() {  // word 2k+1 <- word k
    return _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5,
                            0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  }
  LZO_TARGET static __m512i narrow_idx() {  // word k <- word 2k+1
    return _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29,
                            27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  }
  LZO_TARGET static F add(F a, F b) { return _mm512_add_ps(a, b); }
  LZO_TARGET static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  LZO_TARGET static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  LZO_TARGET static F div(F a, F b) { return _mm512_div_ps(a, b); }
  LZO_TARGET static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  LZO_TARGET static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  LZO_TARGET static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  LZO_TARGET static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  LZO_TARGET static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  LZO_TARGET static I xori(I a, I b) { return _mm512_xor_si512(a, b); }
  LZO_TARGET static I xor_and(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0x28); }
  LZO_TARGET static I or_and(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0xf8); }
  LZO_TARGET static I minu(I a, I b) { return _mm512_min_epu32(a, b); }
  LZO_TARGET static I maxu(I a, I b) { return _mm512_max_epu32(a, b); }
  LZO_TARGET static uint32_t hmaxu(I a) { return _mm512_reduce_max_epu32(a); }
  LZO_TARGET static M zero_bits(I a, I b) { return _mm512_testn_epi32_mask(a, b); }
  LZO_TARGET static M ltf(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  template <int K>
  LZO_TARGET static I srli(I a) { return _mm512_srli_epi32(a, K); }
  template <int K>
  LZO_TARGET static I slli(I a) { return _mm512_slli_epi32(a, K); }
  LZO_TARGET static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  LZO_TARGET static I asi(F a) { return _mm512_castps_si512(a); }
  LZO_TARGET static F asf(I a) { return _mm512_castsi512_ps(a); }
  LZO_TARGET static M lti(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  LZO_TARGET static F nan_to_default(F a) {  // QNaN, SNaN -> QNaN indefinite; others kept
    return _mm512_fixupimm_ps(a, a, _mm512_set1_epi32(0x33), 0);
  }
  LZO_TARGET static I seli(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  LZO_TARGET static F self(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
};
