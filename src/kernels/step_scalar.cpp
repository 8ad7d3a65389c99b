// Portable path (any CPU, aarch64 included) and the tail of the vector paths.
#include "step.h"

#include <algorithm>

#define LZO_TARGET

namespace lzo {

namespace {

template <Dtype G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  if constexpr (G == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  if constexpr (G == kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return 0.0f;
}

template <Dtype G, Dtype O>
void update(const AdamArgs& a, int64_t begin, int64_t end) {
  const AdamConsts c = a.c;
  for (int64_t i = begin; i < end; ++i) {
    adam_elem(c, load_grad<G>(a.grad, i), a.param[i], a.exp_avg[i], a.exp_avg_sq[i]);
    if constexpr (O == kBF16) static_cast<uint16_t*>(a.out)[i] = f32_to_bf16(a.param[i]);
    if constexpr (O == kF16) static_cast<uint16_t*>(a.out)[i] = f32_to_f16(a.param[i]);
  }
}

template <Dtype G, Dtype O>
struct Loop {
  static void run(const AdamArgs& a, int64_t begin, int64_t end) { update<G, O>(a, begin, end); }
};

#include "compact.h"

template <Dtype G, Dtype O>
struct CLoop : CompactLoop<S1, G, O> {};

#include "lion.h"

template <Dtype G, Dtype O>
struct LLoop : LionLoop<S1, G, O> {};

}  // namespace

void adamw_scalar(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<Loop>(a, begin, end);
}

void compact_scalar(const AdamArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<CLoop>(a, begin, end);
}

void lion_scalar(const LionArgs& a, int64_t begin, int64_t end) {
  dispatch_dtypes<LLoop>(a, begin, end);
}

void probe_scalar(const ProbeArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = bf16_to_f32(a.g[i]) * a.scale;
    a.a[i] += g;
    a.b[i] += g;
    if (a.c) a.c[i] += g;
    a.out[i] = static_cast<uint16_t>(f32_bits(a.a[i]) >> 16);
  }
}

}  // namespace lzo
