// ktcore shared C++: expert LoRA inside a native backend, computed in the tasks of its own thread pool.
//
// A projection with LoRA adds, for each row r routed to expert e (PEFT's layout, see ktcore/experts.py),
//     out_r += scale * B_e (A_e in_r),        A [E, rank, in], B [E, out, rank].
// Both factors are read rank-major, A_e as [rank, in] and B_e as [rank, out] (a Factor's strides say where each
// element is), which makes the four products of forward and backward two operations:
//   forward    q_r = A_e in_r                      rank_rows on A, a prologue over each expert's rows
//              out_r[cols] += scale * B_e[:, cols]^T q_r         expand_rows on B, in each output block's epilogue
//   backward   (g_r = dL/dout_r)
//              p_r = B_e g_r                       rank_rows on B
//              dL/din_r[cols] += scale * A_e[:, cols]^T p_r      expand_rows on A
//              dA_e[:, cols] = scale * sum_r p_r x in_r[cols]    grad_columns
//              dB_e[:, cols] = scale * sum_r q_r x g_r[cols]     grad_columns (row weights where g excludes them)
// Every sum runs over an expert's rows in row order inside one task, so the results do not depend on the threads.
// Arithmetic is fp32 (Leaves, from the backend's kernel table); factors and gradients are fp32 or bf16.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "ktcore/expert_lora_leaves.hpp"

namespace ktcore {
namespace lora {

// One factor of every expert: element (e, rank k, column j) at p + e * s_expert + k * s_rank + j * s_col (elements).
struct Factor {
  uintptr_t p = 0;
  bool bf16 = false;
  int64_t s_expert = 0, s_rank = 0, s_col = 0;

  // element (e, 0, j)
  const void* at(int64_t e, int64_t j) const {
    return reinterpret_cast<const char*>(p) + (e * s_expert + j * s_col) * (bf16 ? 2 : 4);
  }
  void* at_mut(int64_t e, int64_t j) const { return const_cast<void*>(at(e, j)); }
};

// One projection's LoRA (A, B rank-major) and where its gradients go (grad_a, grad_b: the layouts of a, b).
struct Projection {
  Factor a, b, grad_a, grad_b;
  int rank = 0;
  float scale = 1.f;
};

// A thread's fp32 scratch, grown to the largest request and kept.
class Scratch {
 public:
  float* block(int64_t n) { return grow(block_, n); }

 private:
  static float* grow(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
  std::vector<float> block_;
};

// Rows of one expert per task of the prologue: each task first makes an fp32 copy of the expert's factor where it is
// bf16 or strided (rank_rows).
constexpr int64_t kRankRows = 64;

// The prologue's tasks: (expert, first row, end row), up to kRankRows rows of one expert each (off: expert offsets).
inline std::vector<std::array<int64_t, 3>> rank_tasks(const int64_t* off, int64_t E) {
  std::vector<std::array<int64_t, 3>> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; r += kRankRows) tasks.push_back({e, r, std::min(off[e + 1], r + kRankRows)});
  return tasks;
}

// Columns of one task of a gradient phase (grad_tasks): each task passes once over its expert's rows, so wide tasks
// (few passes over the rows), yet enough of them to spread over the threads (2048 columns: 8 per expert).
constexpr int64_t kGradColumns = 256;

// A gradient phase's tasks over n columns of every expert's factor: (expert, first column), kGradColumns each. An
// expert without rows gets one task for all its columns, which writes its zeros (so the gradient buffers need not
// be zeroed first).
inline std::vector<std::array<int64_t, 3>> grad_tasks(const int64_t* off, int64_t E, int64_t n) {
  std::vector<std::array<int64_t, 3>> tasks;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t step = off[e + 1] > off[e] ? kGradColumns : n;
    for (int64_t c = 0; c < n; c += step) tasks.push_back({e, c, std::min(step, n - c)});
  }
  return tasks;
}

// Whether a factor's rank rows are fp32 with contiguous columns, readable in place (A's layout); others are copied
// into fp32 rows first.
inline bool in_place(const Factor& f) { return !f.bf16 && f.s_col == 1; }

// Element (bytes) size of a fp32 or bf16 row.
inline int64_t elem_bytes(bool bf16) { return bf16 ? 2 : 4; }

// q[r * rank + k] (+)= sum over j < n of F_e[k, c0 + j] * src_r[j], rows r0 <= r < r1; src_r is row rows[r] (rows
// null: row r) of src (lds elements apart, fp32 or bf16).
inline void rank_rows(const Leaves& L, const Factor& f, int rank, int64_t e, int64_t c0, int64_t n, const void* src,
                      bool src_bf16, int64_t lds, const int32_t* rows, int64_t r0, int64_t r1, float* q,
                      bool accumulate, Scratch& s) {
  const float* fb = static_cast<const float*>(f.at(e, c0));
  int64_t ldf = f.s_rank;
  if (!in_place(f)) {  // an fp32 copy with contiguous rows
    float* b = s.block(rank * n);
    L.block(f.at(e, c0), f.bf16, f.s_rank, f.s_col, rank, n, b, n);
    fb = b;
    ldf = n;
  }
  const char* first = static_cast<const char*>(src) + (rows ? 0 : r0 * lds * elem_bytes(src_bf16));
  L.rank_dot(fb, ldf, rank, first, src_bf16, lds, rows ? rows + r0 : nullptr, r1 - r0, n, q + r0 * rank, accumulate);
}

// out[i * ldo + j] += scale * sum over k of F_e[k, c0 + j] * q[(r0 + i) * rank + k], i < m, j < nc.
inline void expand_rows(const Leaves& L, const Factor& f, int rank, float scale, int64_t e, int64_t c0, int64_t nc,
                        const float* q, int64_t r0, int64_t m, float* out, int64_t ldo, Scratch& s) {
  if (nc <= 0 || m <= 0) return;
  if (in_place(f)) {
    L.expand(static_cast<const float*>(f.at(e, c0)), f.s_rank, rank, nc, q + r0 * rank, rank, m, scale, out, ldo);
    return;
  }
  float* b = s.block(rank * nc);
  L.block(f.at(e, c0), f.bf16, f.s_rank, f.s_col, rank, nc, b, nc);
  L.expand(b, nc, rank, nc, q + r0 * rank, rank, m, scale, out, ldo);
}

// grad_e[k, c0 + j] = scale * sum over rows r0 <= r < r1, in order, of wt[r] * u[r * rank + k] * v_r[j], j < nc;
// v_r is row rows[r] (rows null: row r) of v (ldv elements apart, fp32 or bf16); wt null: weight 1.
inline void grad_columns(const Leaves& L, const Factor& grad, int rank, float scale, int64_t e, int64_t c0,
                         int64_t nc, const float* u, const float* wt, const void* v, bool v_bf16, int64_t ldv,
                         const int32_t* rows, int64_t r0, int64_t r1, Scratch& s) {
  if (nc <= 0) return;
  float* acc = s.block(rank * nc);
  std::fill(acc, acc + rank * nc, 0.f);
  const char* v0 = static_cast<const char*>(v) + (rows ? 0 : r0 * ldv) * elem_bytes(v_bf16);
  L.outer(u + r0 * rank, rank, wt ? wt + r0 : nullptr, rank, v0, v_bf16, ldv, rows ? rows + r0 : nullptr, r1 - r0,
          nc, acc, nc);
  L.store(acc, nc, scale, rank, nc, grad.at_mut(e, c0), grad.bf16, grad.s_rank, grad.s_col);
}

// The prologue as a phase of its own on `sched` (a PoolGroup whose run_tasks spreads tasks over its pools, with a
// lora_scratch per thread), timed as `label` on its phase clock: q[r] = F_e src_r for every row r of every expert,
// rank_tasks' tasks.
template <class Sched>
void rank_phase(Sched& sched, const char* label, const Leaves& L, const int64_t* off, int64_t E, const Factor& f,
                int rank, int64_t n, const void* src, bool src_bf16, int64_t lds, const int32_t* rows, float* q) {
  const auto span = sched.phase_clock().span(label);
  const std::vector<std::array<int64_t, 3>> tasks = rank_tasks(off, E);
  sched.run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i, int pool, int tid) {
    const auto& t = tasks[i];
    rank_rows(L, f, rank, t[0], 0, n, src, src_bf16, lds, rows, t[1], t[2], q, false, sched.lora_scratch(pool, tid));
  });
}

// The gradients as a phase of their own on `sched`, after the backward GEMM's, timed as `label`: grad[e][:, c] =
// scale * sum_r u_r (w_r) v_r[c] for c < n (grad_columns), grad_tasks' tasks; v: rows[r] (rows null: row r) of a
// fp32 or bf16 matrix, ldv elements apart.
template <class Sched>
void grad_phase(Sched& sched, const char* label, const Leaves& L, const int64_t* off, int64_t E, const Factor& grad,
                int rank, float scale, int64_t n, const float* u, const float* w, const void* v, bool v_bf16,
                int64_t ldv, const int32_t* rows) {
  const auto span = sched.phase_clock().span(label);
  const std::vector<std::array<int64_t, 3>> tasks = grad_tasks(off, E, n);
  sched.run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i, int pool, int tid) {
    const auto [e, c0, nc] = tasks[i];
    const char* v0 = static_cast<const char*>(v) + c0 * elem_bytes(v_bf16);
    grad_columns(L, grad, rank, scale, e, c0, nc, u, w, v0, v_bf16, ldv, rows, off[e], off[e + 1],
                 sched.lora_scratch(pool, tid));
  });
}

// A backend's two projections' gradients, each a pair of gradient phases after the backward GEMMs (the engines run
// them apart from the GEMMs so the input gradient can leave first). Down (in = I, out = H): dA = scale * sum_r w_r
// qd_r h_r^T, dB = scale * sum_r w_r gy_r ah_r^T, where qd = B^T gy (the prologue), ah = A h (the forward's), h the
// activation rows (ldh apart, fp32 or bf16), gy the output gradient's token rows tok[r] (gy_stride apart).
template <class Sched>
void down_grads(Sched& sched, const Leaves& L, const int64_t* off, int64_t E, int64_t H, int64_t I,
                const Projection& lora, const float* qd, const float* w_row, const void* h, bool h_bf16, int64_t ldh,
                const float* ah, const void* gy, bool gy_bf16, int64_t gy_stride, const int32_t* tok) {
  grad_phase(sched, "bwd down: lora dA", L, off, E, lora.grad_a, lora.rank, lora.scale, I, qd, w_row, h, h_bf16, ldh,
             nullptr);
  grad_phase(sched, "bwd down: lora dB", L, off, E, lora.grad_b, lora.rank, lora.scale, H, ah, w_row, gy, gy_bf16,
             gy_stride, tok);
}

// Gate/up (in = H, out = 2I): dA = scale * sum_r qg_r x_r^T, dB = scale * sum_r g_r ax_r^T, where qg = B^T g (the
// prologue), ax = A x (the forward's), x the token rows tok[r] (x_stride apart), g the rows of the gate and up
// gradients [R, 2I] (fp32 or bf16), routing weights in.
template <class Sched>
void gate_up_grads(Sched& sched, const Leaves& L, const int64_t* off, int64_t E, int64_t H, int64_t I,
                   const Projection& lora, const float* qg, const void* x, bool x_bf16, int64_t x_stride,
                   const int32_t* tok, const float* ax, const void* g, bool g_bf16) {
  grad_phase(sched, "bwd gate_up: lora dA", L, off, E, lora.grad_a, lora.rank, lora.scale, H, qg, nullptr, x, x_bf16,
             x_stride, tok);
  grad_phase(sched, "bwd gate_up: lora dB", L, off, E, lora.grad_b, lora.rank, lora.scale, 2 * I, ax, nullptr, g,
             g_bf16, 2 * I, nullptr);
}

}  // namespace lora
}  // namespace ktcore
