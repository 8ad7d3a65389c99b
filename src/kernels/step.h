// Fused AdamW and Lion over flat arrays: shared declarations and the canonical per-element
// formulas.
//
// No torch headers here: the ISA files compile some functions for AVX2/AVX-512 with target
// attributes, and must not instantiate shared inline code (ODR) under those targets.
// Every path evaluates the same formula with the same roundings (see adam_elem), so the scalar,
// AVX2 and AVX-512 paths give bit-identical results; the whole build uses -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define LZO_X86 1
#else
#define LZO_X86 0
#endif

namespace lzo {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// How the two Adam moments are stored. kMomF32: fp32 arrays (exp_avg, exp_avg_sq), exact AdamW.
// kMomBF16: bf16 arrays, stochastically rounded. kMomQ8: one byte per element plus one fp32
// scale per block of kBlock elements (see compact.h for the codes).
enum Moment : int { kMomF32 = 0, kMomBF16 = 1, kMomQ8 = 2 };
constexpr int64_t kBlock = 256;

// Per-step constants, computed once in double as torch does, then rounded to float.
struct AdamConsts {
  float grad_scale;
  float decay;      // 1 - lr * weight_decay (decoupled)
  float wd;         // weight_decay (L2)
  float lerp_w;     // 1 - beta1: exp_avg.lerp_(grad, lerp_w)
  float lerp_w1;    // lerp_w - 1
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float inv_bc2;    // 1 / sqrt(1 - beta2^step), rounded once: the compact paths multiply by it
  float neg_step;   // -lr / (1 - beta1^step)
  float eps;
  bool has_wd;
  bool decoupled;
  bool lerp_small;  // |lerp_w| < 0.5 picks torch's lerp formula
};

struct AdamArgs {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  // May be null, or exactly `grad` (same address and 16-bit dtype): every path reads an element's
  // gradient before it writes that element's weight, and touches no other element's gradient, so
  // writing in place gives the bits of a separate buffer. Keep it so in any new path.
  void* out;
  Dtype grad_dtype;
  Dtype out_dtype;  // kNone when out is null
  AdamConsts c;
  // Compact moments (kMomBF16: uint16 bf16 bits; kMomQ8: uint8 codes + per-block scales).
  Moment moment;
  void* m_compact;
  void* v_compact;
  float* m_scale;  // kMomQ8: ceil(n / kBlock) scales each
  float* v_scale;
  uint32_t key;    // stochastic-rounding key for this step (derived from seed and step in Python)
  int64_t offset;  // index of element 0 in the whole moment buffer: the rounding counter
};

// Streaming probe: same arrays and access pattern as the fused step with a bf16 gradient and
// bf16 out (Adam: read 2 + 12 bytes, write 12 + 2 bytes per element; Lion, c null: 2 + 8 and
// 8 + 2), trivial arithmetic: a, b, c += g * scale (scale = 0 leaves them unchanged), out =
// bf16 bits of a (truncated).
struct ProbeArgs {
  float* a;
  float* b;
  float* c;  // may be null: two fp32 arrays (Lion's pattern)
  const uint16_t* g;
  uint16_t* out;
  float scale;
};

// Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023), as lion_pytorch
// computes it in fp32: p *= decay; p -= lr * sign(beta1 * m + (1 - beta1) * g);
// m = beta2 * m + (1 - beta2) * g. One moment, stored like Adam's exp_avg (see compact.h).
struct LionConsts {
  float grad_scale;
  float decay;    // 1 - lr * weight_decay, in double as lion_pytorch computes it
  float beta1;
  float omb1;     // 1 - beta1
  float beta2;
  float omb2;     // 1 - beta2
  float neg_lr;   // -lr
};

struct LionArgs {
  float* param;
  void* m;           // kMomF32: float; kMomBF16: uint16 bf16 bits; kMomQ8: uint8 codes
  float* m_scale;    // kMomQ8: ceil(n / kBlock) scales
  const void* grad;
  void* out;         // null, or exactly `grad` (see AdamArgs::out)
  Dtype grad_dtype;
  Dtype out_dtype;
  Moment moment;
  LionConsts c;
  uint32_t key;
  int64_t offset;
};

using AdamFn = void (*)(const AdamArgs&, int64_t begin, int64_t end);
using LionFn = void (*)(const LionArgs&, int64_t begin, int64_t end);
using ProbeFn = void (*)(const ProbeArgs&, int64_t begin, int64_t end);

void adamw_scalar(const AdamArgs& a, int64_t begin, int64_t end);
void compact_scalar(const AdamArgs& a, int64_t begin, int64_t end);
void lion_scalar(const LionArgs& a, int64_t begin, int64_t end);
void probe_scalar(const ProbeArgs& a, int64_t begin, int64_t end);
#if LZO_X86
void adamw_avx2(const AdamArgs& a, int64_t begin, int64_t end);
void compact_avx2(const AdamArgs& a, int64_t begin, int64_t end);
void lion_avx2(const LionArgs& a, int64_t begin, int64_t end);
void probe_avx2(const ProbeArgs& a, int64_t begin, int64_t end);
void adamw_avx512(const AdamArgs& a, int64_t begin, int64_t end);
void compact_avx512(const AdamArgs& a, int64_t begin, int64_t end);
void lion_avx512(const LionArgs& a, int64_t begin, int64_t end);
void probe_avx512(const ProbeArgs& a, int64_t begin, int64_t end);
void compact_avx512bf16(const AdamArgs& a, int64_t begin, int64_t end);
#endif

// Runs the instantiation of an ISA's loop that fits the run-time dtypes. `Loop<G, O>::run` is
// each ISA file's own (in its anonymous namespace, so every file gets its own dispatcher).
template <template <Dtype, Dtype> class Loop, Dtype G, class Args>
inline void dispatch_out(const Args& a, int64_t begin, int64_t end) {
  switch (a.out_dtype) {
    case kBF16: return Loop<G, kBF16>::run(a, begin, end);
    case kF16: return Loop<G, kF16>::run(a, begin, end);
    default: return Loop<G, kNone>::run(a, begin, end);
  }
}

template <template <Dtype, Dtype> class Loop, class Args>
inline void dispatch_dtypes(const Args& a, int64_t begin, int64_t end) {
  switch (a.grad_dtype) {
    case kBF16: return dispatch_out<Loop, kBF16>(a, begin, end);
    case kF16: return dispatch_out<Loop, kF16>(a, begin, end);
    default: return dispatch_out<Loop, kF32>(a, begin, end);
  }
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Exact, including subnormals; NaN keeps its payload and becomes quiet (as F16C does).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man ? 0x400000u | (man << 13) : 0u));
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return bits_f32(sign | f32_bits(mag));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even, as torch's CPU cast does on x86 (NaN -> 0xffff, any sign or payload).
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if (std::isnan(f)) return 0xffffu;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Round to nearest even with F16C semantics: overflow -> inf, subnormals rounded, NaN quiet with
// its payload truncated (what torch's cast produces on x86).
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
  if (u >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 2^16: inf
  if (u < 0x38800000u) {  // below 2^-14: half subnormal or zero; the add rounds to nearest even
    const float r = bits_f32(u) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(r) - 0x3f000000u));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias exponent (127 -> 15) and add the rounding bias
  return static_cast<uint16_t>(sign | (u >> 13));
}

// The canonical update of one element. Vector paths evaluate exactly these operations.
inline void adam_elem(const AdamConsts& c, float g, float& p, float& m, float& v) {
  g = g * c.grad_scale;
  float pv = p;
  if (c.has_wd) {
    if (c.decoupled) {
      pv = pv * c.decay;
    } else {
      g = std::fma(pv, c.wd, g);
    }
  }
  const float d = g - m;
  m = c.lerp_small ? std::fma(c.lerp_w, d, m) : std::fma(c.lerp_w1, d, g);
  v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = pv + (c.neg_step * m) / denom;
}

}  // namespace lzo
