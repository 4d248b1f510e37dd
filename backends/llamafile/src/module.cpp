// ktcore_llamafile._ext: GGUF-block expert kernels behind a torch-free pybind11 boundary.
// Tensors cross as addresses and sizes; every buffer is owned by the Python caller.
//
//   Engine(threads, isa)                       isa: "auto" | "vnni" | "avx2" | "scalar"
//   Engine.quantize_act(...)                   fp32 rows -> per-32 int8 blocks (scale, scale * sum)
//   Engine.quantize_act16(...)                 fp32 rows -> per-32 int16 blocks (scale, scale * sum)
//   Engine.matmul(...)                         out[r, n] = W_e[n, :] . x[r, :] for the rows r routed to expert e
//   Engine.matmul16(...)                       the same on int16 activations (expanded int16 weights, tiles)
//   Engine.forward16(Layer, ...)               a whole no-LoRA SiLU forward on int16 activations in one call
//   Engine.route(...)                          the routed slots sorted by expert (offsets, order, token, weight)
//   Engine.combine(...)                        y[t] = sum_k w * out[row of slot (t, k)] (the forward's last step)
//   Engine.matmul_t(...)                       out[r, :] += sum_n g[r, n] * W_e[n, :]  (transposed, from the blocks)
//   Engine.lora_rank(...)                      expert LoRA's prologue q_r = F_e src_r (ktcore/expert_lora.hpp); the
//                                              matmuls, forward16 and matmul_t take a LoraProjection for the rest
//   dequantize / quantize / type_info          block helpers (tests, pack, ktcore convert)
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "blocks.hpp"
#include "kernels.hpp"
#include "ktcore/expert_lora.hpp"
#include "ktcore/expert_lora_binding.hpp"
#include "ktcore/thread_pool.hpp"

namespace py = pybind11;
namespace lora = ktcore::lora;
using namespace ktl;

namespace {

bool cpu_has(const char* what) {
  __builtin_cpu_init();
  std::string w(what);
  if (w == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  if (w == "vnni") return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return false;
}

// The one run-time ISA dispatch point.
const Kernels& select_kernels(const std::string& isa) {
  if (isa == "auto") return cpu_has("vnni") ? vnni_kernels() : cpu_has("avx2") ? avx2_kernels() : scalar_kernels();
  if (isa == "scalar") return scalar_kernels();
  if (isa == "avx2" || isa == "vnni") {
    if (!cpu_has(isa.c_str())) throw std::runtime_error("this CPU cannot run the " + isa + " kernels");
    return isa == "avx2" ? avx2_kernels() : vnni_kernels();
  }
  throw std::invalid_argument("isa must be auto, vnni, avx2 or scalar, not " + isa);
}

template <class T>
T* P(uintptr_t a) { return reinterpret_cast<T*>(a); }

int nc8_of(int kp) { return (kp / 32 + 7) / 8 * 8; }

struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> f;
  std::vector<int16_t> w16;
  std::vector<float> f16;
  lora::Scratch lora;
  void need16(int64_t kp, int64_t nc8, int rows) {
    if ((int64_t)w16.size() < rows * kp) w16.resize(rows * kp);
    if ((int64_t)f16.size() < rows * 3 * nc8) f16.resize(rows * 3 * nc8);
    if ((int64_t)q.size() < kp) q.resize(kp);
  }
  void need(int64_t kp) {
    if ((int64_t)q.size() < kp) q.resize(kp);
    if ((int64_t)f.size() < kp + 3 * (kp / 32 + 1)) f.resize(kp + 3 * (kp / 32 + 1));
  }
};

// One projection of every expert: E matrices of n rows of GGUF blocks (kp elements per row, zero padded).
struct Proj {
  int qtype;
  TypeInfo info;
  const uint8_t* w;
  int64_t expert_stride, row_bytes;
  int n, kp;
  static Proj of(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int n, int kp) {
    return Proj{qtype, type_info(qtype), P<uint8_t>(w), expert_stride, row_bytes, n, kp};
  }
};

// A layer's gate [E, I, H], up [E, I, H] and down [E, H, I] blocks (Python keeps the memory alive).
struct Layer {
  Proj gate, up, down;
  int E, H, I;
};

// q16 activations of R rows (quantize_act16): q int16 [R, kp], d and m fp32 [R, nc8].
struct Acts16 {
  int16_t* q;
  float* d;
  float* m;
  int kp, nc8;
};

// Acts16 with its own storage, grown as needed and kept between calls.
struct Acts16Buffer {
  std::vector<int16_t> qs;
  std::vector<float> ds, ms;
  Acts16 acts{};
  int64_t rows = 0;
  void resize(int64_t R, int kp) {
    const int nc8 = nc8_of(kp);
    if ((int64_t)qs.size() < R * kp) qs.resize(R * kp);
    if ((int64_t)ds.size() < R * nc8) { ds.resize(R * nc8); ms.resize(R * nc8); }
    acts = Acts16{qs.data(), ds.data(), ms.data(), kp, nc8};
    rows = R;
  }
  // columns c0.. of every row (and their scale chunks) zero: the padding past a row's real length
  void zero_columns_from(int c0) {
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(acts.q + r * acts.kp + c0, acts.q + (r + 1) * acts.kp, 0);
      std::fill(acts.d + r * acts.nc8 + c0 / 32, acts.d + (r + 1) * acts.nc8, 0.f);
      std::fill(acts.m + r * acts.nc8 + c0 / 32, acts.m + (r + 1) * acts.nc8, 0.f);
    }
  }
  uintptr_t q_addr() const { return reinterpret_cast<uintptr_t>(acts.q); }
  uintptr_t d_addr() const { return reinterpret_cast<uintptr_t>(acts.d); }
  uintptr_t m_addr() const { return reinterpret_cast<uintptr_t>(acts.m); }
};

// forward16's working buffers
struct Fwd16 {
  Acts16Buffer xg, xu, hq;
  std::vector<float> g, u, h, out, w_row, ax, ah;
  std::vector<int64_t> offsets, order;
  std::vector<int32_t> row_tok;
  template <class V>
  static uintptr_t grow(V& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
    return reinterpret_cast<uintptr_t>(v.data());
  }
};

class Engine {
 public:
  Engine(int threads, const std::string& isa) : k_(select_kernels(isa)), pool_(threads), scratch_(pool_.num_threads()) {}

  int num_threads() const { return pool_.num_threads(); }
  std::string isa() const { return k_.name; }

  // activations="q8": x rows (fp32, ldx) -> xq [R, kp] int8, xd [R, kp/32] scale, xm [R, kp/32] scale * sum(q);
  // columns >= k are 0. Each 32-element block is quantised by ggml's Q8 rule (d = amax / 127, q = round(x / d),
  // half away from zero). rows: int32 [R] source row of each output row, or 0 for the identity.
  void quantize_act(uintptr_t x, int64_t ldx, uintptr_t rows, int64_t R, int k, int kp, uintptr_t xq, uintptr_t xd,
                    uintptr_t xm) {
    const int nc = kp / 32;
    run(R, (int64_t)R * kp, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = rows ? P<int32_t>(rows)[r] : r;
        const float* xr = P<float>(x) + src * ldx;
        for (int c = 0; c < nc; ++c) {
          float amax = 0.f;
          for (int i = 0; i < 32; ++i)
            if (32 * c + i < k) amax = std::max(amax, std::fabs(xr[32 * c + i]));
          const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
          int8_t* q = P<int8_t>(xq) + r * kp + 32 * c;
          int sum = 0;
          for (int i = 0; i < 32; ++i) {
            const float v = 32 * c + i < k ? xr[32 * c + i] : 0.f;
            const int iv = std::max(-127, std::min(127, (int)std::round(v * id)));
            q[i] = (int8_t)iv;
            sum += iv;
          }
          P<float>(xd)[r * nc + c] = d;
          P<float>(xm)[r * nc + c] = d * (float)sum;
        }
      }
    });
  }

  // activations="q16": x rows (fp32, ldx; rows as in quantize_act) -> xq int16 [R, kp], xd / xm [R, nc8] fp32
  // (Kernels::quant16: per 32 elements d = amax / 32767, q = round(x / d), m = d * sum(q); nc8 = kp/32 rounded
  // up to 8, the padding chunks 0).
  void quantize_act16(uintptr_t x, int64_t ldx, uintptr_t rows, int64_t R, int k, int kp, uintptr_t xq, uintptr_t xd,
                      uintptr_t xm) {
    const int nc8 = nc8_of(kp);
    run(R, (int64_t)R * kp, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = rows ? P<int32_t>(rows)[r] : r;
        k_.quant16(P<float>(x) + src * ldx, k, kp, nc8, P<int16_t>(xq) + r * kp, P<float>(xd) + r * nc8,
                   P<float>(xm) + r * nc8);
      }
    });
  }

  // matmul on q16 activations (quantize_act16): out[r, n] (ldo) for the rows r of each expert e and weight rows
  // n < N. A task is (expert, 16 weight rows), see project16. With expert LoRA (lora not null) each task adds
  // scale * B_e[:, lora_c0 + n] . q[r] to its block (q [R, rank]: the prologue's lora_rank).
  void matmul16(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int N, int kp, uintptr_t offsets,
                int E, uintptr_t xq, uintptr_t xd, uintptr_t xm, uintptr_t out, int64_t ldo,
                const lora::Projection* lora, int64_t lora_c0, uintptr_t q) {
    const Proj p = Proj::of(qtype, w, expert_stride, row_bytes, N, kp);
    if (!p.info.quantised) throw std::invalid_argument("matmul16: float block types take fp32 activations");
    const Acts16 a{P<int16_t>(xq), P<float>(xd), P<float>(xm), kp, nc8_of(kp)};
    const int64_t* off = P<int64_t>(offsets);
    const std::vector<int> experts = busy_experts(off, E);
    const int tile = 16;
    const int64_t tiles = (N + tile - 1) / tile, njobs = (int64_t)experts.size() * tiles;
    pool_.parallel_for(njobs, [&](int64_t b, int64_t end, int tid) {
      for (int64_t job = b; job < end; ++job) {
        const int e = experts[job / tiles];
        const int n0 = (int)(job % tiles) * tile;
        if (job + 1 < njobs) prefetch_task(p, off, experts[(job + 1) / tiles], (job + 1) % tiles * tile, e);
        project16(p, e, n0, std::min(N, n0 + tile), off[e], off[e + 1] - off[e], a, P<float>(out), ldo,
                  scratch_[tid]);
        if (lora) add_lora(*lora, lora_c0, P<float>(q), e, n0, std::min(N, n0 + tile), off, P<float>(out), ldo, tid);
      }
    });
  }

  // The whole forward of a layer with SiLU and q16 activations in one call (decode pays for each pool dispatch
  // and each Python-to-C++ call): route, quantise the routed rows of x, then one pool dispatch in phases that meet
  // at barriers: (expert, 32 rows of I) tasks that run gate and up and, in their epilogue, h = silu(g) * u and h's
  // quantisation (32 columns = one whole activation block); (expert, 16 rows of H) tasks for down. Then the
  // combine. With expert LoRA (gu / dn not null, ktcore/expert_lora.hpp) a prologue phase before each projection
  // projects its input rows onto the rank (ax = A x, ah = A h), and the tasks add scale * B q to their block before
  // the SiLU (gate, up) or the combine (down).
  // Results are bit for bit those of the phased calls (route, quantize_act16, lora_rank, matmul16, silu_mul,
  // combine). y [T, H] is written; the route arrays (offsets [E+1], order / row_tok / w_row [T*K]), g, u, h (fp32
  // [T*K, I]), out ([T*K, H], before the routing weights) and ax, ah (fp32 [T*K, rank]) only when their address is
  // not 0 (training saves them for backward; offsets 0 means none of the route arrays). Returns R, the number of
  // routed rows.
  int64_t forward16(const Layer& L, uintptr_t x, int64_t ldx, int64_t T, int K, uintptr_t ids, uintptr_t weights,
                    uintptr_t offsets, uintptr_t order, uintptr_t row_tok, uintptr_t w_row, uintptr_t y, int64_t ldy,
                    uintptr_t g_save, uintptr_t u_save, uintptr_t h_save, uintptr_t out_save,
                    const lora::Projection* gu, const lora::Projection* dn, uintptr_t ax_save, uintptr_t ah_save) {
    const int E = L.E, H = L.H, I = L.I;
    Fwd16& f = fwd_;
    if (!offsets) {  // inference: the routing stays in the engine's buffers
      offsets = f.grow(f.offsets, E + 1);
      order = f.grow(f.order, T * K);
      row_tok = f.grow(f.row_tok, T * K);
      w_row = f.grow(f.w_row, T * K);
    }
    const int64_t R = route(ids, weights, T * K, K, E, offsets, order, row_tok, w_row);
    const int64_t* off = P<int64_t>(offsets);
    f.xg.resize(R, L.gate.kp);
    quantize_act16(x, ldx, row_tok, R, H, L.gate.kp, f.xg.q_addr(), f.xg.d_addr(), f.xg.m_addr());
    const Acts16* xu = &f.xg.acts;
    if (L.up.kp != L.gate.kp) {
      f.xu.resize(R, L.up.kp);
      quantize_act16(x, ldx, row_tok, R, H, L.up.kp, f.xu.q_addr(), f.xu.d_addr(), f.xu.m_addr());
      xu = &f.xu.acts;
    }
    float* g = P<float>(g_save ? g_save : f.grow(f.g, R * I));
    float* u = P<float>(u_save ? u_save : f.grow(f.u, R * I));
    float* h = P<float>(h_save ? h_save : f.grow(f.h, R * I));
    float* out = P<float>(out_save ? out_save : f.grow(f.out, R * H));
    float* ax = gu ? P<float>(ax_save ? ax_save : f.grow(f.ax, R * gu->rank)) : nullptr;
    float* ah = dn ? P<float>(ah_save ? ah_save : f.grow(f.ah, R * dn->rank)) : nullptr;
    f.hq.resize(R, L.down.kp);
    f.hq.zero_columns_from((I + 31) / 32 * 32);  // down's padding columns (and scale chunks) past I
    const Acts16& hq = f.hq.acts;
    const std::vector<int> experts = busy_experts(off, E);
    const std::vector<std::array<int64_t, 3>> lora_rows = gu || dn ? lora::rank_tasks(off, E) : decltype(lora_rows)();
    // gate/up: (expert, 32 rows of I) tasks; down: (expert, 16 rows of H) tasks
    const int64_t tiles1 = (I + 31) / 32, tiles2 = (H + 15) / 16;
    const int64_t njobs1 = (int64_t)experts.size() * tiles1, njobs2 = (int64_t)experts.size() * tiles2;
    const int nth = pool_.num_threads();
    const int64_t nlora_gu = gu ? (int64_t)lora_rows.size() : 0, nlora_dn = dn ? (int64_t)lora_rows.size() : 0;
    ktcore::WorkSplit gate_up(njobs1, nth), down(njobs2, nth), rank_x(nlora_gu, nth), rank_h(nlora_dn, nth);
    auto rank = [&](const lora::Projection& p, const float* src, int64_t n, int64_t lds, const int32_t* rows,
                    float* q, int64_t i, int tid) {
      const auto& t = lora_rows[i];
      lora::rank_rows(k_.lora, p.a, p.rank, t[0], 0, n, src, false, lds, rows, t[1], t[2], q, false,
                      scratch_[tid].lora);
    };
    pool_.run_each([&](int tid) {
      if (gu) {
        rank_x.run(tid, 1, true,
                   [&](int64_t i, int64_t) { rank(*gu, P<float>(x), H, ldx, P<int32_t>(row_tok), ax, i, tid); });
        pool_.barrier();  // the gate/up tasks read ax
      }
      gate_up.run(tid, 1, true, [&](int64_t job, int64_t) {
        const int e = experts[job / tiles1];
        const int n0 = (int)(job % tiles1) * 32, n1 = std::min(I, n0 + 32);
        const int64_t r0 = off[e], nt = off[e + 1] - r0;
        if (job + 1 < njobs1) prefetch_task(L.gate, off, experts[(job + 1) / tiles1], (job + 1) % tiles1 * 32, e);
        project16(L.gate, e, n0, n1, r0, nt, f.xg.acts, g, I, scratch_[tid]);
        project16(L.up, e, n0, n1, r0, nt, *xu, u, I, scratch_[tid]);
        if (gu) {
          add_lora(*gu, 0, ax, e, n0, n1, off, g, I, tid);
          add_lora(*gu, I, ax, e, n0, n1, off, u, I, tid);
        }
        for (int64_t r = r0; r < r0 + nt; ++r) {
          silu_mul_range(g + r * I + n0, u + r * I + n0, n1 - n0, h + r * I + n0);
          const int c = n0 / 32;  // one activation block of h's row
          k_.quant16(h + r * I + n0, n1 - n0, 32, 1, hq.q + r * hq.kp + n0, hq.d + r * hq.nc8 + c,
                     hq.m + r * hq.nc8 + c);
        }
      });
      pool_.barrier();  // down (and its LoRA prologue) reads every row of h
      if (dn) {
        rank_h.run(tid, 1, true, [&](int64_t i, int64_t) { rank(*dn, h, I, I, nullptr, ah, i, tid); });
        pool_.barrier();  // the down tasks read ah
      }
      down.run(tid, 1, true, [&](int64_t job, int64_t) {
        const int e = experts[job / tiles2];
        const int n0 = (int)(job % tiles2) * 16, n1 = std::min(H, n0 + 16);
        if (job + 1 < njobs2) prefetch_task(L.down, off, experts[(job + 1) / tiles2], (job + 1) % tiles2 * 16, e);
        project16(L.down, e, n0, n1, off[e], off[e + 1] - off[e], hq, out, H, scratch_[tid]);
        if (dn) add_lora(*dn, 0, ah, e, n0, n1, off, out, H, tid);
      });
    });
    combine(reinterpret_cast<uintptr_t>(out), H, w_row, order, R, T, K, H, y, ldy);
    return R;
  }

  // out[r, n] (ldo) for the rows r in [off[e], off[e+1]) and weight rows n < N of expert e. Quantised types
  // read int8 activations (xq, xd, xm; quantize_act, row width kp), float types xf (fp32 [R, kp]). Expert LoRA as
  // in matmul16.
  void matmul(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int N, int kp, uintptr_t offsets,
              int E, uintptr_t xq, uintptr_t xd, uintptr_t xm, uintptr_t xf, uintptr_t out, int64_t ldo,
              const lora::Projection* lora, int64_t lora_c0, uintptr_t q) {
    const TypeInfo ti = type_info(qtype);
    const int nc = kp / 32, nblocks = kp / ti.block_elems;
    const int64_t* off = P<int64_t>(offsets);
    const int tile = 16;
    const int64_t tiles = (N + tile - 1) / tile;
    const std::vector<int> experts = busy_experts(off, E);
    pool_.parallel_for((int64_t)experts.size() * tiles, [&](int64_t b, int64_t end, int tid) {
      Scratch& s = scratch_[tid];
      s.need(kp);
      Unpacked u{s.q.data(), s.f.data(), s.f.data() + nc, s.f.data() + 2 * nc};
      for (int64_t job = b; job < end; ++job) {
        const int e = experts[job / tiles];
        const int n0 = (int)(job % tiles) * tile, n1 = std::min(N, n0 + tile);
        const int64_t r0 = off[e], nt = off[e + 1] - r0;
        const uint8_t* we = P<uint8_t>(w) + e * expert_stride;
        for (int n = n0; n < n1; ++n) {
          float* o = P<float>(out) + r0 * ldo + n;
          if (ti.quantised) {
            const uint8_t* row = we + n * row_bytes;
            const int8_t* q = P<int8_t>(xq) + r0 * kp;
            const float* d = P<float>(xd) + r0 * nc;
            const float* m = P<float>(xm) + r0 * nc;
            if (!(k_.dot_row && k_.dot_row(qtype, row, nblocks, (int)nt, q, d, m, kp, o, ldo))) {
              unpack_row(qtype, row, nblocks, u);
              k_.dot_q(u.q, u.dlo, u.dhi, u.mn, ti.has_min, nc, (int)nt, q, d, m, kp, o, ldo);
            }
          } else {
            float* wf = s.f.data();
            float_row(qtype, we + n * row_bytes, kp, wf);
            k_.dot_f(wf, kp, (int)nt, P<float>(xf) + r0 * kp, kp, o, ldo);
          }
        }
        if (lora) add_lora(*lora, lora_c0, P<float>(q), e, n0, n1, off, P<float>(out), ldo, tid);
      }
    });
  }

  // Routing: the T*K slots (ids int64, weights fp32, both [T*K]) sorted by expert, stably (slot order within an
  // expert); ids outside [0, E) are dropped. Writes offsets int64 [E+1], and for each row r < R (returned) its
  // slot order[r], token row_tok[r] = order[r] / K and weight w_row[r]. A counting sort, on the calling thread.
  int64_t route(uintptr_t ids, uintptr_t weights, int64_t TK, int K, int E, uintptr_t offsets, uintptr_t order,
                uintptr_t row_tok, uintptr_t w_row) {
    const int64_t* id = P<int64_t>(ids);
    int64_t* off = P<int64_t>(offsets);
    std::fill(off, off + E + 1, 0);
    for (int64_t s = 0; s < TK; ++s)
      if (id[s] >= 0 && id[s] < E) ++off[id[s] + 1];
    for (int e = 0; e < E; ++e) off[e + 1] += off[e];
    std::vector<int64_t> next(off, off + E);
    for (int64_t s = 0; s < TK; ++s)
      if (id[s] >= 0 && id[s] < E) {
        const int64_t r = next[id[s]]++;
        P<int64_t>(order)[r] = s;
        P<int32_t>(row_tok)[r] = (int32_t)(s / K);
        P<float>(w_row)[r] = P<float>(weights)[s];
      }
    return off[E];
  }

  // y[t, :] = sum over k < K of w_row[r] * out[r, :] for the row r whose slot order[r] is t * K + k (slots no row
  // took contribute 0), k ascending; order: int64 [R]. Replaces torch's scatter (index_put), whose OpenMP team
  // then spins on the cores for milliseconds and slows the next kernel call.
  void combine(uintptr_t out, int64_t ldo, uintptr_t w_row, uintptr_t order, int64_t R, int64_t T, int K, int H,
               uintptr_t y, int64_t ldy) {
    std::vector<int64_t> row_of(T * K, -1);
    for (int64_t r = 0; r < R; ++r) row_of[P<int64_t>(order)[r]] = r;
    run(T, T * K * H, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t) {
        float* yt = P<float>(y) + t * ldy;
        std::fill(yt, yt + H, 0.f);
        for (int k = 0; k < K; ++k) {
          const int64_t r = row_of[t * K + k];
          if (r >= 0) k_.axpy(P<float>(w_row)[r], P<float>(out) + r * ldo, yt, H);
        }
      }
    });
  }

  // h[i] = silu(g[i]) * u[i] for i < n (fp32). torch's elementwise kernels start their OpenMP team above 32K
  // elements (a decode step's R x I already), and that team's spinning then slows this pool's next call.
  void silu_mul(uintptr_t g_, uintptr_t u_, int64_t n, uintptr_t h_) {
    const float *g = P<float>(g_), *u = P<float>(u_);
    float* h = P<float>(h_);
    run(n, n, [&](int64_t b, int64_t e, int) { silu_mul_range(g + b, u + b, e - b, h + b); });
  }

  // out[r, 0:k] += sum_n g[r, n] * W_e[n, 0:k] for the rows of each expert: the transposed product, with each
  // weight row dequantised block by block (a few blocks per task, never a resident dequantised copy). A task is
  // (expert, 256 columns of k). With expert LoRA (lora not null, ktcore/expert_lora.hpp; g = dL/dout of the
  // projection's columns b_c0.. of B) each task also writes the expert's dB on its share of those columns,
  // scale * sum_r u_b[r] g_r^T (u_b: the forward's q = A in), and, where q_in is set (q_in = B g, the prologue's
  // lora_rank), adds the input gradient scale * A_e^T q_in to its columns of out and writes the expert's dA on them,
  // scale * sum_r q_in[r] in_r^T (in_r: row in_rows[r] of v_in, or row r where in_rows is 0; fp32, ld_in apart).
  void matmul_t(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int N, int k, uintptr_t offsets,
                int E, uintptr_t g, int64_t ldg, uintptr_t out, int64_t ldo, const lora::Projection* lora,
                uintptr_t q_in, uintptr_t v_in, int64_t ld_in, uintptr_t in_rows, uintptr_t u_b, int64_t b_c0) {
    const TypeInfo ti = type_info(qtype);
    const int64_t* off = P<int64_t>(offsets);
    const int nblocks = (k + ti.block_elems - 1) / ti.block_elems;
    const int per = std::max(1, 256 / ti.block_elems);  // blocks per task (256 columns)
    const int64_t chunks = (nblocks + per - 1) / per;
    const std::vector<int> experts = busy_experts(off, E);
    pool_.parallel_for((int64_t)experts.size() * chunks, [&](int64_t b, int64_t end, int tid) {
      float buf[256];
      for (int64_t job = b; job < end; ++job) {
        const int e = experts[job / chunks];
        const int64_t chunk = job % chunks;
        const int b0 = (int)chunk * per, b1 = std::min(nblocks, b0 + per);
        const int c0 = b0 * ti.block_elems, c1 = std::min(k, b1 * ti.block_elems);
        const int64_t r0 = off[e], r1 = off[e + 1];
        const uint8_t* we = P<uint8_t>(w) + e * expert_stride;
        for (int n = 0; n < N; ++n) {
          const uint8_t* row = we + n * row_bytes;
          for (int ib = b0; ib < b1; ++ib)
            dequant_block(qtype, row + (int64_t)ib * ti.block_bytes, buf + (ib - b0) * ti.block_elems);
          for (int64_t r = r0; r < r1; ++r) {
            const float gv = P<float>(g)[r * ldg + n];
            if (gv != 0.f) k_.axpy(gv, buf, P<float>(out) + r * ldo + c0, c1 - c0);
          }
        }
        if (!lora) continue;
        lora::Scratch& ls = scratch_[tid].lora;
        const int rank = lora->rank;
        if (q_in) {
          const float* q = P<float>(q_in);
          lora::expand_rows(k_.lora, lora->a, rank, lora->scale, e, c0, c1 - c0, q, r0, r1 - r0,
                            P<float>(out) + r0 * ldo + c0, ldo, ls);
          lora::grad_columns(k_.lora, lora->grad_a, rank, lora->scale, e, c0, c1 - c0, q, nullptr, P<float>(v_in) + c0,
                             false, ld_in, P<int32_t>(in_rows), r0, r1, ls);
        }
        const int64_t n0 = N * chunk / chunks, n1 = N * (chunk + 1) / chunks;
        lora::grad_columns(k_.lora, lora->grad_b, rank, lora->scale, e, b_c0 + n0, n1 - n0, P<float>(u_b), nullptr,
                           P<float>(g) + n0, false, ldg, nullptr, r0, r1, ls);
      }
    });
  }

  // Expert LoRA's prologue: q[r] (+)= F_e[:, c0:c0+n] . src_r for every row r of every expert (rank-major F: the
  // projection's A where which is 0, its B where 1); src_r is row rows[r] (rows 0: row r) of src, fp32, lds apart.
  void lora_rank(const lora::Projection& p, int which, int64_t c0, int64_t n, uintptr_t src, int64_t lds,
                 uintptr_t rows, uintptr_t offsets, int E, uintptr_t q, bool accumulate) {
    const std::vector<std::array<int64_t, 3>> tasks = lora::rank_tasks(P<int64_t>(offsets), E);
    pool_.parallel_for((int64_t)tasks.size(), [&](int64_t b, int64_t end, int tid) {
      for (int64_t i = b; i < end; ++i)
        lora::rank_rows(k_.lora, which ? p.b : p.a, p.rank, tasks[i][0], c0, n, P<float>(src), false, lds,
                        P<int32_t>(rows), tasks[i][1], tasks[i][2], P<float>(q), accumulate, scratch_[tid].lora);
    });
  }

 private:
  // out[r * ldo + n] += scale * B_e[:, c0 + n] . q[r] for the rows r of expert e and columns n0 <= n < n1
  void add_lora(const lora::Projection& p, int64_t c0, const float* q, int e, int n0, int n1, const int64_t* off,
                float* out, int64_t ldo, int tid) {
    lora::expand_rows(k_.lora, p.b, p.rank, p.scale, e, c0 + n0, n1 - n0, q, off[e], off[e + 1] - off[e],
                      out + off[e] * ldo + n0, ldo, scratch_[tid].lora);
  }

  static void silu_mul_range(const float* g, const float* u, int64_t n, float* h) {
    for (int64_t i = 0; i < n; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }

  // out[r, n] (ldo) for the nt rows r0.. of expert e and weight rows n0 <= n < n1. Experts with at most 3 rows
  // (decode) are dotted straight from the blocks; more rows expand 4 weight rows at a time to int16 (L1-resident)
  // and run them against the rows, 64 at a time, in register tiles (4 rows x 2 tokens on AVX-512, 4 x 1 on AVX2).
  void project16(const Proj& p, int e, int n0, int n1, int64_t r0, int64_t nt, const Acts16& a, float* out,
                 int64_t ldo, Scratch& s) {
    const int RT = 4, TB = 64;
    const uint8_t* we = p.w + e * p.expert_stride;
    const int nblocks = p.kp / p.info.block_elems;
    if (nt <= 3 && k_.row16 &&
        k_.row16(p.qtype, we + n0 * p.row_bytes, p.row_bytes, n1 - n0, nblocks, (int)nt, a.q + r0 * a.kp, a.kp,
                 a.d + r0 * a.nc8, a.m + r0 * a.nc8, a.nc8, out + r0 * ldo + n0, ldo))
      return;
    s.need16(p.kp, a.nc8, RT);
    Row16 rows[RT];
    for (int i = 0; i < RT; ++i) {
      float* f = s.f16.data() + (int64_t)i * 3 * a.nc8;
      rows[i] = Row16{s.w16.data() + (int64_t)i * p.kp, f, f + a.nc8, f + 2 * a.nc8};
    }
    for (int64_t t0 = 0; t0 < nt; t0 += TB) {
      const int ntb = (int)std::min<int64_t>(TB, nt - t0);
      const int64_t rr = r0 + t0;
      for (int n = n0; n < n1; n += RT) {
        const int nr = std::min(RT, n1 - n);
        for (int i = 0; i < nr; ++i) k_.expand16(p.qtype, we + (n + i) * p.row_bytes, nblocks, a.nc8, rows[i], s.q.data());
        k_.dot16(rows, nr, p.qtype == Q6_K, p.info.has_min, p.kp / 32, ntb, a.q + rr * a.kp, a.kp, a.d + rr * a.nc8,
                 a.m + rr * a.nc8, a.nc8, out + rr * ldo + n, ldo, 1);
      }
    }
  }

  // Decode: the row kernels prefetch 16 KB ahead within an expert's rows; when a thread's next task lies in
  // another expert, start fetching that task's first 16 KB now.
  static void prefetch_task(const Proj& p, const int64_t* off, int e, int64_t n0, int current) {
    if (e == current || off[e + 1] - off[e] > 3) return;
    const uint8_t* next = p.w + e * p.expert_stride + n0 * p.row_bytes;
    const int64_t bytes = std::min<int64_t>(16384, (p.n - n0) * p.row_bytes);
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(next + c, 0, 3);
  }

  static std::vector<int> busy_experts(const int64_t* off, int E) {
    std::vector<int> experts;
    for (int e = 0; e < E; ++e) if (off[e + 1] > off[e]) experts.push_back(e);
    return experts;
  }

  // Small work (fewer than ~64K elements) runs on the calling thread: waking the pool costs more than it saves,
  // and much more while torch's OpenMP workers still spin on the cores after a torch op.
  template <class F>
  void run(int64_t n, int64_t work, const F& fn) {
    if (work < (1 << 16) || pool_.num_threads() == 1) fn(0, n, 0);
    else pool_.parallel_for(n, fn, std::max<int64_t>(1, n / (8 * pool_.num_threads())));
  }

  const Kernels& k_;
  ktcore::ThreadPool pool_;
  std::vector<Scratch> scratch_;
  Fwd16 fwd_;  // forward16's buffers, kept between calls (one caller at a time, as for the pool)
};

void dequantize(int qtype, uintptr_t src, int64_t nblocks, uintptr_t dst) {
  const TypeInfo ti = type_info(qtype);
  for (int64_t i = 0; i < nblocks; ++i)
    dequant_block(qtype, P<uint8_t>(src) + i * ti.block_bytes, P<float>(dst) + i * ti.block_elems);
}

void quantize(int qtype, uintptr_t src, int64_t n, uintptr_t dst) { quantize_row(qtype, P<float>(src), n, P<uint8_t>(dst)); }

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "ktcore llamafile backend kernels (GGUF blocks; AVX-512 VNNI / AVX2 / scalar)";
  m.def("cpu_has", &cpu_has, "avx2 (with fma, f16c) or vnni (AVX-512 VL/BW/VNNI)");
  m.def("type_info", [](int t) {
    TypeInfo ti = type_info(t);
    return py::make_tuple(ti.block_elems, ti.block_bytes, ti.quantised, ti.has_min);
  });
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>());
  m.def("quantize", &quantize, py::call_guard<py::gil_scoped_release>());
  ktcore::lora::bind_projection(m);
  py::class_<Layer>(m, "Layer")
      .def(py::init([](py::tuple gate, py::tuple up, py::tuple down, int E, int H, int I) {
             // each projection: (qtype, address, expert_stride, row_bytes, rows, kp)
             auto proj = [](py::tuple t) {
               return Proj::of(t[0].cast<int>(), t[1].cast<uintptr_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
                               t[4].cast<int>(), t[5].cast<int>());
             };
             Layer L{proj(gate), proj(up), proj(down), E, H, I};
             if (!L.gate.info.quantised || !L.up.info.quantised || !L.down.info.quantised)
               throw std::invalid_argument("Layer: forward16 takes quantised block types only");
             if (L.gate.n != I || L.up.n != I || L.down.n != H || L.gate.kp < H || L.up.kp < H || L.down.kp < I)
               throw std::invalid_argument("Layer: projection shapes disagree with E, H, I");
             return L;
           }));
  py::class_<Engine>(m, "Engine")
      .def(py::init<int, const std::string&>())
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("isa", &Engine::isa)
      .def("quantize_act", &Engine::quantize_act, py::call_guard<py::gil_scoped_release>())
      .def("matmul", &Engine::matmul, py::call_guard<py::gil_scoped_release>())
      .def("quantize_act16", &Engine::quantize_act16, py::call_guard<py::gil_scoped_release>())
      .def("matmul16", &Engine::matmul16, py::call_guard<py::gil_scoped_release>())
      .def("forward16", &Engine::forward16, py::call_guard<py::gil_scoped_release>())
      .def("combine", &Engine::combine, py::call_guard<py::gil_scoped_release>())
      .def("silu_mul", &Engine::silu_mul, py::call_guard<py::gil_scoped_release>())
      .def("route", &Engine::route, py::call_guard<py::gil_scoped_release>())
      .def("matmul_t", &Engine::matmul_t, py::call_guard<py::gil_scoped_release>())
      .def("lora_rank", &Engine::lora_rank, py::call_guard<py::gil_scoped_release>());
}
