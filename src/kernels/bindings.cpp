// Python bindings: argument sanity checks, per-step constants, ISA choice and threading.
// The friendly argument checks live in Python (lightning_zero_offload.ops); the checks here only
// keep a direct call from touching memory it should not.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "step.h"

namespace {

struct Isa {
  const char* name;
  lzo::AdamFn adam;
  lzo::AdamFn compact;
  lzo::LionFn lion;
  lzo::ProbeFn probe;
  bool supported;
};

std::vector<Isa> detect() {
  std::vector<Isa> isas;  // best first
#if LZO_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma")) {
    if (__builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16")) {
      // compact moments' bf16 out in one instruction; everything else is the avx512 path
      isas.push_back({"avx512bf16", lzo::adamw_avx512, lzo::compact_avx512bf16,
                      lzo::lion_avx512, lzo::probe_avx512, true});
    }
    isas.push_back({"avx512", lzo::adamw_avx512, lzo::compact_avx512, lzo::lion_avx512,
                    lzo::probe_avx512, true});
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    isas.push_back({"avx2", lzo::adamw_avx2, lzo::compact_avx2, lzo::lion_avx2, lzo::probe_avx2,
                    true});
  }
#endif
  isas.push_back({"scalar", lzo::adamw_scalar, lzo::compact_scalar, lzo::lion_scalar,
                  lzo::probe_scalar, true});
  return isas;
}

const std::vector<Isa>& isas() {
  static const std::vector<Isa> v = detect();
  return v;
}

std::atomic<int> g_isa{0};  // index into isas(); 0 = best available

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const auto& i : isas()) names.emplace_back(i.name);
  return names;
}

std::string get_isa() { return isas()[g_isa.load()].name; }

void set_isa(const std::string& name) {
  const auto& v = isas();
  for (size_t i = 0; i < v.size(); ++i) {
    if (name == v[i].name) {
      g_isa.store(static_cast<int>(i));
      return;
    }
  }
  std::string names;
  for (const auto& i : v) names += std::string(names.empty() ? "" : ", ") + i.name;
  TORCH_CHECK(false, "set_isa: '", name, "' is not available on this CPU (available: ", names,
              ")");
}

// A small persistent thread pool. Work is cut into chunks of kChunk elements (whole vectors and
// cache lines) that threads claim from an atomic counter, and each element's result does not
// depend on its neighbours, so results do not depend on the thread count or on who ran a chunk.
// The caller works too and waits only for chunks that were claimed: a helper that is late (a busy
// machine) finds nothing left and costs nothing. Idle helpers sleep on a condition variable.
constexpr int64_t kChunk = 1 << 16;

struct Job {
  std::function<void(int64_t, int64_t)> fn;
  int64_t n = 0, chunks = 0;
  int max_helpers = 0;
  int helpers = 0;  // guarded by Pool::mu
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      fn(c * kChunk, std::min(n, (c + 1) * kChunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  void run(int64_t n, int64_t threads, std::function<void(int64_t, int64_t)> fn) {
    auto job = std::make_shared<Job>();
    job->n = n;
    job->chunks = (n + kChunk - 1) / kChunk;
    job->max_helpers = static_cast<int>(std::min<int64_t>(threads, job->chunks) - 1);
    job->fn = std::move(fn);
    if (job->max_helpers > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(workers_) < job->max_helpers) {
        std::thread([this] { loop(); }).detach();  // lives as long as the process
        ++workers_;
      }
      current_ = job;
      ++seq_;
      cv_.notify_all();
    }
    job->work();
    for (int spins = 0; job->done.load(std::memory_order_acquire) < job->chunks; ++spins) {
      if (spins > 2000) std::this_thread::yield();
    }
    if (job->max_helpers > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      if (current_ == job) current_.reset();
    }
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return current_ && seq_ != seen; });
        seen = seq_;
        if (current_->helpers >= current_->max_helpers) continue;
        ++current_->helpers;
        job = current_;
      }
      job->work();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> current_;
  uint64_t seq_ = 0;
  size_t workers_ = 0;
};

bool torch_pool_available() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

// `torch_pool`: run the chunks on torch's intra-op (OpenMP) pool, whose workers are the ones
// still spinning right after a torch op, instead of waking our own threads to compete with them
// for the cores. Only from the thread that runs torch ops (the Python face passes true on the
// main thread) and only when the thread count is torch's; a worker thread (delayed update) keeps
// our own pool, which does not disturb torch's. Chunks are the same either way, so the results.
void parallel_for(int64_t n, int64_t threads, std::function<void(int64_t, int64_t)> fn,
                  bool torch_pool = false) {
  if (n <= kChunk || threads <= 1) {
    fn(0, n);
    return;
  }
#ifdef _OPENMP
  if (torch_pool && threads == at::get_num_threads() && !at::in_parallel_region()) {
    // One task per pool thread, each claiming chunks as our own pool does: a thread the OS has
    // descheduled (a busy machine) leaves its share to the others instead of holding it.
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(threads, chunks), 1, [&](int64_t, int64_t) {
      for (int64_t c; (c = next.fetch_add(1)) < chunks;) fn(c * kChunk, std::min(n, (c + 1) * kChunk));
    });
    return;
  }
#endif
  // Never destroyed (helpers may outlive static destruction); a forked child gets a new pool.
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  static std::mutex create_mu;
  Pool* p;
  {
    std::lock_guard<std::mutex> lk(create_mu);
    if (pool == nullptr || owner != getpid()) {
      pool = new Pool();
      owner = getpid();
    }
    p = pool;
  }
  p->run(n, threads, std::move(fn));
}

lzo::Dtype dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return lzo::kF32;
    case torch::kBFloat16: return lzo::kBF16;
    case torch::kHalf: return lzo::kF16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

void check(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.layout() == torch::kStrided && t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
}

lzo::Moment moment_of(const torch::Tensor& m, const torch::Tensor& v) {
  TORCH_CHECK(m.scalar_type() == v.scalar_type(), "exp_avg and exp_avg_sq must share a dtype");
  switch (m.scalar_type()) {
    case torch::kFloat: return lzo::kMomF32;
    case torch::kBFloat16: return lzo::kMomBF16;
    case torch::kByte: return lzo::kMomQ8;
    default: TORCH_CHECK(false, "moments must be float32, bfloat16 or uint8, got ", m.scalar_type());
  }
}

// The fields every step kernel's arguments share (param, gradient, weights out, rounding key and
// counter), checked: a direct call must not touch memory it should not.
template <class Args>
void bind_common(Args& a, torch::Tensor& param, torch::Tensor& grad,
                 c10::optional<torch::Tensor>& out, int64_t key, int64_t offset) {
  const int64_t n = param.numel();
  TORCH_CHECK(param.scalar_type() == torch::kFloat, "param must be float32");
  check(param, "param", n);
  check(grad, "grad", n);
  TORCH_CHECK(offset >= 0, "offset must be >= 0");
  a.param = param.data_ptr<float>();
  a.key = static_cast<uint32_t>(key);
  a.offset = offset;
  a.grad = grad.data_ptr();
  a.grad_dtype = dtype_of(grad);
  a.out = nullptr;
  a.out_dtype = lzo::kNone;
  if (out.has_value()) {
    check(*out, "out", n);
    a.out_dtype = dtype_of(*out);
    TORCH_CHECK(a.out_dtype != lzo::kF32, "out must be bfloat16 or float16");
    a.out = out->data_ptr();
  }
}

void fused_adamw(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg,
                 torch::Tensor exp_avg_sq, c10::optional<torch::Tensor> out, int64_t step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool decoupled, double grad_scale, int64_t num_threads,
                 c10::optional<torch::Tensor> exp_avg_scales,
                 c10::optional<torch::Tensor> exp_avg_sq_scales, int64_t key, int64_t offset,
                 bool torch_pool) {
  const int64_t n = param.numel();
  lzo::AdamArgs a{};
  bind_common(a, param, grad, out, key, offset);
  const lzo::Moment moment = moment_of(exp_avg, exp_avg_sq);
  check(exp_avg, "exp_avg", n);
  check(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "step must be >= 1");
  a.moment = moment;
  if (moment == lzo::kMomF32) {
    a.exp_avg = exp_avg.data_ptr<float>();
    a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  } else {
    a.m_compact = exp_avg.data_ptr();
    a.v_compact = exp_avg_sq.data_ptr();
  }
  const bool q8 = moment == lzo::kMomQ8;
  TORCH_CHECK(q8 == exp_avg_scales.has_value() && q8 == exp_avg_sq_scales.has_value(),
              "scales are given exactly for uint8 (block-wise 8-bit) moments");
  if (q8) {
    TORCH_CHECK(offset % lzo::kBlock == 0, "offset must be a multiple of ", lzo::kBlock);
    const int64_t blocks = (n + lzo::kBlock - 1) / lzo::kBlock;
    for (auto* t : {&*exp_avg_scales, &*exp_avg_sq_scales}) {
      TORCH_CHECK(t->scalar_type() == torch::kFloat, "scales must be float32");
      check(*t, "scales", blocks);
    }
    a.m_scale = exp_avg_scales->data_ptr<float>();
    a.v_scale = exp_avg_sq_scales->data_ptr<float>();
  }
  // Scalars as torch.optim.AdamW computes them: Python floats (double), rounded to float where
  // they meet a float32 tensor.
  lzo::AdamConsts& c = a.c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.has_wd = weight_decay != 0.0;
  c.decoupled = decoupled;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.wd = static_cast<float>(weight_decay);
  c.lerp_w = static_cast<float>(1.0 - beta1);
  c.lerp_w1 = c.lerp_w - 1.0f;
  c.lerp_small = std::abs(c.lerp_w) < 0.5f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.neg_step = static_cast<float>(-(lr / bc1));
  c.eps = static_cast<float>(eps);
  const Isa& isa = isas()[g_isa.load()];
  const lzo::AdamFn fn = moment == lzo::kMomF32 ? isa.adam : isa.compact;
  py::gil_scoped_release no_gil;
  // Thread chunks (kChunk) are whole 8-bit blocks, so every block is updated by one thread.
  static_assert(kChunk % lzo::kBlock == 0, "thread chunks must hold whole blocks");
  parallel_for(n, num_threads, [&](int64_t b, int64_t e) { fn(a, b, e); }, torch_pool);
}

// One fused Lion step (see LionArgs); the checks as fused_adamw's.
void fused_lion(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg,
                c10::optional<torch::Tensor> out, double lr, double beta1, double beta2,
                double decay, double grad_scale, int64_t num_threads,
                c10::optional<torch::Tensor> exp_avg_scales, int64_t key, int64_t offset,
                bool torch_pool) {
  const int64_t n = param.numel();
  lzo::LionArgs a{};
  bind_common(a, param, grad, out, key, offset);
  const lzo::Moment moment = moment_of(exp_avg, exp_avg);
  check(exp_avg, "exp_avg", n);
  a.moment = moment;
  a.m = exp_avg.data_ptr();
  const bool q8 = moment == lzo::kMomQ8;
  TORCH_CHECK(q8 == exp_avg_scales.has_value(), "scales are given exactly for uint8 moments");
  if (q8) {
    TORCH_CHECK(offset % lzo::kBlock == 0, "offset must be a multiple of ", lzo::kBlock);
    TORCH_CHECK(exp_avg_scales->scalar_type() == torch::kFloat, "scales must be float32");
    check(*exp_avg_scales, "scales", (n + lzo::kBlock - 1) / lzo::kBlock);
    a.m_scale = exp_avg_scales->data_ptr<float>();
  }
  // Python floats rounded to float where they meet a float32 tensor, as in lion_pytorch.
  a.c = {static_cast<float>(grad_scale), static_cast<float>(decay), static_cast<float>(beta1),
         static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
         static_cast<float>(1.0 - beta2), static_cast<float>(-lr)};
  const lzo::LionFn fn = isas()[g_isa.load()].lion;
  py::gil_scoped_release no_gil;
  parallel_for(n, num_threads, [&](int64_t b, int64_t e) { fn(a, b, e); }, torch_pool);
}

// Streaming-bandwidth probe (see ProbeArgs): a, b, c fp32 += g * scale in place, g bf16 read,
// out bf16 written. The machine's ceiling for the fused step's access pattern.
void stream_probe(torch::Tensor a, torch::Tensor b, c10::optional<torch::Tensor> c,
                  torch::Tensor g, torch::Tensor out, double scale, int64_t num_threads,
                  bool torch_pool) {
  const int64_t n = a.numel();
  for (auto* t : {&a, &b}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat, "probe: a, b, c must be float32");
  }
  TORCH_CHECK(g.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "probe: g and out must be bfloat16");
  for (auto* t : {&a, &b, &g, &out}) check(*t, "probe argument", n);
  float* c_ptr = nullptr;
  if (c.has_value()) {
    TORCH_CHECK(c->scalar_type() == torch::kFloat, "probe: a, b, c must be float32");
    check(*c, "probe argument", n);
    c_ptr = c->data_ptr<float>();
  }
  const lzo::ProbeArgs p{a.data_ptr<float>(), b.data_ptr<float>(), c_ptr,
                         reinterpret_cast<const uint16_t*>(g.data_ptr()),
                         reinterpret_cast<uint16_t*>(out.data_ptr()), static_cast<float>(scale)};
  const lzo::ProbeFn fn = isas()[g_isa.load()].probe;
  py::gil_scoped_release no_gil;
  parallel_for(n, num_threads, [&](int64_t lo, int64_t hi) { fn(p, lo, hi); }, torch_pool);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning-zero-offload fused CPU AdamW and Lion kernels";
  m.def("fused_adamw", &fused_adamw, "One fused AdamW/Adam step over flat CPU tensors");
  m.def("fused_lion", &fused_lion, "One fused Lion step over flat CPU tensors");
  m.def("stream_probe", &stream_probe, "Streaming-bandwidth probe with the step's access pattern");
  m.def("torch_pool_available", &torch_pool_available,
        "Whether the kernel can run on torch's intra-op (OpenMP) pool");
  m.def("block_size", [] { return lzo::kBlock; }, "Elements per 8-bit block (one scale each)");
  m.def("available_isas", &available_isas, "SIMD paths this CPU supports, best first");
  m.def("get_isa", &get_isa, "The SIMD path in use");
  m.def("set_isa", &set_isa, "Force a SIMD path (one of available_isas())");
}
