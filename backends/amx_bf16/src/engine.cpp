// The amx_bf16 engine: packing, routing, row movement and the forward and backward phases of one MoE layer,
// each phase a set of tasks on the scheduler's pools calling the kernel table's leaf routines.
// Compiled with baseline x86-64 flags: AMX/AVX-512 code lives in kernels_amx.cpp and is reached only through
// the table that kernels_for() hands out after amx_ready() said yes.
#include "engine.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "ktcore/combine.hpp"
#include "ktcore/route.hpp"
#include "select.hpp"

namespace ktamx {
namespace {

// Shapes of one layer's packed experts.
struct Dims {
  int64_t E, H, I, Hp, Ip;
  Dims(int64_t e, int64_t h, int64_t i) : E(e), H(h), I(i), Hp(rup(h, 32)), Ip(rup(i, 32)) {}
  // gate/up: W [Ip, Hp] -> NB = Ip/16 streams of KB = Hp/32 blocks; down: W [Hp, Ip]
  int64_t gu_nb() const { return Ip / 16; }
  int64_t gu_kb() const { return Hp / 32; }
  int64_t dn_nb() const { return Hp / 16; }
  int64_t dn_kb() const { return Ip / 32; }
  const uint16_t* gu_block(const uint16_t* w, int64_t e, int64_t nb, int64_t kb) const {
    return w + ((e * gu_nb() + nb) * gu_kb() + kb) * kBlockElems;
  }
  const uint16_t* dn_block(const uint16_t* w, int64_t e, int64_t nb, int64_t kb) const {
    return w + ((e * dn_nb() + nb) * dn_kb() + kb) * kBlockElems;
  }
};

// Rows of one expert per task: a thread runs consecutive output blocks on the same rows, so those rows stay
// in its L2 (256 rows x 2048 x 2 B = 1 MB). Backward tasks take more rows: each derives transposed tiles.
constexpr int64_t kFwdTaskRows = 256;
constexpr int64_t kBwdTaskRows = 1024;
// Backward needs W^T: a task reads, from every stream, the blocks of its output units (at a stride of a whole
// stream). One 1 KiB block per stream costs a TLB miss per KiB and never ramps up the hardware prefetchers, so a
// backward task covers up to kBwdGroup adjacent units: G contiguous KiB of every stream (a page's worth at G = 4).
// Fewer when a pool would get under kTasksPerThread tasks per thread (decode).
constexpr int64_t kBwdGroup = 4;
// Rows that fit one 32-row group (small batches, the memory-bound layer) run the fused schedule: on chunks of
// kFusedSteps steps, each output unit transposes step after step into two small slots right before their tile
// products (KernelTable::gemm_transposing, which prefetches the blocks a step ahead), C staying in tiles. More
// rows transpose a whole part into the task's scratch, prefetching the pieces of step i + kPrefetchSteps into L1
// while transposing step i, then multiply every row chunk by it.
constexpr int64_t kFusedSteps = 8;
constexpr int64_t kPrefetchSteps = 2;

inline void prefetch_blocks_l1(const uint16_t* b, int64_t n) {
  for (int64_t l = 0; l < n * kBlockElems * 2; l += 64) __builtin_prefetch(reinterpret_cast<const char*>(b) + l, 0, 3);
}

// A backward task's steps: step i's pieces are piece(i, 0) and piece(i, 1), n blocks each (one per output
// unit); steps [0, split) and [split, steps) are separate parts (gate and up in bwd_gate_up): a run of products
// never crosses `split`. multiply(i0, i1, acc, ...) covers steps [i0, i1), adding to the partial sums when acc.

// Fused (one row group): multiply(i0, i1, acc, next) runs gemm_transposing for each output unit on a chunk of
// kFusedSteps steps, so the units of a task take their KiB of the same pieces close together in time. Each call
// is told where the following one starts (next(j): unit j + 1's KiB of this chunk's pieces, after the last unit
// the next chunk's), so its last step prefetches that call's first blocks; only a task's first step is not
// prefetched.
template <class Piece, class Multiply>
inline void multiply_fused(int64_t steps, int64_t split, int64_t n, const Piece& piece, const Multiply& multiply) {
  for (int64_t i0 = 0; i0 < steps;) {
    const int64_t end = std::min(steps, i0 + kFusedSteps), i1 = i0 < split && end > split ? split : end;
    auto next = [&](int64_t j) -> const uint16_t* {
      return j + 1 < n ? piece(i0, 0) + (j + 1) * kBlockElems : i1 < steps ? piece(i1, 0) : nullptr;
    };
    multiply(i0, i1, i0 > 0, next);
    i0 = i1;
  }
}

// More rows: transpose(i) writes step i's W^T blocks into the task's scratch (on the rows' first pass only:
// later row chunks find the scratch complete), then multiply runs over the whole part. The prefetch is one
// step's pieces per step, so that the transposes never wait behind a long queue of misses.
template <class Piece, class Transpose, class Multiply>
inline void transpose_then_multiply(int64_t steps, int64_t split, int64_t n, bool transposing, const Piece& piece,
                                    const Transpose& transpose, const Multiply& multiply) {
  auto prefetch = [&](int64_t i) {
    if (i >= steps) return;
    prefetch_blocks_l1(piece(i, 0), n);
    prefetch_blocks_l1(piece(i, 1), n);
  };
  if (transposing)
    for (int64_t i = 0; i < kPrefetchSteps; ++i) prefetch(i);
  for (int64_t i0 = 0; i0 < steps;) {
    const int64_t i1 = i0 < split ? split : steps;
    if (transposing)
      for (int64_t i = i0; i < i1; ++i) {
        prefetch(i + kPrefetchSteps);
        transpose(i);
      }
    multiply(i0, i1, i0 > 0);
    i0 = i1;
  }
}

}  // namespace

Engine::Engine(int num_threads, int num_pools, const std::string& kernels)
    : K_(kernels_for(kernels)), sched_(num_threads > 0 ? num_threads : default_threads(), num_pools) {}

void Engine::pack(uintptr_t src_, int64_t E, int64_t N, int64_t Kd, uintptr_t dst_) {
  const uint16_t* src = P<const uint16_t>(src_);
  uint16_t* dst = P<uint16_t>(dst_);
  int64_t NB = rup(N, 32) / 16, KB = rup(Kd, 32) / 32;
  sched_.first_pool().parallel_for(E * NB, [&](int64_t b, int64_t e_, int) {
    for (int64_t t = b; t < e_; ++t) {
      int64_t e = t / NB, nb = t % NB;
      uint16_t* out = dst + t * KB * kBlockElems;
      for (int64_t kb = 0; kb < KB; ++kb, out += kBlockElems)
        for (int kp = 0; kp < 16; ++kp)
          for (int n = 0; n < 16; ++n)
            for (int j = 0; j < 2; ++j) {
              int64_t row = nb * 16 + n, col = kb * 32 + 2 * kp + j;
              out[kp * 32 + n * 2 + j] = (row < N && col < Kd) ? src[(e * N + row) * Kd + col] : 0;
            }
    }
  });
}

int64_t Engine::route(uintptr_t ids, int64_t T, int64_t Kk, int64_t E, uintptr_t w, uintptr_t off, uintptr_t poff,
                      uintptr_t row_tok, uintptr_t row_of, uintptr_t order, uintptr_t w_row) {
  return ktcore::route_rows(P<const int64_t>(ids), T, Kk, E, P<const float>(w), P<int64_t>(off), P<int64_t>(poff),
                            P<int32_t>(row_tok), P<int32_t>(row_of), P<int64_t>(order), P<float>(w_row));
}

// Row r of the tiled buffers for padded row pr, or -1 for a padding row.
namespace {
int64_t source_row(int64_t pr, const int64_t* off, const int64_t* poff, int64_t E) {
  const int64_t e = std::upper_bound(poff, poff + E + 1, pr) - poff - 1;
  const int64_t i = pr - poff[e];
  return i < off[e + 1] - off[e] ? off[e] + i : -1;
}
}  // namespace

// Fills a tiled buffer (cols columns, poff[E] rows) one 16-row group at a time: fill(r, row) writes source row r
// (row-major, cols elements) into row; padding rows are zero. Whole 1 KiB tiles are written at once.
template <class Fill>
void Engine::fill_tiled(const int64_t* off, const int64_t* poff, int64_t E, int64_t cols, uint16_t* dst, Fill fill) {
  const int64_t kb = cols / 32;
  sched_.first_pool().parallel_for(poff[E] / 16, [&](int64_t b, int64_t e, int) {
    std::vector<uint16_t> rows(16 * cols);
    for (int64_t grp = b; grp < e; ++grp) {
      for (int i = 0; i < 16; ++i) {
        const int64_t r = source_row(16 * grp + i, off, poff, E);
        if (r >= 0)
          fill(r, rows.data() + i * cols);
        else
          std::fill(rows.data() + i * cols, rows.data() + (i + 1) * cols, 0);
      }
      uint16_t* out = dst + grp * kb * kBlockElems;
      for (int64_t k = 0; k < kb; ++k, out += kBlockElems)
        for (int i = 0; i < 16; ++i) std::memcpy(out + i * 32, rows.data() + i * cols + k * 32, 64);
    }
  });
}

void Engine::gather(uintptr_t src, bool src_bf16, int64_t src_stride, int64_t H, int64_t Hp, uintptr_t off_,
                    uintptr_t poff_, int64_t E, uintptr_t tok_, uintptr_t dst_) {
  const auto span = sched_.phase_clock().span("gather");
  const int32_t* tok = P<const int32_t>(tok_);
  const int64_t es = src_bf16 ? 2 : 4;
  fill_tiled(P<const int64_t>(off_), P<const int64_t>(poff_), E, Hp, P<uint16_t>(dst_), [&](int64_t r, uint16_t* row) {
    K_->row_to_bf16(reinterpret_cast<const char*>(src) + tok[r] * src_stride * es, src_bf16, H, Hp, row);
  });
}

void Engine::combine(uintptr_t parts, int64_t nparts, int64_t R, int64_t H, uintptr_t row_of, uintptr_t wgt,
                     int64_t T, int64_t Kk, uintptr_t out, bool out_bf16) {
  ktcore::combine_rows(sched_.first_pool(), *K_, P<const float>(parts), nparts, R, H, P<const int32_t>(row_of),
                       wgt ? P<const float>(wgt) : nullptr, T, Kk, P<char>(out), out_bf16);
}

// -- forward GEMMs -------------------------------------------------------------------------------------
void Engine::gate_up(uintptr_t xs_, uintptr_t off_, uintptr_t poff_, uintptr_t gate_, uintptr_t up_, int64_t E,
                     int64_t H, int64_t I, uintptr_t h_, uintptr_t g_, uintptr_t u_, int64_t ldh,
                     const lora::Projection* lora, uintptr_t x, bool x_bf16, int64_t x_stride, uintptr_t tok_,
                     uintptr_t ax_) {
  Dims d(E, H, I);
  const uint16_t* xs = P<const uint16_t>(xs_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const ktamx::ALayout la = ktamx::ALayout::tiles(d.Hp);
  const uint16_t *gate = P<const uint16_t>(gate_), *up = P<const uint16_t>(up_);
  uint16_t* h = P<uint16_t>(h_);
  float *g = P<float>(g_), *u = P<float>(u_), *ax = P<float>(ax_);
  if (lora)
    lora::rank_phase(sched_, "fwd gate_up: lora A x", K_->lora, off, E, lora->a, lora->rank, H, P<const void>(x),
                     x_bf16, x_stride, P<const int32_t>(tok_), ax);
  // each pool owns a slice of I (in 32-column units, so that down's K split matches)
  auto task = [&](const Task& t, int pool, int tid, int64_t, int64_t) {
    const int64_t nb = t.unit;  // unit = one 16-column block of gate and of up
    const int64_t row0 = t.r0, m = t.r1 - t.r0;
    float* C = sched_.scratch_c(pool, tid);
    const int64_t ncol = std::min<int64_t>(16, I - nb * 16);
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      int64_t mm = std::min(kRowChunk, m - m0);
      K_->gemm_block(xs + la.at(t.p0 + m0, 0), la, mm, d.gu_block(gate, t.e, nb, 0), d.gu_block(up, t.e, nb, 0),
                     d.gu_kb(), C, 32, 0);
      if (lora) {  // B's gate rows nb * 16.. and up rows I + nb * 16.. (padding columns stay 0)
        lora::Scratch& ls = sched_.lora_scratch(pool, tid);
        lora::expand_rows(K_->lora, lora->b, lora->rank, lora->scale, t.e, nb * 16, ncol, ax, row0 + m0, mm, C, 32, ls);
        lora::expand_rows(K_->lora, lora->b, lora->rank, lora->scale, t.e, I + nb * 16, ncol, ax, row0 + m0, mm,
                          C + 16, 32, ls);
      }
      for (int64_t r = 0; r < mm; ++r) {
        const int64_t row = row0 + m0 + r;
        const float* c = C + r * 32;
        K_->silu_mul(c, c + 16, 16, h + row * ldh + nb * 16);
        if (g && ncol > 0) {
          std::memcpy(g + row * I + nb * 16, c, ncol * 4);
          std::memcpy(u + row * I + nb * 16, c + 16, ncol * 4);
        }
      }
    }
  };
  {
    const auto span = sched_.phase_clock().span("fwd gate_up: gemm");
    sched_.run_split(off, poff, E, d.Ip / 32, /*split_units=*/true, task, /*units_per_split_unit=*/2, 0, kFwdTaskRows);
  }
}

void Engine::down(uintptr_t h_, uintptr_t off_, uintptr_t down_, int64_t E, int64_t H, int64_t I, uintptr_t parts_,
                  int64_t ldh, const lora::Projection* lora, uintptr_t ah_) {
  Dims d(E, H, I);
  const uint16_t* h = P<const uint16_t>(h_);
  const int64_t* off = P<const int64_t>(off_);
  const uint16_t* dn = P<const uint16_t>(down_);
  float* parts = P<float>(parts_);
  float* ah = P<float>(ah_);
  const int64_t R = off[E];
  if (lora)
    lora::rank_phase(sched_, "fwd down: lora A h", K_->lora, off, E, lora->a, lora->rank, I, P<const void>(h_), true,
                     ldh, nullptr, ah);
  auto task = [&](const Task& t, int pool, int tid, int64_t kb0, int64_t kb1) {
    const int64_t np = t.unit;  // 32 output columns
    const int64_t row0 = t.r0, m = t.r1 - t.r0;
    float* C = sched_.scratch_c(pool, tid);
    float* out = parts + static_cast<int64_t>(pool) * R * H;
    const int64_t ncol = std::min<int64_t>(32, H - np * 32);
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      int64_t mm = std::min(kRowChunk, m - m0);
      if (kb1 > kb0)
        K_->gemm_block(h + (row0 + m0) * ldh + kb0 * 32, ktamx::ALayout::rows(ldh), mm,
                       d.dn_block(dn, t.e, 2 * np, kb0), d.dn_block(dn, t.e, 2 * np + 1, kb0), kb1 - kb0, C, 32, 0);
      else  // more pools than 32-column pieces of I: this pool's part is zero
        std::fill(C, C + mm * 32, 0.f);
      if (lora && lora_pool(np) == pool)
        lora::expand_rows(K_->lora, lora->b, lora->rank, lora->scale, t.e, np * 32, ncol, ah, row0 + m0, mm, C, 32,
                          sched_.lora_scratch(pool, tid));
      for (int64_t r = 0; r < mm; ++r) std::memcpy(out + (row0 + m0 + r) * H + np * 32, C + r * 32, ncol * 4);
    }
  };
  {
    const auto span = sched_.phase_clock().span("fwd down: gemm");
    sched_.run_split(off, nullptr, E, d.Hp / 32, /*split_units=*/false, task, 1, d.Ip / 32, kFwdTaskRows);
  }
}

// -- backward ------------------------------------------------------------------------------------------
// Task: units = 32-column pieces of I = forward k-blocks of down, so a group of units is a contiguous piece of every
// down stream.
void Engine::bwd_down(uintptr_t gys_, uintptr_t off_, uintptr_t poff_, uintptr_t down_, int64_t E, int64_t H,
                      int64_t I, uintptr_t gh_, const lora::Projection* lora, uintptr_t gy, bool gy_bf16,
                      int64_t gy_stride, uintptr_t tok_, uintptr_t qd_) {
  Dims d(E, H, I);
  const uint16_t* gys = P<const uint16_t>(gys_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const ktamx::ALayout la = ktamx::ALayout::tiles(d.Hp);
  const uint16_t* dn = P<const uint16_t>(down_);
  float* gh = P<float>(gh_);
  const int32_t* tok = P<const int32_t>(tok_);
  float* qd = P<float>(qd_);
  const int64_t nq = d.Hp / 32, units = d.Ip / 32;
  if (lora)
    lora::rank_phase(sched_, "bwd down: lora B^T g", K_->lora, off, E, lora->b, lora->rank, H, P<const void>(gy),
                     gy_bf16, gy_stride, tok, qd);
  auto task = [&](const Task& t, int pool, int tid, int64_t, int64_t) {
    const int64_t n = t.units, row0 = t.r0, m = t.r1 - t.r0;
    const bool fused = m <= 32;
    // fused: two slots per step of a chunk; else unit j's W^T streams: s + 2j * nq blocks (its first 16
    // columns), then nq blocks (the next 16)
    uint16_t* s = sched_.scratch_blocks(pool, tid, fused ? 2 * kFusedSteps : 2 * n * nq);
    float* C = sched_.scratch_c(pool, tid, n);  // unit j's sums at C + j * kCBlock
    const int64_t stream = d.dn_kb() * kBlockElems;
    auto piece = [&](int64_t q, int odd) { return d.dn_block(dn, t.e, 2 * q + odd, t.unit); };
    auto transpose = [&](int64_t q) {
      const uint16_t *fa = piece(q, 0), *fb = piece(q, 1);
      for (int64_t j = 0; j < n; ++j)
        K_->transpose_pair(fa + j * kBlockElems, fb + j * kBlockElems, s + (2 * j * nq + q) * kBlockElems,
                           s + ((2 * j + 1) * nq + q) * kBlockElems);
    };
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mm = std::min(kRowChunk, m - m0);
      if (fused)
        multiply_fused(nq, nq, n, piece, [&](int64_t q0, int64_t q1, int acc, const auto& next) {
          for (int64_t j = 0; j < n; ++j)
            K_->gemm_transposing(gys + la.at(t.p0 + m0, q0 * 32), la, mm, piece(q0, 0) + j * kBlockElems, 2 * stream,
                                 stream, q1 - q0, C + j * kCBlock, 32, acc, s, next(j));
        });
      else
        transpose_then_multiply(nq, nq, n, m0 == 0, piece, transpose, [&](int64_t q0, int64_t q1, int acc) {
          for (int64_t j = 0; j < n; ++j) {
            const uint16_t* s0 = s + (2 * j * nq + q0) * kBlockElems;
            K_->gemm_block(gys + la.at(t.p0 + m0, q0 * 32), la, mm, s0, s0 + nq * kBlockElems, q1 - q0,
                           C + j * kCBlock, 32, acc);
          }
        });
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = t.unit + j, ncol = std::min<int64_t>(32, I - p * 32);
        if (lora)  // gh += scale * A_e^T qd on these columns of I
          lora::expand_rows(K_->lora, lora->a, lora->rank, lora->scale, t.e, p * 32, ncol, qd, row0 + m0, mm,
                            C + j * kCBlock, 32, sched_.lora_scratch(pool, tid));
        for (int64_t r = 0; r < mm; ++r)
          std::memcpy(gh + (row0 + m0 + r) * I + p * 32, C + j * kCBlock + r * 32, ncol * 4);
      }
    }
  };
  {
    const auto span = sched_.phase_clock().span("bwd down: gemm");
    sched_.run_split(off, poff, E, units, /*split_units=*/true, task, 1, 0, kBwdTaskRows, kBwdGroup);
  }
}

void Engine::bwd_down_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora,
                                 uintptr_t qd, uintptr_t w_row, uintptr_t h, int64_t ldh, uintptr_t ah, uintptr_t gy,
                                 bool gy_bf16, int64_t gy_stride, uintptr_t tok) {
  lora::down_grads(sched_, K_->lora, P<const int64_t>(off), E, H, I, *lora, P<const float>(qd), P<const float>(w_row),
                   P<const void>(h), true, ldh, P<const float>(ah), P<const void>(gy), gy_bf16, gy_stride,
                   P<const int32_t>(tok));
}

void Engine::bwd_act(uintptr_t gh_, uintptr_t h_, uintptr_t g_, uintptr_t u_, uintptr_t wrow_, uintptr_t off_,
                     uintptr_t poff_, int64_t E, int64_t I, uintptr_t ggu_, uintptr_t ggu_rows_, uintptr_t gradw_,
                     int64_t ldh, uintptr_t order_) {
  const auto span = sched_.phase_clock().span("bwd act");
  const int64_t* order = P<const int64_t>(order_);
  const int64_t Ip = rup(I, 32);
  const float *gh = P<const float>(gh_), *g = P<const float>(g_), *u = P<const float>(u_);
  const float* wrow = P<const float>(wrow_);
  const uint16_t* h = P<const uint16_t>(h_);
  uint16_t* ggu = P<uint16_t>(ggu_);
  uint16_t* ggu_rows = P<uint16_t>(ggu_rows_);
  float* gradw = P<float>(gradw_);
  fill_tiled(P<const int64_t>(off_), P<const int64_t>(poff_), E, 2 * Ip, ggu, [&](int64_t r, uint16_t* o) {
    std::fill(o, o + 2 * Ip, 0);
    gradw[order[r]] = K_->silu_mul_bwd(gh + r * I, h + r * ldh, g + r * I, u + r * I, I, wrow[r], o, o + Ip);
    if (ggu_rows) {  // gate's I columns then up's, without the padding between them
      std::memcpy(ggu_rows + r * 2 * I, o, I * 2);
      std::memcpy(ggu_rows + r * 2 * I + I, o + Ip, I * 2);
    }
  });
}

// Task: units = 32 output columns of H = forward k-blocks of gate/up (a group: contiguous in every stream).
void Engine::bwd_gate_up(uintptr_t ggu_, uintptr_t off_, uintptr_t poff_, uintptr_t gate_, uintptr_t up_, int64_t E,
                         int64_t H, int64_t I, uintptr_t parts_, const lora::Projection* lora, uintptr_t ggu_rows_,
                         uintptr_t qg_) {
  Dims d(E, H, I);
  const uint16_t* ggu = P<const uint16_t>(ggu_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const ktamx::ALayout la = ktamx::ALayout::tiles(2 * d.Ip);
  const uint16_t *gate = P<const uint16_t>(gate_), *up = P<const uint16_t>(up_);
  float* parts = P<float>(parts_);
  const uint16_t* ggu_rows = P<const uint16_t>(ggu_rows_);
  float* qg = P<float>(qg_);
  const int64_t R = off[E], units = d.Hp / 32;
  if (lora)
    lora::rank_phase(sched_, "bwd gate_up: lora B^T g", K_->lora, off, E, lora->b, lora->rank, 2 * I, ggu_rows, true,
                     2 * I, nullptr, qg);
  auto task = [&](const Task& t, int pool, int tid, int64_t q0, int64_t q1) {
    const int64_t n = t.units, row0 = t.r0, m = t.r1 - t.r0;
    float* out = parts + static_cast<int64_t>(pool) * R * H;
    const int64_t nq = q1 - q0;  // 0 where there are more pools than 32-column pieces of I: this pool's part is 0
    const bool fused = m <= 32;
    // fused: two slots per step of a chunk; else unit j's W^T streams: s + 4j * nq blocks: gate then up (its
    // first 16 columns), then gate, up (the next 16)
    uint16_t* s = sched_.scratch_blocks(pool, tid, fused ? 2 * kFusedSteps : 4 * n * nq);
    float* C = sched_.scratch_c(pool, tid, n);  // unit j's sums at C + j * kCBlock
    const int64_t stream = d.gu_kb() * kBlockElems;
    // step i < nq: gate's streams 2q and 2q+1 (q = q0 + i); step nq + i: up's
    auto piece = [&](int64_t i, int odd) {
      return d.gu_block(i < nq ? gate : up, t.e, 2 * (q0 + i % nq) + odd, t.unit);
    };
    auto transpose = [&](int64_t i) {
      const uint16_t *fa = piece(i, 0), *fb = piece(i, 1);
      for (int64_t j = 0; j < n; ++j) {
        uint16_t* o = s + (4 * j * nq + i) * kBlockElems;
        K_->transpose_pair(fa + j * kBlockElems, fb + j * kBlockElems, o, o + 2 * nq * kBlockElems);
      }
    };
    auto col = [&](int64_t i) { return (i < nq ? 0 : d.Ip) + (q0 + i % nq) * 32; };  // ggu's gate or up column
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mm = std::min(kRowChunk, m - m0);
      if (nq == 0)
        std::fill(C, C + n * kCBlock, 0.f);
      else if (fused)
        multiply_fused(2 * nq, nq, n, piece, [&](int64_t i0, int64_t i1, int acc, const auto& next) {
          for (int64_t j = 0; j < n; ++j)
            K_->gemm_transposing(ggu + la.at(t.p0 + m0, col(i0)), la, mm, piece(i0, 0) + j * kBlockElems, 2 * stream,
                                 stream, i1 - i0, C + j * kCBlock, 32, acc, s, next(j));
        });
      else
        transpose_then_multiply(2 * nq, nq, n, m0 == 0, piece, transpose, [&](int64_t i0, int64_t i1, int acc) {
          for (int64_t j = 0; j < n; ++j) {
            const uint16_t* s0 = s + (4 * j * nq + i0) * kBlockElems;
            K_->gemm_block(ggu + la.at(t.p0 + m0, col(i0)), la, mm, s0, s0 + 2 * nq * kBlockElems, i1 - i0,
                           C + j * kCBlock, 32, acc);
          }
        });
      for (int64_t j = 0; j < n; ++j) {
        const int64_t np = t.unit + j, nc = std::min<int64_t>(32, H - np * 32);
        if (lora && lora_pool(np) == pool)  // grad_x += scale * A_e^T qg on these columns of H
          lora::expand_rows(K_->lora, lora->a, lora->rank, lora->scale, t.e, np * 32, nc, qg, row0 + m0, mm,
                            C + j * kCBlock, 32, sched_.lora_scratch(pool, tid));
        for (int64_t r = 0; r < mm; ++r)
          std::memcpy(out + (row0 + m0 + r) * H + np * 32, C + j * kCBlock + r * 32, nc * 4);
      }
    }
  };
  {
    const auto span = sched_.phase_clock().span("bwd gate_up: gemm");
    sched_.run_split(off, poff, E, units, /*split_units=*/false, task, 1, d.Ip / 32, kBwdTaskRows, kBwdGroup);
  }
}

void Engine::bwd_gate_up_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora,
                                    uintptr_t qg, uintptr_t x, bool x_bf16, int64_t x_stride, uintptr_t tok,
                                    uintptr_t ax, uintptr_t ggu_rows) {
  lora::gate_up_grads(sched_, K_->lora, P<const int64_t>(off), E, H, I, *lora, P<const float>(qg), P<const void>(x),
                      x_bf16, x_stride, P<const int32_t>(tok), P<const float>(ax), P<const void>(ggu_rows), true);
}

void Engine::memzero(uintptr_t p, int64_t nbytes) {
  if (nbytes > 0) std::memset(P<char>(p), 0, nbytes);
}


}  // namespace ktamx
