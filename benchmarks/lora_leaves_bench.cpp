// The expert-LoRA work of one amx_bf16 layer call, alone: ktcore/include/ktcore/expert_lora.hpp's functions on
// the leaf routines of expert_lora_leaves.inc, called with the sizes and in the pattern of backends/amx_bf16's
// engine (per expert: the prologue over its rows, the epilogue per output block, the gradients per unit), on one
// thread, without the frozen projections. Built and run by benchmarks/bench_lora_leaves.py with the ISA flags of
// the backend's kernel file; prints one line per phase: name, milliseconds of thread CPU time (median of the repetitions).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <ctime>
#include <vector>

#include "ktcore/expert_lora.hpp"

namespace bench {
#include "ktcore/expert_lora_leaves.inc"
}

namespace lora = ktcore::lora;

// CPU time of this thread: on a machine shared with other jobs it counts only the time this thread ran.
static double thread_ms() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static uint16_t to_bf16(float f) { return bench::lora_f32_to_bf16(f); }

int main(int argc, char** argv) {
  // E K H I tokens rank reps
  const int64_t E = argc > 1 ? std::atoll(argv[1]) : 128, K = argc > 2 ? std::atoll(argv[2]) : 8;
  const int64_t H = argc > 3 ? std::atoll(argv[3]) : 2048, I = argc > 4 ? std::atoll(argv[4]) : 768;
  const int64_t T = argc > 5 ? std::atoll(argv[5]) : 512;
  const int rank = argc > 6 ? std::atoi(argv[6]) : 8;
  const int reps = argc > 7 ? std::atoi(argv[7]) : 5;
  const lora::Leaves& L = bench::lora_leaves;

  // Routing: every token to K distinct experts, rows sorted by expert (as Engine::route leaves them).
  std::mt19937 rng(0);
  std::vector<std::vector<int32_t>> rows_of(E);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> ids(E);
    for (int64_t e = 0; e < E; ++e) ids[e] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t k = 0; k < K; ++k) rows_of[ids[k]].push_back(static_cast<int32_t>(t));
  }
  std::vector<int64_t> off(E + 1, 0);
  std::vector<int32_t> tok;
  for (int64_t e = 0; e < E; ++e) {
    off[e + 1] = off[e] + static_cast<int64_t>(rows_of[e].size());
    tok.insert(tok.end(), rows_of[e].begin(), rows_of[e].end());
  }
  const int64_t R = off[E];

  std::normal_distribution<float> nd(0.f, 1.f);
  auto fp32 = [&](int64_t n, float s) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng) * s;
    return v;
  };
  auto bf16 = [&](int64_t n, float s) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = to_bf16(nd(rng) * s);
    return v;
  };
  // activations as the engine holds them: x, gy [T, H] bf16 token rows; h [R, ldh] bf16; ggu_rows [R, 2I] bf16
  const int64_t ldh = I % 1024 == 0 ? I + 32 : I;
  std::vector<uint16_t> x = bf16(T * H, 1.f), gy = bf16(T * H, 1.f), h = bf16(R * ldh, 1.f);
  std::vector<uint16_t> ggu_rows = bf16(R * 2 * I, 1.f);
  std::vector<float> w_row = fp32(R, 0.3f);
  // PEFT's layout, fp32: A [E, r, in], B [E, out, r]; gradients alike
  std::vector<float> a_gu = fp32(E * rank * H, 0.02f), b_gu = fp32(E * 2 * I * rank, 0.01f);
  std::vector<float> a_dn = fp32(E * rank * I, 0.03f), b_dn = fp32(E * H * rank, 0.01f);
  std::vector<float> ga_gu(a_gu.size()), gb_gu(b_gu.size()), ga_dn(a_dn.size()), gb_dn(b_dn.size());
  auto A = [&](std::vector<float>& v, int64_t in) {
    lora::Factor f;
    f.p = reinterpret_cast<uintptr_t>(v.data());
    f.s_expert = rank * in, f.s_rank = in, f.s_col = 1;
    return f;
  };
  auto B = [&](std::vector<float>& v, int64_t out) {
    lora::Factor f;
    f.p = reinterpret_cast<uintptr_t>(v.data());
    f.s_expert = out * rank, f.s_rank = 1, f.s_col = rank;
    return f;
  };
  lora::Projection gu{A(a_gu, H), B(b_gu, 2 * I), A(ga_gu, H), B(gb_gu, 2 * I), rank, 2.f};
  lora::Projection dn{A(a_dn, I), B(b_dn, H), A(ga_dn, I), B(gb_dn, H), rank, 2.f};
  std::vector<float> ax(R * rank), ah(R * rank), qd(R * rank), qg(R * rank);
  std::vector<float> C(256 * 32);  // an output block's sums, 32 columns (the engine's C scratch)
  lora::Scratch s;
  const auto tasks = lora::rank_tasks(off.data(), E);

  auto prologue = [&](const lora::Factor& f, int64_t n, const void* src, bool src_bf16, int64_t lds,
                      const int32_t* rows, float* q) {
    for (const auto& t : tasks) lora::rank_rows(L, f, rank, t[0], 0, n, src, src_bf16, lds, rows, t[1], t[2], q, false, s);
  };
  // epilogue of every output block: ncols-wide blocks at column offsets c0 + b * width, C ld 32
  auto epilogue = [&](const lora::Projection& p, const lora::Factor& f, int64_t c_base, int64_t n, int64_t width,
                      const float* q) {
    std::fill(C.begin(), C.end(), 0.f);  // the same sums on every repetition (the hash sees the last block's)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < n; c += width) {
        const int64_t m = off[e + 1] - off[e];
        for (int64_t m0 = 0; m0 < m; m0 += 256)
          lora::expand_rows(L, f, rank, p.scale, e, c_base + c, std::min(width, n - c), q, off[e] + m0,
                            std::min<int64_t>(256, m - m0), C.data(), 32, s);
      }
  };

  // the engines' gradient phase (lora::grad_tasks), its tasks in turn; v: bf16 rows
  auto grads = [&](const lora::Factor& grad, float scale, int64_t n, const float* u, const float* wt,
                   const uint16_t* v, int64_t ldv, const int32_t* rows) {
    for (const auto& [e, c0, nc] : lora::grad_tasks(off.data(), E, n))
      lora::grad_columns(L, grad, rank, scale, e, c0, nc, u, wt, v + c0, true, ldv, rows, off[e], off[e + 1], s);
  };

  struct Phase {
    const char* name;
    std::function<void()> run;
  };
  const std::vector<Phase> phases = {
      {"fwd gate_up: q = A x (prologue)", [&] { prologue(gu.a, H, x.data(), true, H, tok.data(), ax.data()); }},
      {"fwd gate_up: + s B q (epilogue)", [&] {
         epilogue(gu, gu.b, 0, I, 16, ax.data());
         epilogue(gu, gu.b, I, I, 16, ax.data());
       }},
      {"fwd down: q = A h (prologue)", [&] { prologue(dn.a, I, h.data(), true, ldh, nullptr, ah.data()); }},
      {"fwd down: + s B q (epilogue)", [&] { epilogue(dn, dn.b, 0, H, 32, ah.data()); }},
      {"bwd down: p = B^T g (prologue)", [&] { prologue(dn.b, H, gy.data(), true, H, tok.data(), qd.data()); }},
      {"bwd down: + s A^T p (epilogue)", [&] { epilogue(dn, dn.a, 0, I, 32, qd.data()); }},
      {"bwd down: dA, dB", [&] {
         grads(dn.grad_a, dn.scale, I, qd.data(), w_row.data(), h.data(), ldh, nullptr);
         grads(dn.grad_b, dn.scale, H, ah.data(), w_row.data(), gy.data(), H, tok.data());
       }},
      {"bwd gate_up: p = B^T g (prologue)",
       [&] { prologue(gu.b, 2 * I, ggu_rows.data(), true, 2 * I, nullptr, qg.data()); }},
      {"bwd gate_up: + s A^T p (epilogue)", [&] { epilogue(gu, gu.a, 0, H, 32, qg.data()); }},
      {"bwd gate_up: dA, dB", [&] {
         grads(gu.grad_a, gu.scale, H, qg.data(), nullptr, x.data(), H, tok.data());
         grads(gu.grad_b, gu.scale, 2 * I, ax.data(), nullptr, ggu_rows.data(), 2 * I, nullptr);
       }},
  };
  std::printf("E=%lld K=%lld H=%lld I=%lld tokens=%lld rank=%d rows=%lld, one thread, median of %d\n", (long long)E,
              (long long)K, (long long)H, (long long)I, (long long)T, rank, (long long)R, reps);
  double fwd = 0, bwd = 0;
  for (const Phase& ph : phases) {
    ph.run();  // warm-up
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
      const double t0 = thread_ms();
      ph.run();
      ms.push_back(thread_ms() - t0);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    (ph.name[0] == 'f' ? fwd : bwd) += med;
    std::printf("%s\t%.2f\n", ph.name, med);
  }
  std::printf("forward total\t%.2f\nbackward total\t%.2f\n", fwd, bwd);
  // FNV-1a of every result, to tell a change that keeps the bits from one that does not
  uint64_t hash = 1469598103934665603ull;
  for (const std::vector<float>* v : {&ax, &ah, &qd, &qg, &ga_gu, &gb_gu, &ga_dn, &gb_dn, &C})
    for (const float f : *v) {
      uint32_t b;
      __builtin_memcpy(&b, &f, 4);
      hash = (hash ^ b) * 1099511628211ull;
    }
  std::printf("results hash\t%016llx\n", (unsigned long long)hash);
  return 0;
}
