// Fused AdamW with compact moments (bf16, or block-wise 8-bit), generic over a SIMD width.
//
// Included by each ISA file inside `namespace lzo { namespace { ... } }`, after it defines
// LZO_TARGET and its vector type (see S1 below for the interface). Every operation here is exact
// integer arithmetic or a single IEEE float operation (add, mul, div, sqrt, fma), so the
// scalar, AVX2 and AVX-512 instantiations give the same bits; the tail of every vector loop runs
// the width-1 instantiation (S1) of the same code.
//
// The update itself is the fp32 path's (adam_elem) on the dequantized moments, with sqrt(v) / bc2
// taken as sqrt(v) * (1 / bc2) (see adam_v); only the stored moments are rounded. Rounding is
// stochastic: round-to-nearest stalls an EMA whose per-step change is below half a unit of the
// stored precision (v's 0.1% decay with beta2=0.999 never moves a bf16 or 8-bit value), so v
// would stop decaying. It is unbiased because the bits r added below the kept precision are
// uniform: x rounds up exactly when its dropped fraction f plus r / 2^16 reaches one unit, which
// has probability f (bf16 drops 16 bits, all covered by r; the 8-bit codes drop 19-20 bits, r
// covers the top 16, so the remaining bias is below 2^-16 of a code step). The bits of element j
// come from a counter-based hash h(j + key), a bijection of 32 bits: as the key varies (one per
// step and seed) every element's bits are uniform, and they do not depend on threads, SIMD
// width or how a buffer is cut into calls. NaN moments store x86's default NaN (bf16 0xffc0).

// 8-bit codes (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022: a
// per-block absmax scale and a non-linear code that keeps small values). Ours is a small float,
// relative to the block scale, which makes encode and decode a few integer operations:
//   exp_avg:          sign bit + E4M3 magnitude (exponent bias 15, subnormals, no inf/NaN codes);
//                     magnitudes from 2^-17 to 1.875 of the scale: 16 binades, 3 mantissa bits.
//   exp_avg_sq (v):   stored as sqrt(v) in unsigned E4M4: 2^-18..1.9375 of the scale, so the
//                     square-root domain keeps 32 binades of v with 4 mantissa bits.
//   scale per block:  absmax / maxcode_value (fp32); 0 when the absmax is 0 or below 2^-126
//                     (the block reads back 0).
//   marked blocks:    a block holding a non-finite value keeps it in its element, as fp32 would
//                     (torch's AdamW and lion_pytorch make only that element's moments and
//                     weight non-finite): its scale is its finite values' absmax over a smaller top code
//                     (exp_avg 1.75, code 0x7e; sqrt(v) 1.8125, code 0xfd), stored with the sign
//                     bit set (scales are otherwise +0 or positive, so earlier checkpoints read
//                     as before), and the codes above it are the non-finite values: exp_avg
//                     0x7f +inf, 0xff -inf, 0x80 NaN (-0's code: there a -0 is stored as +0);
//                     sqrt(v) 0xff +inf, 0xfe NaN. These rare blocks run the width-1 code
//                     (marked_*), the same on every ISA. Before, such a block read back NaN
//                     whole (a stored NaN scale still does).
// Blocks are kBlock (256) consecutive elements counted from element 0 of the call, so a call
// must start on a block boundary of the whole buffer (checked in Python).

// Width-1 "vector": the reference semantics of every operation the generic code uses.
struct S1 {
  static constexpr int W = 1;
  using F = float;
  using I = uint32_t;
  using M = bool;
  LZO_TARGET static F setf(float x) { return x; }
  LZO_TARGET static I seti(uint32_t x) { return x; }
  LZO_TARGET static I iota() { return 0u; }
  LZO_TARGET static F loadf(const float* p) { return *p; }
  LZO_TARGET static void storef(float* p, F x) { *p = x; }
  LZO_TARGET static I load_u8(const uint8_t* p) { return *p; }
  LZO_TARGET static I load_s8(const uint8_t* p) {  // sign-extended
    return static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(*p)));
  }
  LZO_TARGET static void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  LZO_TARGET static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  LZO_TARGET static void store_hi16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x >> 16); }
  template <Dtype G>
  LZO_TARGET static F grad(const void* g, int64_t i) {
    if constexpr (G == kF32) return static_cast<const float*>(g)[i];
    if constexpr (G == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
    if constexpr (G == kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
    return 0.0f;
  }
  template <Dtype O>
  LZO_TARGET static void out(void* o, int64_t i, F x) {
    if constexpr (O == kBF16) static_cast<uint16_t*>(o)[i] = f32_to_bf16(x);
    if constexpr (O == kF16) static_cast<uint16_t*>(o)[i] = f32_to_f16(x);
  }
  template <Dtype O>  // out of a vector known to hold no NaN (wider types skip their NaN fix)
  LZO_TARGET static void out_finite(void* o, int64_t i, F x) { out<O>(o, i, x); }
  LZO_TARGET static F add(F a, F b) { return a + b; }
  LZO_TARGET static F sub(F a, F b) { return a - b; }
  LZO_TARGET static F mul(F a, F b) { return a * b; }
  LZO_TARGET static F div(F a, F b) { return a / b; }
  LZO_TARGET static F sqrt(F a) { return std::sqrt(a); }
  LZO_TARGET static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  LZO_TARGET static I addi(I a, I b) { return a + b; }
  LZO_TARGET static I subi(I a, I b) { return a - b; }
  LZO_TARGET static I andi(I a, I b) { return a & b; }
  LZO_TARGET static I xori(I a, I b) { return a ^ b; }
  LZO_TARGET static I xor_and(I a, I b, I c) { return (a ^ b) & c; }
  LZO_TARGET static I or_and(I a, I b, I c) { return a | (b & c); }
  LZO_TARGET static I minu(I a, I b) { return a < b ? a : b; }
  LZO_TARGET static I maxu(I a, I b) { return a > b ? a : b; }
  LZO_TARGET static uint32_t hmaxu(I a) { return a; }
  LZO_TARGET static M zero_bits(I a, I b) { return (a & b) == 0; }
  LZO_TARGET static M ltf(F a, F b) { return a < b; }
  template <int K>
  LZO_TARGET static I srli(I a) { return a >> K; }
  template <int K>
  LZO_TARGET static I slli(I a) { return a << K; }
  LZO_TARGET static I mullo(I a, I b) { return a * b; }
  LZO_TARGET static I asi(F a) { return f32_bits(a); }
  LZO_TARGET static F asf(I a) { return bits_f32(a); }
  LZO_TARGET static M lti(I a, I b) {
    return static_cast<int32_t>(a) < static_cast<int32_t>(b);
  }
  // Whether out_finite and the moments' NaN-free stores must not take this vector: it holds a
  // NaN (wider types may add cases they cannot round, e.g. denormals for vcvtneps2bf16).
  LZO_TARGET static bool needs_fix(F a) { return a != a; }
  LZO_TARGET static F nan_to_default(F a) { return a != a ? bits_f32(0xffc00000u) : a; }
  LZO_TARGET static I seli(M m, I a, I b) { return m ? a : b; }
  LZO_TARGET static F self(M m, F a, F b) { return m ? a : b; }
};

// Weight-decay form and lerp formula, fixed per loop instantiation (no branches in the loop).
enum Mode : int { kPlain = 0, kDecoupled = 1, kL2 = 2, kLerpLarge = 4 };

inline int mode_of(const AdamConsts& c) {
  const int wd = c.has_wd ? (c.decoupled ? kDecoupled : kL2) : kPlain;
  return wd | (c.lerp_small ? 0 : kLerpLarge);
}

// The per-step constants, broadcast.
template <class V>
struct VConsts {
  typename V::F gs, decay, wd, lw, b2, omb2, ibc2, ns, eps;
  LZO_TARGET explicit VConsts(const AdamConsts& c)
      : gs(V::setf(c.grad_scale)), decay(V::setf(c.decay)), wd(V::setf(c.wd)),
        lw(V::setf(c.lerp_small ? c.lerp_w : c.lerp_w1)), b2(V::setf(c.beta2)),
        omb2(V::setf(c.one_minus_beta2)), ibc2(V::setf(c.inv_bc2)), ns(V::setf(c.neg_step)),
        eps(V::setf(c.eps)) {}
};

// adam_elem's operations, in its order, but for one: sqrt(v) / bc2 is sqrt(v) * (1 / bc2) (one
// more rounding, 2^-24 relative, far below the stored moments' own), which takes one of the
// three divider operations (sqrt, two divisions) off the loop: on AVX-512 they bound it.
// Returns sqrt(v) (the 8-bit code stores it).
template <class V, int Md>
LZO_TARGET inline typename V::F adam_v(const VConsts<V>& k, typename V::F g, typename V::F& p,
                                       typename V::F& m, typename V::F& v) {
  g = V::mul(g, k.gs);
  if constexpr ((Md & 3) == kDecoupled) p = V::mul(p, k.decay);
  if constexpr ((Md & 3) == kL2) g = V::fma(p, k.wd, g);
  const typename V::F d = V::sub(g, m);
  m = V::fma(k.lw, d, (Md & kLerpLarge) ? g : m);
  v = V::fma(V::mul(k.omb2, g), g, V::mul(v, k.b2));
  const typename V::F sq = V::sqrt(v);
  const typename V::F denom = V::add(V::mul(sq, k.ibc2), k.eps);
  p = V::add(p, V::div(V::mul(k.ns, m), denom));
  return sq;
}

// The rounding bits of element j (index in the whole buffer) in a step with key k: h(j + k mod
// 2^32), h a bijection of 32 bits (two odd multiplies and two xor-shifts), so over keys each
// element's 32 bits are uniform, as stochastic rounding needs. The low 16 bits of h round
// exp_avg (lo), the high 16 bits exp_avg_sq (hi); the last xor-shift leaves the high half as it
// was, so hi is the shift itself and lo one ternary op. Loops keep the counter j + k as a vector
// and step it by W.
template <class V>
LZO_TARGET inline void hash_v(typename V::I x, typename V::I& lo, typename V::I& hi) {
  x = V::mullo(x, V::seti(0x7feb352du));
  x = V::xori(x, V::template srli<15>(x));
  x = V::mullo(x, V::seti(0x846ca68bu));
  hi = V::template srli<16>(x);
  lo = V::xor_and(x, hi, V::seti(0xffffu));
}

// The counter vector of elements [i, i + W).
template <class V>
LZO_TARGET inline typename V::I counter_v(uint32_t key, int64_t offset, int64_t i) {
  const uint32_t base = static_cast<uint32_t>(static_cast<uint64_t>(offset + i)) + key;
  return V::addi(V::seti(base), V::iota());
}

// fp32 -> bf16 bits in the high half, stochastically rounded with 16 random bits r16. A NaN is
// first made x86's default NaN (0xffc00000, one vfixupimm), which no r16 can carry out of: every
// NaN stores 0xffc0.
template <class V>
LZO_TARGET inline typename V::I to_bf16_sr(typename V::F x, typename V::I r16) {
  return V::addi(V::asi(V::nan_to_default(x)), r16);
}

// Non-negative x (in units of the block scale) -> E4Mb code with rounding bits r16 (uniform in
// [0, 2^16): stochastic; 0x8000: nearest). Normal range: adding the random bits below the kept
// mantissa and truncating rounds up with probability equal to the dropped fraction. Below 2^-14
// (the code's subnormals) x is first shifted up by 2^-14 into the lowest binade, whose grid has
// the subnormal step, and the result shifted back by one binade's worth of codes (2^Mb).
template <class V, int Mb>
LZO_TARGET inline typename V::I enc_mag(typename V::F x, typename V::I r16) {
  // x >= +0 or NaN (a NaN made by 0 * inf may carry a sign: its code is the largest either way,
  // and the block's scale is NaN).
  const typename V::M sub = V::ltf(x, V::setf(0x1p-14f));
  const typename V::F y = V::self(sub, V::add(x, V::setf(0x1p-14f)), x);
  const typename V::I q = V::subi(
      V::template srli<23 - Mb>(V::addi(V::asi(y), V::template slli<7 - Mb>(r16))),
      V::seli(sub, V::seti((112u << Mb) + (1u << Mb)), V::seti(112u << Mb)));
  return V::minu(q, V::seti((1u << (4 + Mb)) - 1u));
}

template <class V, int Mb>
LZO_TARGET inline typename V::F dec_mag(typename V::I c) {
  const typename V::M sub = V::lti(c, V::seti(1u << Mb));
  const typename V::I c1 = V::seli(sub, V::addi(c, V::seti(1u << Mb)), c);
  const typename V::F x = V::asf(V::addi(V::template slli<23 - Mb>(c1), V::seti(112u << 23)));
  return V::self(sub, V::sub(x, V::setf(0x1p-14f)), x);
}

constexpr float kMaxM = 1.875f;   // largest E4M3 magnitude
constexpr float kMaxS = 1.9375f;  // largest E4M4 value

// exp_avg codes, read sign-extended (the sign then fills the lane's top bits): the magnitude
// decoded as dec_mag<3> does, the sign put back on it, times the block scale.
template <class V>
LZO_TARGET inline typename V::F dec_m(typename V::I c, typename V::F scale) {
  const typename V::M sub = V::zero_bits(c, V::seti(0x78u));  // exponent 0: a subnormal code
  const typename V::I c1 = V::seli(sub, V::addi(c, V::seti(8u)), c);
  const typename V::F x = V::asf(V::addi(V::andi(V::template slli<20>(c1), V::seti(0x07f00000u)),
                                         V::seti(112u << 23)));
  const typename V::F mag = V::self(sub, V::sub(x, V::setf(0x1p-14f)), x);
  return V::mul(V::asf(V::or_and(V::asi(mag), c, V::seti(0x80000000u))), scale);
}

template <class V>
LZO_TARGET inline typename V::I enc_m(typename V::F m, typename V::F inv, typename V::I r16) {
  const typename V::I bits = V::asi(m);
  const typename V::F mag = V::mul(V::asf(V::andi(bits, V::seti(0x7fffffffu))), inv);
  return V::or_and(enc_mag<V, 3>(mag, r16), V::template srli<24>(bits), V::seti(0x80u));
}

// Scale (dequantization multiplier) and its inverse for a block from the max of |x|'s bits.
inline void block_scale(uint32_t maxbits, float maxcode, float& scale, float& inv) {
  if (maxbits >= 0x7f800000u) {  // inf or NaN somewhere in the block
    scale = bits_f32(0x7fc00000u);
    inv = 0.0f;
  } else if (maxbits < 0x00800000u) {  // 0, or below the smallest normal float: reads back 0
    scale = 0.0f;
    inv = 0.0f;
  } else {
    const float absmax = bits_f32(maxbits);
    scale = absmax / maxcode;
    inv = maxcode / absmax;
  }
}

// Marked blocks (see the top): the rare path, width-1 code only.
constexpr float kMaxMx = 1.75f;    // a marked block's largest finite E4M3 magnitude (0x7e)
constexpr float kMaxSx = 1.8125f;  // a marked block's largest finite E4M4 value (0xfd)
constexpr uint32_t kNanM = 0x80u, kInfM = 0x7fu, kNanS = 0xfeu, kInfS = 0xffu;

LZO_TARGET inline bool marked(float scale) { return (f32_bits(scale) >> 31) != 0; }

// One exp_avg code (as stored: the byte) read with its block's scale, marked or not.
LZO_TARGET inline float marked_dec_m(uint8_t code, float scale) {
  const float sc = bits_f32(f32_bits(scale) & 0x7fffffffu);
  if (marked(scale)) {
    if (code == kNanM) return bits_f32(0x7fc00000u);
    if ((code & 0x7fu) == kInfM) return bits_f32((code & 0x80u) ? 0xff800000u : 0x7f800000u);
  }
  return dec_m<S1>(S1::load_s8(&code), sc);
}

// sqrt(v) of one exp_avg_sq code, marked or not.
LZO_TARGET inline float marked_dec_s(uint8_t code, float scale) {
  const float sc = bits_f32(f32_bits(scale) & 0x7fffffffu);
  if (marked(scale)) {
    if (code == kNanS) return bits_f32(0x7fc00000u);
    if (code == kInfS) return bits_f32(0x7f800000u);
  }
  return S1::mul(dec_mag<S1, 4>(code), sc);
}

// Scale, inverse and mark of a block of n values (|x| for exp_avg, sqrt(v) >= +0 or NaN) whose
// max bits are maxbits: a block with a non-finite value is scaled over its finite ones.
LZO_TARGET inline bool scale_of(const float* x, int64_t n, uint32_t maxbits, float maxcode,
                                float maxcode_marked, float& scale, float& inv) {
  if (maxbits < 0x7f800000u) {
    block_scale(maxbits, maxcode, scale, inv);
    return false;
  }
  uint32_t mx = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = f32_bits(x[j]) & 0x7fffffffu;
    if (b < 0x7f800000u) mx = std::max(mx, b);
  }
  block_scale(mx, maxcode_marked, scale, inv);
  scale = bits_f32(f32_bits(scale) | 0x80000000u);
  return true;
}

// The exp_avg code of x in a marked block (xm) or not.
LZO_TARGET inline uint8_t marked_enc_m(float x, float inv, uint32_t r16, bool xm) {
  const uint32_t c = enc_m<S1>(x, inv, r16);
  if (!xm) return static_cast<uint8_t>(c);
  const uint32_t sign = f32_bits(x) >> 24 & 0x80u;
  if (x != x) return kNanM;
  if ((f32_bits(x) & 0x7fffffffu) == 0x7f800000u) return static_cast<uint8_t>(kInfM | sign);
  const uint32_t mag = std::min(c & 0x7fu, kInfM - 1u);
  return static_cast<uint8_t>(mag ? (mag | (c & 0x80u)) : 0u);
}

// The exp_avg_sq code of sqrt(v) = s in a marked block (xv) or not.
LZO_TARGET inline uint8_t marked_enc_s(float s, float inv, uint32_t r16, bool xv) {
  const uint32_t c = enc_mag<S1, 4>(S1::mul(s, inv), r16);
  if (!xv) return static_cast<uint8_t>(c);
  if (s != s) return kNanS;
  if (f32_bits(s) == 0x7f800000u) return kInfS;
  return static_cast<uint8_t>(std::min(c, kNanS - 1u));
}

// Everything one loop reads from AdamArgs, in locals the stores cannot alias. `g` and `out` are
// not __restrict: `out` may be `grad` itself (the weights written in place over the gradient), and
// a restrict pair would let the compiler reload a gradient after the store of its weight.
struct Ptrs {
  float* __restrict p;
  const void* g;
  void* out;
  void* __restrict mc;
  void* __restrict vc;
  float* __restrict ms;
  float* __restrict vs;
  uint32_t key;
  int64_t offset;
  explicit Ptrs(const AdamArgs& a)
      : p(a.param), g(a.grad), out(a.out), mc(a.m_compact), vc(a.v_compact), ms(a.m_scale),
        vs(a.v_scale), key(a.key), offset(a.offset) {}
};

template <class V, Dtype G, Dtype O, int Md>
LZO_TARGET void run_bf16(const Ptrs& ap, const AdamConsts& c, int64_t begin, int64_t end) {
  // A copy in registers: the loop's stores could alias `ap` itself, so reading through it
  // would reload every field on every iteration (measured 2x slower).
  const Ptrs a = ap;
  const VConsts<V> k(c);
  float* __restrict param = a.p;
  uint16_t* __restrict m16 = static_cast<uint16_t*>(a.mc);
  uint16_t* __restrict v16 = static_cast<uint16_t*>(a.vc);
  const typename V::I step = V::seti(V::W);
  typename V::I ctr = counter_v<V>(a.key, a.offset, begin);
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W, ctr = V::addi(ctr, step)) {
    typename V::F p = V::loadf(param + i);
    typename V::F m = V::load_bf16(m16 + i);
    typename V::F v = V::load_bf16(v16 + i);
    adam_v<V, Md>(k, V::template grad<G>(a.g, i), p, m, v);
    V::storef(param + i, p);
    typename V::I lo, hi;
    hash_v<V>(ctr, lo, hi);
    if (!V::needs_fix(p)) {  // then m and v hold no NaN either: a NaN in m or v makes p NaN
      if constexpr (O != kNone) V::template out_finite<O>(a.out, i, p);
      V::store_hi16(m16 + i, V::addi(V::asi(m), lo));
      V::store_hi16(v16 + i, V::addi(V::asi(v), hi));
    } else {
      if constexpr (O != kNone) V::template out<O>(a.out, i, p);
      V::store_hi16(m16 + i, to_bf16_sr<V>(m, lo));
      V::store_hi16(v16 + i, to_bf16_sr<V>(v, hi));
    }
  }
  if constexpr (V::W > 1) {
    if (i < end) run_bf16<S1, G, O, Md>(a, c, i, end);
  }
}

// One block [bs, be) of the 8-bit path: update from the dequantized moments (master and out
// written at once), keep the new m and sqrt(v) in L1, then quantize them with the block's scale.
template <class V, Dtype G, Dtype O, int Md>
LZO_TARGET void q8_update(const Ptrs& ap, const VConsts<V>& k, int64_t bs, int64_t be,
                          int64_t& ir, float sm, float sv, float* __restrict mb,
                          float* __restrict sb, uint32_t& mmax, uint32_t& smax) {
  const Ptrs a = ap;  // locals, as in run_bf16
  int64_t i = ir;
  float* __restrict param = a.p;
  const uint8_t* __restrict m8 = static_cast<const uint8_t*>(a.mc);
  const uint8_t* __restrict v8 = static_cast<const uint8_t*>(a.vc);
  const typename V::F scm = V::setf(sm), scv = V::setf(sv);
  const typename V::I abs = V::seti(0x7fffffffu);
  typename V::I mx = V::seti(0u), sx = V::seti(0u);
  for (; i + V::W <= be; i += V::W) {
    typename V::F p = V::loadf(param + i);
    typename V::F m = dec_m<V>(V::load_s8(m8 + i), scm);
    const typename V::F s = V::mul(dec_mag<V, 4>(V::load_u8(v8 + i)), scv);
    typename V::F v = V::mul(s, s);
    const typename V::F sq = adam_v<V, Md>(k, V::template grad<G>(a.g, i), p, m, v);
    V::storef(param + i, p);
    if constexpr (O != kNone) {
      if (!V::needs_fix(p)) {
        V::template out_finite<O>(a.out, i, p);
      } else {
        V::template out<O>(a.out, i, p);
      }
    }
    V::storef(mb + (i - bs), m);
    V::storef(sb + (i - bs), sq);
    // max of |x| as unsigned integers: exact, order-free, and >= 0x7f800000 iff a value is not
    // finite. sqrt(v) is +0, positive or NaN (v >= +0), so its bits need no mask.
    mx = V::maxu(mx, V::andi(V::asi(m), abs));
    sx = V::maxu(sx, V::asi(sq));
  }
  ir = i;
  mmax = std::max(mmax, V::hmaxu(mx));
  smax = std::max(smax, V::hmaxu(sx));
}

template <class V>
LZO_TARGET void q8_store(const Ptrs& ap, int64_t bs, int64_t be, int64_t& ir, float im,
                         float iv, const float* __restrict mb, const float* __restrict sb) {
  const Ptrs a = ap;
  int64_t i = ir;
  uint8_t* __restrict m8 = static_cast<uint8_t*>(a.mc);
  uint8_t* __restrict v8 = static_cast<uint8_t*>(a.vc);
  const typename V::F invm = V::setf(im), invv = V::setf(iv);
  const typename V::I step = V::seti(V::W);
  typename V::I ctr = counter_v<V>(a.key, a.offset, i);
  for (; i + V::W <= be; i += V::W, ctr = V::addi(ctr, step)) {
    typename V::I lo, hi;
    hash_v<V>(ctr, lo, hi);
    V::store_u8(m8 + i, enc_m<V>(V::loadf(mb + (i - bs)), invm, lo));
    V::store_u8(v8 + i, enc_mag<V, 4>(V::mul(V::loadf(sb + (i - bs)), invv), hi));
  }
  ir = i;
}

// The codes of a block with a non-finite value (mmax or smax >= 0x7f800000) in width-1 code;
// a moment whose block holds none is coded as q8_store does.
LZO_TARGET inline void q8_store_marked(const Ptrs& a, int64_t bs, int64_t be, int64_t blk,
                                       const float* mb, const float* sb, uint32_t mmax,
                                       uint32_t smax) {
  float im, iv;
  const bool xm = scale_of(mb, be - bs, mmax, kMaxM, kMaxMx, a.ms[blk], im);
  const bool xv = scale_of(sb, be - bs, smax, kMaxS, kMaxSx, a.vs[blk], iv);
  uint8_t* m8 = static_cast<uint8_t*>(a.mc);
  uint8_t* v8 = static_cast<uint8_t*>(a.vc);
  for (int64_t i = bs; i < be; ++i) {
    uint32_t lo, hi;
    hash_v<S1>(counter_v<S1>(a.key, a.offset, i), lo, hi);
    m8[i] = marked_enc_m(mb[i - bs], im, lo, xm);
    v8[i] = marked_enc_s(sb[i - bs], iv, hi, xv);
  }
}

// One marked block (read or written): q8_update and q8_store in width-1 code, each moment's
// codes read and written with its own scale, marked or not.
template <Dtype G, Dtype O, int Md>
LZO_TARGET void q8_marked(const Ptrs& a, const VConsts<S1>& k, int64_t bs, int64_t be,
                          int64_t blk, float* __restrict mb, float* __restrict sb) {
  uint8_t* m8 = static_cast<uint8_t*>(a.mc);
  uint8_t* v8 = static_cast<uint8_t*>(a.vc);
  const float sm = a.ms[blk], sv = a.vs[blk];
  uint32_t mmax = 0, smax = 0;
  for (int64_t i = bs; i < be; ++i) {
    float p = a.p[i];
    float m = marked_dec_m(m8[i], sm);
    const float s = marked_dec_s(v8[i], sv);
    float v = S1::mul(s, s);
    const float sq = adam_v<S1, Md>(k, S1::grad<G>(a.g, i), p, m, v);
    a.p[i] = p;
    if constexpr (O != kNone) S1::out<O>(a.out, i, p);
    mb[i - bs] = m;
    sb[i - bs] = sq;
    mmax = std::max(mmax, f32_bits(m) & 0x7fffffffu);
    smax = std::max(smax, f32_bits(sq));
  }
  q8_store_marked(a, bs, be, blk, mb, sb, mmax, smax);
}

template <class V, Dtype G, Dtype O, int Md>
LZO_TARGET void run_q8(const Ptrs& a, const AdamConsts& c, int64_t begin, int64_t end) {
  const VConsts<V> k(c);
  const VConsts<S1> k1(c);
  alignas(64) float mb[kBlock];
  alignas(64) float sb[kBlock];
  for (int64_t bs = begin; bs < end; bs += kBlock) {  // begin is a block boundary
    const int64_t be = std::min(end, bs + kBlock);
    const int64_t blk = bs / kBlock;
    if (marked(a.ms[blk]) || marked(a.vs[blk])) {  // a non-finite value read back
      q8_marked<G, O, Md>(a, k1, bs, be, blk, mb, sb);
      continue;
    }
    uint32_t mmax = 0, smax = 0;
    int64_t i = bs;
    q8_update<V, G, O, Md>(a, k, bs, be, i, a.ms[blk], a.vs[blk], mb, sb, mmax, smax);
    if constexpr (V::W > 1) {
      q8_update<S1, G, O, Md>(a, k1, bs, be, i, a.ms[blk], a.vs[blk], mb, sb, mmax, smax);
    }
    if (mmax >= 0x7f800000u || smax >= 0x7f800000u) {  // a non-finite value written
      q8_store_marked(a, bs, be, blk, mb, sb, mmax, smax);
      continue;
    }
    float im, iv;
    block_scale(mmax, kMaxM, a.ms[blk], im);
    block_scale(smax, kMaxS, a.vs[blk], iv);
    i = bs;
    q8_store<V>(a, bs, be, i, im, iv, mb, sb);
    if constexpr (V::W > 1) q8_store<S1>(a, bs, be, i, im, iv, mb, sb);
  }
}

template <class V, Dtype G, Dtype O, int Md>
LZO_TARGET void run_mode(const AdamArgs& args, int64_t begin, int64_t end) {
  const Ptrs a(args);
  if (args.moment == kMomBF16) {
    run_bf16<V, G, O, Md>(a, args.c, begin, end);
  } else {
    run_q8<V, G, O, Md>(a, args.c, begin, end);
  }
}

template <class V, Dtype G, Dtype O>
struct CompactLoop {
  LZO_TARGET static void run(const AdamArgs& a, int64_t begin, int64_t end) {
    switch (mode_of(a.c)) {
      case kDecoupled: return run_mode<V, G, O, kDecoupled>(a, begin, end);
      case kL2: return run_mode<V, G, O, kL2>(a, begin, end);
      case kPlain: return run_mode<V, G, O, kPlain>(a, begin, end);
      case kDecoupled | kLerpLarge: return run_mode<V, G, O, kDecoupled | kLerpLarge>(a, begin, end);
      case kL2 | kLerpLarge: return run_mode<V, G, O, kL2 | kLerpLarge>(a, begin, end);
      default: return run_mode<V, G, O, kPlain | kLerpLarge>(a, begin, end);
    }
  }
};
