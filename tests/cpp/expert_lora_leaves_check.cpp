// Checks of ktcore/include/ktcore/expert_lora.hpp on the leaf routines of expert_lora_leaves.inc, built by
// tests/test_expert_lora_leaves.py once per instruction set this CPU runs: every function against a float64 loop
// written here, at ragged sizes (ranks 1..11, rows and columns that are not multiples of any vector width, fp32 and
// bf16 operands, rows picked through an index, strided factors), and that a gradient's bits do not depend on how its
// columns are split among calls. Prints one line per failed check, then a hash of
// every result (with -ffp-contract=off the leaves promise the same bits on every instruction set), and exits 1 if a
// check failed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ktcore/expert_lora.hpp"

namespace check {
#include "ktcore/expert_lora_leaves.inc"
}

namespace lora = ktcore::lora;

static int failures = 0;
static uint64_t hash = 1469598103934665603ull;
static std::mt19937 rng(7);

static void mix(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    __builtin_memcpy(&b, p + i, 4);
    hash = (hash ^ b) * 1099511628211ull;
  }
}

static float bf16_round(float f) { return check::lora_bf16_to_f32(check::lora_f32_to_bf16(f)); }

// Values of a buffer of fp32 or bf16 elements: random, and what they hold as fp32.
struct Buf {
  std::vector<float> f;
  std::vector<uint16_t> h;
  bool bf16;
  Buf(int64_t n, bool b) : f(n), h(b ? n : 0), bf16(b) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) {
      f[i] = bf16 ? bf16_round(nd(rng)) : nd(rng);
      if (bf16) h[i] = check::lora_f32_to_bf16(f[i]);
    }
  }
  const void* p() const { return bf16 ? static_cast<const void*>(h.data()) : f.data(); }
  uintptr_t addr() const { return reinterpret_cast<uintptr_t>(p()); }
};

// |got - want| <= tol * (sum of |terms|) for each element (a float sum's error bound, about n * 2^-24 of it).
static void near(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& mag, int rank, int64_t m, int64_t n) {
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 1e-6 * mag[i] + 1e-30)) {
      std::printf("FAIL: %s rank %d m %lld n %lld element %zu: %.9g, want %.9g\n", what, rank, (long long)m,
                  (long long)n, i, got[i], want[i]);
      ++failures;
      return;
    }
}

int main() {
  const lora::Leaves& L = check::lora_leaves;
  lora::Scratch s;
  const int ranks[] = {1, 2, 3, 8, 9, 11};
  const int64_t row_counts[] = {1, 2, 3, 17, 70};
  const int64_t widths[] = {1, 5, 16, 33, 67, 130};
  for (const bool bf16 : {false, true})
    for (const int rank : ranks)
      for (const int64_t m : row_counts)
        for (const int64_t n : widths) {
          const int64_t E = 2, e = 1, T = m + 3, ld = n + 3;
          std::vector<int32_t> rows(m);
          for (int64_t i = 0; i < m; ++i) rows[i] = static_cast<int32_t>((i * 5 + 2) % T);
          // factor in PEFT's B layout [E, n, rank] read rank-major (strided), activations [T, ld], row weights
          Buf fac(E * n * rank, bf16), act(T * ld, bf16), wt(m, false);
          lora::Factor f;
          f.p = fac.addr(), f.bf16 = bf16, f.s_expert = n * rank, f.s_rank = 1, f.s_col = rank;
          auto F = [&](int k, int64_t j) { return double(fac.f[e * n * rank + j * rank + k]); };
          auto X = [&](int64_t i, int64_t j) { return double(act.f[rows[i] * ld + j]); };

          // rank_rows: q[i, k] = sum_j F[k, j] x_i[j]
          std::vector<float> q(m * rank);
          lora::rank_rows(L, f, rank, e, 0, n, act.p(), bf16, ld, rows.data(), 0, m, q.data(), false, s);
          std::vector<double> want(m * rank), mag(m * rank);
          for (int64_t i = 0; i < m; ++i)
            for (int k = 0; k < rank; ++k)
              for (int64_t j = 0; j < n; ++j) {
                want[i * rank + k] += F(k, j) * X(i, j);
                mag[i * rank + k] += std::fabs(F(k, j) * X(i, j));
              }
          near("rank_rows", q, want, mag, rank, m, n);
          mix(q.data(), q.size());

          // expand_rows: out[i, j] += scale * sum_k F[k, j] q[i, k] on columns 0..n of an out with ld columns
          std::vector<float> out(m * ld, 0.5f);
          lora::expand_rows(L, f, rank, 1.5f, e, 0, n, q.data(), 0, m, out.data(), ld, s);
          std::vector<float> got(m * n);
          want.assign(m * n, 0.0), mag.assign(m * n, 0.0);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              got[i * n + j] = out[i * ld + j];
              double acc = 0, a = 0;
              for (int k = 0; k < rank; ++k) acc += F(k, j) * q[i * rank + k], a += std::fabs(F(k, j) * q[i * rank + k]);
              want[i * n + j] = 0.5 + 1.5 * acc;
              mag[i * n + j] = 0.5 + 1.5 * a;
            }
          near("expand_rows", got, want, mag, rank, m, n);
          for (int64_t i = 0; i < m; ++i)  // the columns past n are left alone
            for (int64_t j = n; j < ld; ++j)
              if (out[i * ld + j] != 0.5f) {
                std::printf("FAIL: expand_rows wrote column %lld of %lld\n", (long long)j, (long long)n);
                ++failures;
              }
          mix(got.data(), got.size());

          // grad_columns: grad[k, j] = scale * sum_i wt[i] q[i, k] x_i[j], into a gradient in the factor's layout
          // (bf16 gradients are rounded once, at the end)
          Buf grad(E * n * rank, bf16);
          lora::Factor g = f;
          g.p = grad.addr();
          lora::grad_columns(L, g, rank, 0.75f, e, 0, n, q.data(), wt.f.data(), act.p(), bf16, ld, rows.data(), 0, m, s);
          got.assign(rank * n, 0.f), want.assign(rank * n, 0.0), mag.assign(rank * n, 0.0);
          for (int k = 0; k < rank; ++k)
            for (int64_t j = 0; j < n; ++j) {
              const int64_t at = e * n * rank + j * rank + k;
              got[k * n + j] = bf16 ? check::lora_bf16_to_f32(grad.h[at]) : grad.f[at];
              for (int64_t i = 0; i < m; ++i) {
                const double t = 0.75 * double(float(wt.f[i] * q[i * rank + k])) * X(i, j);
                want[k * n + j] += t;
                mag[k * n + j] += std::fabs(t);
              }
              if (bf16) mag[k * n + j] += std::fabs(want[k * n + j]) * 4e3;  // one bf16 rounding: up to 2^-8 relative
            }
          near("grad_columns", got, want, mag, rank, m, n);
          mix(got.data(), got.size());

          // the same gradient from calls over pieces of the columns (the engines hand each task a piece, whose
          // bounds move with the thread count): every element's bits as from the one call over all of them
          const std::vector<std::vector<int64_t>> splits = {{16, 32, 48, 64, 80, 96, 112, 128}, {5, 37, 48}, {17}};
          const int64_t es = bf16 ? 2 : 4, at = e * n * rank * es;  // element bytes; expert e's part (the rest: random)
          for (const auto& cuts : splits) {
            Buf pieces(E * n * rank, bf16);
            g.p = pieces.addr();
            int64_t c0 = 0;
            for (size_t p = 0; p <= cuts.size() && c0 < n; ++p) {
              const int64_t c1 = p < cuts.size() && cuts[p] < n ? cuts[p] : n;
              lora::grad_columns(L, g, rank, 0.75f, e, c0, c1 - c0, q.data(), wt.f.data(),
                                 static_cast<const char*>(act.p()) + c0 * es, bf16, ld, rows.data(), 0, m, s);
              c0 = c1;
            }
            if (std::memcmp(static_cast<const char*>(grad.p()) + at, static_cast<const char*>(pieces.p()) + at,
                            n * rank * es) != 0) {
              std::printf("FAIL: grad_columns in pieces (cuts from %lld) is not one call's, rank %d m %lld n %lld\n",
                          (long long)cuts[0], rank, (long long)m, (long long)n);
              ++failures;
            }
          }
        }
  std::printf("hash %016llx\n", (unsigned long long)hash);
  if (failures) return 1;
  std::printf("expert lora leaf checks passed\n");
  return 0;
}
