// Fused Lion, generic over a SIMD width: one pass reads the gradient, master and moment and
// writes the master, the moment and (optionally) the half weights.
//
// Included by each ISA file inside `namespace lzo { namespace { ... } }` after compact.h (whose
// vector types, rounding bits and exp_avg codes it uses). The formula is lion_pytorch's update
// in fp32, operation for operation (torch's `add(x, alpha=a)` is one fma on the CPU):
//   g = grad * grad_scale;  p = p * decay;  c = fma(1 - beta1, g, m * beta1);
//   p = p + (-lr) * sign(c);  m = fma(1 - beta2, g, m * beta2)
// sign(c) is torch's: 0 for 0 and NaN (a NaN gradient leaves the weight and makes the moment
// NaN, as lion_pytorch does on the CPU). Every operation is one IEEE operation or exact, so all
// widths give the same bits. A compact moment (bf16, or Adam's exp_avg code in 8 bits with a
// scale per block) is read, updated in fp32 and stored stochastically rounded with the low 16
// bits of the element's random word, as Adam's exp_avg is.

template <class V>
struct LionV {
  typename V::F gs, decay, b1, omb1, b2, omb2, nlr, zero, one, minus_one;
  LZO_TARGET explicit LionV(const LionConsts& c)
      : gs(V::setf(c.grad_scale)), decay(V::setf(c.decay)), b1(V::setf(c.beta1)),
        omb1(V::setf(c.omb1)), b2(V::setf(c.beta2)), omb2(V::setf(c.omb2)),
        nlr(V::setf(c.neg_lr)), zero(V::setf(0.0f)), one(V::setf(1.0f)),
        minus_one(V::setf(-1.0f)) {}
};

// One element's (or vector's) update; returns the new moment, `p` updated in place.
template <class V>
LZO_TARGET inline typename V::F lion_v(const LionV<V>& k, typename V::F g, typename V::F& p,
                                       typename V::F m) {
  g = V::mul(g, k.gs);
  p = V::mul(p, k.decay);
  const typename V::F c = V::fma(k.omb1, g, V::mul(m, k.b1));
  const typename V::F s = V::self(V::ltf(k.zero, c), k.one,
                                  V::self(V::ltf(c, k.zero), k.minus_one, k.zero));
  p = V::add(p, V::mul(s, k.nlr));
  return V::fma(k.omb2, g, V::mul(m, k.b2));
}

template <class V, Dtype O>
LZO_TARGET inline void lion_out(void* out, int64_t i, typename V::F p) {
  if constexpr (O != kNone) {
    if (!V::needs_fix(p)) {
      V::template out_finite<O>(out, i, p);
    } else {
      V::template out<O>(out, i, p);
    }
  }
}

template <class V, Dtype G, Dtype O>
LZO_TARGET void lion_f32(const LionArgs& a, int64_t begin, int64_t end) {
  const LionV<V> k(a.c);
  float* __restrict param = a.param;
  float* __restrict m32 = static_cast<float*>(a.m);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) {
    typename V::F p = V::loadf(param + i);
    const typename V::F m = lion_v<V>(k, V::template grad<G>(a.grad, i), p, V::loadf(m32 + i));
    V::storef(param + i, p);
    V::storef(m32 + i, m);
    lion_out<V, O>(a.out, i, p);
  }
  if constexpr (V::W > 1) {
    if (i < end) lion_f32<S1, G, O>(a, i, end);
  }
}

template <class V, Dtype G, Dtype O>
LZO_TARGET void lion_bf16(const LionArgs& a, int64_t begin, int64_t end) {
  const LionV<V> k(a.c);
  float* __restrict param = a.param;
  uint16_t* __restrict m16 = static_cast<uint16_t*>(a.m);
  const typename V::I step = V::seti(V::W);
  typename V::I ctr = counter_v<V>(a.key, a.offset, begin);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W, ctr = V::addi(ctr, step)) {
    typename V::F p = V::loadf(param + i);
    const typename V::F m = lion_v<V>(k, V::template grad<G>(a.grad, i), p,
                                      V::load_bf16(m16 + i));
    V::storef(param + i, p);
    lion_out<V, O>(a.out, i, p);
    typename V::I lo, hi;
    hash_v<V>(ctr, lo, hi);
    V::store_hi16(m16 + i, to_bf16_sr<V>(m, lo));  // a NaN moment need not make p NaN here
  }
  if constexpr (V::W > 1) {
    if (i < end) lion_bf16<S1, G, O>(a, i, end);
  }
}

// One block [bs, be) of the 8-bit path, first half: the update from the dequantized moment,
// master and out written at once, the new moment kept in L1 (mb) with its largest magnitude.
template <class V, Dtype G, Dtype O>
LZO_TARGET void lion_q8_update(const LionArgs& a, const LionV<V>& k, int64_t bs, int64_t be,
                               int64_t& ir, float scale, float* __restrict mb, uint32_t& mmax) {
  int64_t i = ir;
  float* __restrict param = a.param;
  const uint8_t* __restrict m8 = static_cast<const uint8_t*>(a.m);
  const typename V::F sc = V::setf(scale);
  const typename V::I abs = V::seti(0x7fffffffu);
  typename V::I mx = V::seti(0u);
  for (; i + V::W <= be; i += V::W) {
    typename V::F p = V::loadf(param + i);
    const typename V::F m = lion_v<V>(k, V::template grad<G>(a.grad, i), p,
                                      dec_m<V>(V::load_s8(m8 + i), sc));
    V::storef(param + i, p);
    lion_out<V, O>(a.out, i, p);
    V::storef(mb + (i - bs), m);
    mx = V::maxu(mx, V::andi(V::asi(m), abs));
  }
  ir = i;
  mmax = std::max(mmax, V::hmaxu(mx));
}

// Second half: the block's new moment quantized with its new scale.
template <class V>
LZO_TARGET void lion_q8_store(const LionArgs& a, int64_t bs, int64_t be, int64_t& ir, float inv,
                              const float* __restrict mb) {
  int64_t i = ir;
  uint8_t* __restrict m8 = static_cast<uint8_t*>(a.m);
  const typename V::F invm = V::setf(inv);
  const typename V::I step = V::seti(V::W);
  typename V::I ctr = counter_v<V>(a.key, a.offset, i);
  for (; i + V::W <= be; i += V::W, ctr = V::addi(ctr, step)) {
    typename V::I lo, hi;
    hash_v<V>(ctr, lo, hi);
    V::store_u8(m8 + i, enc_m<V>(V::loadf(mb + (i - bs)), invm, lo));
  }
  ir = i;
}

// A block with a non-finite moment, read (its scale marked) or written (mmax >= 0x7f800000):
// width-1 code, the marked codes of compact.h.
LZO_TARGET inline void lion_q8_store_marked(const LionArgs& a, int64_t bs, int64_t be,
                                            int64_t blk, const float* mb, uint32_t mmax) {
  float inv;
  const bool xm = scale_of(mb, be - bs, mmax, kMaxM, kMaxMx, a.m_scale[blk], inv);
  uint8_t* m8 = static_cast<uint8_t*>(a.m);
  for (int64_t i = bs; i < be; ++i) {
    uint32_t lo, hi;
    hash_v<S1>(counter_v<S1>(a.key, a.offset, i), lo, hi);
    m8[i] = marked_enc_m(mb[i - bs], inv, lo, xm);
  }
}

template <Dtype G, Dtype O>
LZO_TARGET void lion_q8_marked(const LionArgs& a, const LionV<S1>& k, int64_t bs, int64_t be,
                               int64_t blk, float* __restrict mb) {
  const uint8_t* m8 = static_cast<const uint8_t*>(a.m);
  const float scale = a.m_scale[blk];
  uint32_t mmax = 0;
  for (int64_t i = bs; i < be; ++i) {
    float p = a.param[i];
    const float m = lion_v<S1>(k, S1::grad<G>(a.grad, i), p, marked_dec_m(m8[i], scale));
    a.param[i] = p;
    lion_out<S1, O>(a.out, i, p);
    mb[i - bs] = m;
    mmax = std::max(mmax, f32_bits(m) & 0x7fffffffu);
  }
  lion_q8_store_marked(a, bs, be, blk, mb, mmax);
}

template <class V, Dtype G, Dtype O>
LZO_TARGET void lion_q8(const LionArgs& a, int64_t begin, int64_t end) {
  const LionV<V> k(a.c);
  const LionV<S1> k1(a.c);
  alignas(64) float mb[kBlock];
  for (int64_t bs = begin; bs < end; bs += kBlock) {  // begin is a block boundary
    const int64_t be = std::min(end, bs + kBlock);
    const int64_t blk = bs / kBlock;
    if (marked(a.m_scale[blk])) {
      lion_q8_marked<G, O>(a, k1, bs, be, blk, mb);
      continue;
    }
    uint32_t mmax = 0;
    int64_t i = bs;
    lion_q8_update<V, G, O>(a, k, bs, be, i, a.m_scale[blk], mb, mmax);
    if constexpr (V::W > 1) lion_q8_update<S1, G, O>(a, k1, bs, be, i, a.m_scale[blk], mb, mmax);
    if (mmax >= 0x7f800000u) {
      lion_q8_store_marked(a, bs, be, blk, mb, mmax);
      continue;
    }
    float inv;
    block_scale(mmax, kMaxM, a.m_scale[blk], inv);
    i = bs;
    lion_q8_store<V>(a, bs, be, i, inv, mb);
    if constexpr (V::W > 1) lion_q8_store<S1>(a, bs, be, i, inv, mb);
  }
}

template <class V, Dtype G, Dtype O>
struct LionLoop {
  LZO_TARGET static void run(const LionArgs& a, int64_t begin, int64_t end) {
    switch (a.moment) {
      case kMomBF16: return lion_bf16<V, G, O>(a, begin, end);
      case kMomQ8: return lion_q8<V, G, O>(a, begin, end);
      default: return lion_f32<V, G, O>(a, begin, end);
    }
  }
};
