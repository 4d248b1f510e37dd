// The amx_int8 engine: packing and quantising weights, routing, quantising activation rows, and the forward and
// backward phases of one MoE layer, each phase a set of tasks on the scheduler's pools calling the kernel table.
// Compiled with baseline x86-64 flags: AVX-512 / AMX code lives in kernels_vnni.cpp and kernels_amx.cpp and is
// reached only through the table kernels_for() hands out.
#include "engine.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "ktcore/combine.hpp"
#include "ktcore/route.hpp"
#include "select.hpp"

namespace ktint8 {
namespace {

// Shapes of one layer's packed experts (kernels.hpp's block layout).
struct Dims {
  int64_t E, H, I, Hp, Ip;
  Dims(int64_t e, int64_t h, int64_t i) : E(e), H(h), I(i), Hp(rup(h, kBlockK)), Ip(rup(i, kBlockK)) {}
  // gate/up: W [Ip, Hp], Ip/16 streams of Hp/64 blocks; down: W [Hp, Ip]
  int64_t gu_kb() const { return Hp / kBlockK; }
  int64_t dn_kb() const { return Ip / kBlockK; }
  const int8_t* gu_expert(const int8_t* w, int64_t e) const { return w + e * (Ip / 16) * gu_kb() * kBlockBytes; }
  const int8_t* dn_expert(const int8_t* w, int64_t e) const { return w + e * (Hp / 16) * dn_kb() * kBlockBytes; }
  const int8_t* gu_stream(const int8_t* w, int64_t e, int64_t nb) const {
    return gu_expert(w, e) + nb * gu_kb() * kBlockBytes;
  }
  const int8_t* dn_stream(const int8_t* w, int64_t e, int64_t nb) const {
    return dn_expert(w, e) + nb * dn_kb() * kBlockBytes;
  }
};

// Rows of one expert per task: a thread runs the output units of a task on the same rows, which stay in its L2.
// Backward tasks take more rows: each first derives the transposed weight blocks it needs.
constexpr int64_t kFwdTaskRows = 256;
constexpr int64_t kBwdTaskRows = 1024;
// Backward needs W^T: for each step (64 rows of W) a unit of 32 columns reads 512 bytes from each of four streams
// a whole stream apart. Alone, such pieces cost a TLB miss each and never ramp up the hardware prefetchers, so a
// backward task covers up to kBwdGroup adjacent units (their pieces are contiguous: kBwdGroup x 512 bytes of every
// stream) and prefetches the pieces of step kt + kPrefetchSteps while it transposes step kt.
constexpr int64_t kBwdGroup = 4;
constexpr int64_t kPrefetchSteps = 2;

// Row n (Kp codes) of a matrix into its stream (the 16 rows of n's block row), block layout.
void put_row(const int8_t* row, int64_t n, int64_t Kp, int8_t* stream) {
  for (int64_t k = 0; k < Kp; ++k) stream[k / kBlockK * kBlockBytes + block_offset(n, k)] = row[k];
}

// Expert and row of padded row p (-1: a padding row).
std::pair<int64_t, int64_t> source_row(int64_t p, const int64_t* off, const int64_t* poff, int64_t E) {
  const int64_t e = std::upper_bound(poff, poff + E + 1, p) - poff - 1;
  const int64_t i = p - poff[e];
  return {e, i < off[e + 1] - off[e] ? off[e] + i : -1};
}

// The W^T blocks of units [unit, unit + n) (32 columns of W's inputs each) for steps kt0..kt1 of W (one expert's
// packed matrix, KB blocks per stream): unit j's first 16 columns at out + (2j stride + kt - kt0) blocks, its next
// 16 at out + ((2j + 1) stride + kt - kt0). Column c of a stream starts at byte 16 c (kernels.hpp's block layout),
// so step kt's pieces are 512 n bytes from 512 unit in each of the streams 4 kt .. 4 kt + 3.
void transpose_units(const KernelTable& K, const int8_t* W, int64_t KB, int64_t unit, int64_t n, int64_t kt0,
                     int64_t kt1, int8_t* out, int64_t stride) {
  auto prefetch = [&](int64_t kt) {
    if (kt >= kt1) return;
    for (int64_t g = 0; g < 4; ++g) {
      const char* piece = reinterpret_cast<const char*>(W + (4 * kt + g) * KB * kBlockBytes + 512 * unit);
      for (int64_t l = 0; l < 512 * n; l += 64) __builtin_prefetch(piece + l, 0, 3);
    }
  };
  for (int64_t kt = kt0; kt < kt0 + kPrefetchSteps; ++kt) prefetch(kt);
  for (int64_t kt = kt0; kt < kt1; ++kt) {
    prefetch(kt + kPrefetchSteps);
    for (int64_t j = 0; j < n; ++j) {
      int8_t* o = out + (2 * j * stride + kt - kt0) * kBlockBytes;
      K.transpose_block(W, KB, 32 * (unit + j), kt, o);
      K.transpose_block(W, KB, 32 * (unit + j) + 16, kt, o + stride * kBlockBytes);
    }
  }
}

}  // namespace

Engine::Engine(int num_threads, int num_pools, const std::string& kernels)
    : K_(kernels_for(kernels)), sched_(num_threads > 0 ? num_threads : default_threads(), num_pools) {}

void Engine::quantize_weights(uintptr_t src, bool src_bf16, int64_t E, int64_t N, int64_t K, uintptr_t dst_,
                              uintptr_t scales_) {
  const int64_t NB = rup(N, kBlockK) / 16, Kp = rup(K, kBlockK), es = src_bf16 ? 2 : 4;
  int8_t* dst = P<int8_t>(dst_);
  float* scales = P<float>(scales_);
  sched_.first_pool().parallel_for(E * NB, [&](int64_t b, int64_t end, int) {
    std::vector<int8_t> row(Kp);
    for (int64_t s = b; s < end; ++s) {
      const int64_t e = s / NB, nb = s % NB;
      for (int64_t n = nb * 16; n < nb * 16 + 16; ++n) {
        if (n < N)
          scales[e * N + n] = K_->quantize_row(P<const char>(src) + (e * N + n) * K * es, src_bf16, nullptr, K, Kp,
                                               row.data());
        else
          std::fill(row.begin(), row.end(), 0);
        put_row(row.data(), n, Kp, dst + s * (Kp / kBlockK) * kBlockBytes);
      }
    }
  });
}

void Engine::pack_codes(uintptr_t codes_, int64_t E, int64_t N, int64_t K, uintptr_t dst_) {
  const int64_t NB = rup(N, kBlockK) / 16, Kp = rup(K, kBlockK);
  const int8_t* codes = P<const int8_t>(codes_);
  int8_t* dst = P<int8_t>(dst_);
  sched_.first_pool().parallel_for(E * NB, [&](int64_t b, int64_t end, int) {
    std::vector<int8_t> row(Kp, 0);
    for (int64_t s = b; s < end; ++s) {
      const int64_t e = s / NB, nb = s % NB;
      for (int64_t n = nb * 16; n < nb * 16 + 16; ++n) {
        if (n < N) std::memcpy(row.data(), codes + (e * N + n) * K, K);
        else std::fill(row.begin(), row.end(), 0);
        put_row(row.data(), n, Kp, dst + s * (Kp / kBlockK) * kBlockBytes);
      }
    }
  });
}

int64_t Engine::route(uintptr_t ids, int64_t T, int64_t Kk, int64_t E, uintptr_t w, uintptr_t off, uintptr_t poff,
                      uintptr_t row_tok, uintptr_t row_of, uintptr_t order, uintptr_t w_row) {
  return ktcore::route_rows(P<const int64_t>(ids), T, Kk, E, P<const float>(w), P<int64_t>(off), P<int64_t>(poff),
                            P<int32_t>(row_tok), P<int32_t>(row_of), P<int64_t>(order), P<float>(w_row));
}

void Engine::quantize_rows(uintptr_t src, bool src_bf16, int64_t src_stride, int64_t n, int64_t npad, uintptr_t off_,
                           uintptr_t poff_, int64_t E, uintptr_t tok_, uintptr_t mul_, uintptr_t dst_, int64_t lda,
                           uintptr_t scales_) {
  const auto span = sched_.phase_clock().span("quantize rows");
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const int32_t* tok = P<const int32_t>(tok_);
  const float* mul = P<const float>(mul_);
  int8_t* dst = P<int8_t>(dst_);
  float* scales = P<float>(scales_);
  const int64_t es = src_bf16 ? 2 : 4;
  sched_.run_tasks(poff[E], [&](int64_t p, int, int) {
    const auto [e, r] = source_row(p, off, poff, E);
    if (r < 0) {
      std::memset(dst + p * lda, 0, npad);
      return;
    }
    const char* row = P<const char>(src) + (tok ? tok[r] : r) * src_stride * es;
    scales[r] = K_->quantize_row(row, src_bf16, mul ? mul + e * n : nullptr, n, npad, dst + p * lda);
  });
}

void Engine::combine(uintptr_t parts, int64_t nparts, int64_t R, int64_t H, uintptr_t row_of, uintptr_t wgt,
                     int64_t T, int64_t Kk, uintptr_t out, bool out_bf16) {
  ktcore::combine_rows(sched_.first_pool(), *K_, P<const float>(parts), nparts, R, H, P<const int32_t>(row_of),
                       wgt ? P<const float>(wgt) : nullptr, T, Kk, P<char>(out), out_bf16);
}

// -- forward -------------------------------------------------------------------------------------------
// Task: unit = 16 output channels of gate and of up; the pools split the units.
void Engine::gate_up(uintptr_t xq_, int64_t lda, uintptr_t xs_, uintptr_t off_, uintptr_t poff_, uintptr_t gate_,
                     uintptr_t gate_scales, uintptr_t up_, uintptr_t up_scales, int64_t E, int64_t H, int64_t I,
                     uintptr_t h_, int64_t ldh, uintptr_t g_, uintptr_t u_, const lora::Projection* lora, uintptr_t x,
                     bool x_bf16, int64_t x_stride, uintptr_t tok_, uintptr_t ax_) {
  const Dims d(E, H, I);
  const int8_t *xq = P<const int8_t>(xq_), *gate = P<const int8_t>(gate_), *up = P<const int8_t>(up_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const float *xs = P<const float>(xs_), *gs = P<const float>(gate_scales), *us = P<const float>(up_scales);
  uint16_t* h = P<uint16_t>(h_);
  float *g = P<float>(g_), *u = P<float>(u_), *ax = P<float>(ax_);
  if (lora)
    lora::rank_phase(sched_, "fwd gate_up: lora A x", K_->lora, off, E, lora->a, lora->rank, H, P<const void>(x),
                     x_bf16, x_stride, P<const int32_t>(tok_), ax);
  auto task = [&](const Task& t, int pool, int tid, int64_t, int64_t) {
    const int64_t nb = t.unit, ncol = std::min<int64_t>(16, I - nb * 16), m = t.r1 - t.r0;
    int32_t* Ci = sched_.scratch_ci(pool, tid);
    float* C = sched_.scratch_cf(pool, tid);
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mm = std::min(kRowChunk, m - m0), row0 = t.r0 + m0;
      K_->gemm_block(xq + (t.p0 + m0) * lda, lda, mm, d.gu_stream(gate, t.e, nb), d.gu_stream(up, t.e, nb), d.gu_kb(),
                     Ci, 32);
      K_->dequant(Ci, 32, mm, ncol, xs + row0, gs + t.e * I + nb * 16, C, 32);
      K_->dequant(Ci + 16, 32, mm, ncol, xs + row0, us + t.e * I + nb * 16, C + 16, 32);
      if (lora) {  // B's gate rows nb * 16.. and up rows I + nb * 16..
        lora::Scratch& ls = sched_.lora_scratch(pool, tid);
        lora::expand_rows(K_->lora, lora->b, lora->rank, lora->scale, t.e, nb * 16, ncol, ax, row0, mm, C, 32, ls);
        lora::expand_rows(K_->lora, lora->b, lora->rank, lora->scale, t.e, I + nb * 16, ncol, ax, row0, mm, C + 16,
                          32, ls);
      }
      for (int64_t r = 0; r < mm; ++r) {
        const float* c = C + r * 32;
        K_->silu_mul(c, c + 16, ncol, h + (row0 + r) * ldh + nb * 16);
        if (g) {
          std::memcpy(g + (row0 + r) * I + nb * 16, c, ncol * 4);
          std::memcpy(u + (row0 + r) * I + nb * 16, c + 16, ncol * 4);
        }
      }
    }
  };
  {
    const auto span = sched_.phase_clock().span("fwd gate_up: gemm");
    sched_.run_split(off, poff, E, (I + 15) / 16, /*split_units=*/true, 0, kFwdTaskRows, task);
  }
}

// Task: unit = 32 output columns of H; every pool runs every unit over its slice of I (partial sums).
void Engine::down(uintptr_t hq_, int64_t lda, uintptr_t hs_, uintptr_t off_, uintptr_t poff_, uintptr_t down_,
                  uintptr_t down_scales, int64_t E, int64_t H, int64_t I, uintptr_t parts_,
                  const lora::Projection* lora, uintptr_t h, int64_t ldh, uintptr_t ah_) {
  const Dims d(E, H, I);
  const int8_t *hq = P<const int8_t>(hq_), *dn = P<const int8_t>(down_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const float *hs = P<const float>(hs_), *ds = P<const float>(down_scales);
  float *parts = P<float>(parts_), *ah = P<float>(ah_);
  const int64_t R = off[E];
  if (lora)
    lora::rank_phase(sched_, "fwd down: lora A h", K_->lora, off, E, lora->a, lora->rank, I, P<const void>(h), true,
                     ldh, nullptr, ah);
  auto task = [&](const Task& t, int pool, int tid, int64_t kb0, int64_t kb1) {
    const int64_t np = t.unit, ncol = std::min<int64_t>(32, H - np * 32), m = t.r1 - t.r0;
    int32_t* Ci = sched_.scratch_ci(pool, tid);
    float* C = sched_.scratch_cf(pool, tid);
    float* out = parts + static_cast<int64_t>(pool) * R * H;
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mm = std::min(kRowChunk, m - m0), row0 = t.r0 + m0;
      if (kb1 > kb0) {
        K_->gemm_block(hq + (t.p0 + m0) * lda + kb0 * kBlockK, lda, mm,
                       d.dn_stream(dn, t.e, 2 * np) + kb0 * kBlockBytes,
                       d.dn_stream(dn, t.e, 2 * np + 1) + kb0 * kBlockBytes, kb1 - kb0, Ci, 32);
        K_->dequant(Ci, 32, mm, ncol, hs + row0, ds + t.e * H + np * 32, C, 32);
      } else {  // more pools than 64-column pieces of I: this pool's part is zero
        std::fill(C, C + mm * 32, 0.f);
      }
      if (lora && lora_pool(np) == pool)
        lora::expand_rows(K_->lora, lora->b, lora->rank, lora->scale, t.e, np * 32, ncol, ah, row0, mm, C, 32,
                          sched_.lora_scratch(pool, tid));
      for (int64_t r = 0; r < mm; ++r) std::memcpy(out + (row0 + r) * H + np * 32, C + r * 32, ncol * 4);
    }
  };
  {
    const auto span = sched_.phase_clock().span("fwd down: gemm");
    sched_.run_split(off, poff, E, (H + 31) / 32, /*split_units=*/false, d.dn_kb(), kFwdTaskRows, task);
  }
}

// -- backward ------------------------------------------------------------------------------------------
// Task: unit = 32 columns of I (W^T streams derived from down's codes); the pools split the units.
void Engine::bwd_down(uintptr_t gyq_, int64_t lda, uintptr_t gys_, uintptr_t off_, uintptr_t poff_, uintptr_t down_,
                      int64_t E, int64_t H, int64_t I, uintptr_t gh_, const lora::Projection* lora, uintptr_t gy,
                      bool gy_bf16, int64_t gy_stride, uintptr_t tok_, uintptr_t qd_) {
  const Dims d(E, H, I);
  const int8_t *gyq = P<const int8_t>(gyq_), *dn = P<const int8_t>(down_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const float* gys = P<const float>(gys_);
  const int32_t* tok = P<const int32_t>(tok_);
  float *gh = P<float>(gh_), *qd = P<float>(qd_);
  const int64_t units = (I + 31) / 32, kt_n = d.Hp / kBlockK;
  if (lora)
    lora::rank_phase(sched_, "bwd down: lora B^T g", K_->lora, off, E, lora->b, lora->rank, H, P<const void>(gy),
                     gy_bf16, gy_stride, tok, qd);
  auto task = [&](const Task& t, int pool, int tid, int64_t, int64_t) {
    const int64_t n = t.units, m = t.r1 - t.r0;
    int8_t* s = sched_.scratch_blocks(pool, tid, 2 * n * kt_n);
    transpose_units(*K_, d.dn_expert(dn, t.e), d.dn_kb(), t.unit, n, 0, kt_n, s, kt_n);
    int32_t* Ci = sched_.scratch_ci(pool, tid);
    float* C = sched_.scratch_cf(pool, tid);
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mm = std::min(kRowChunk, m - m0), row0 = t.r0 + m0;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = t.unit + j, ncol = std::min<int64_t>(32, I - p * 32);
        const int8_t* sj = s + 2 * j * kt_n * kBlockBytes;
        K_->gemm_block(gyq + (t.p0 + m0) * lda, lda, mm, sj, sj + kt_n * kBlockBytes, kt_n, Ci, 32);
        K_->dequant(Ci, 32, mm, ncol, gys + row0, nullptr, C, 32);
        if (lora)  // gh += scale * A_e^T qd on these columns of I
          lora::expand_rows(K_->lora, lora->a, lora->rank, lora->scale, t.e, p * 32, ncol, qd, row0, mm, C, 32,
                            sched_.lora_scratch(pool, tid));
        for (int64_t r = 0; r < mm; ++r) std::memcpy(gh + (row0 + r) * I + p * 32, C + r * 32, ncol * 4);
      }
    }
  };
  {
    const auto span = sched_.phase_clock().span("bwd down: gemm");
    sched_.run_split(off, poff, E, units, /*split_units=*/true, 0, kBwdTaskRows, task, kBwdGroup);
  }
}

void Engine::bwd_down_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora,
                                 uintptr_t qd, uintptr_t w_row, uintptr_t h, int64_t ldh, uintptr_t ah, uintptr_t gy,
                                 bool gy_bf16, int64_t gy_stride, uintptr_t tok) {
  lora::down_grads(sched_, K_->lora, P<const int64_t>(off), E, H, I, *lora, P<const float>(qd), P<const float>(w_row),
                   P<const void>(h), true, ldh, P<const float>(ah), P<const void>(gy), gy_bf16, gy_stride,
                   P<const int32_t>(tok));
}

void Engine::bwd_act(uintptr_t gh_, uintptr_t h_, int64_t ldh, uintptr_t g_, uintptr_t u_, uintptr_t w_row_,
                     uintptr_t off_, uintptr_t poff_, int64_t E, int64_t I, uintptr_t gate_scales, uintptr_t up_scales,
                     uintptr_t ggq_, int64_t lda, uintptr_t ggs_, uintptr_t ggu_rows_, uintptr_t grad_w_,
                     uintptr_t order_) {
  const auto span = sched_.phase_clock().span("bwd act");
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_), *order = P<const int64_t>(order_);
  const float *gh = P<const float>(gh_), *g = P<const float>(g_), *u = P<const float>(u_);
  const uint16_t* h = P<const uint16_t>(h_);
  const float *w_row = P<const float>(w_row_), *gs = P<const float>(gate_scales), *us = P<const float>(up_scales);
  int8_t* ggq = P<int8_t>(ggq_);
  float *ggs = P<float>(ggs_), *grad_w = P<float>(grad_w_);
  uint16_t* ggu_rows = P<uint16_t>(ggu_rows_);
  const int64_t Ip = rup(I, kBlockK);
  sched_.run_tasks(poff[E], [&](int64_t p, int pool, int tid) {
    const auto [e, r] = source_row(p, off, poff, E);
    if (r < 0) {
      std::memset(ggq + p * lda, 0, 2 * Ip);
      return;
    }
    // the row's gradients [dL/dg | dL/du] (Ip columns each, zero padded), then, in place, as they meet the codes
    float* v = sched_.scratch_row(pool, tid, 2 * Ip);
    std::fill(v, v + 2 * Ip, 0.f);
    float *gg = v, *gu = v + Ip;
    grad_w[order[r]] = K_->silu_mul_bwd(gh + r * I, h + r * ldh, g + r * I, u + r * I, I, w_row[r], gg, gu);
    if (ggu_rows) {
      K_->store_row(gg, I, ggu_rows + r * 2 * I, 1);
      K_->store_row(gu, I, ggu_rows + r * 2 * I + I, 1);
    }
    for (int64_t i = 0; i < I; ++i) {
      gg[i] *= gs[e * I + i];
      gu[i] *= us[e * I + i];
    }
    ggs[r] = K_->quantize_row(v, 0, nullptr, 2 * Ip, 2 * Ip, ggq + p * lda);
  });
}

// Task: unit = 32 output columns of H (W^T streams derived from gate's and up's codes); every pool runs every unit
// over its slice of the 2 Ip inputs (gate's Ip, then up's).
void Engine::bwd_gate_up(uintptr_t ggq_, int64_t lda, uintptr_t ggs_, uintptr_t off_, uintptr_t poff_,
                         uintptr_t gate_, uintptr_t up_, int64_t E, int64_t H, int64_t I, uintptr_t parts_,
                         const lora::Projection* lora, uintptr_t ggu_rows_, uintptr_t qg_) {
  const Dims d(E, H, I);
  const int8_t *ggq = P<const int8_t>(ggq_), *gate = P<const int8_t>(gate_), *up = P<const int8_t>(up_);
  const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
  const float* ggs = P<const float>(ggs_);
  const uint16_t* ggu_rows = P<const uint16_t>(ggu_rows_);
  float *parts = P<float>(parts_), *qg = P<float>(qg_);
  const int64_t R = off[E], units = (H + 31) / 32, half = d.Ip / kBlockK;
  if (lora)
    lora::rank_phase(sched_, "bwd gate_up: lora B^T g", K_->lora, off, E, lora->b, lora->rank, 2 * I, ggu_rows, true,
                     2 * I, nullptr, qg);
  auto task = [&](const Task& t, int pool, int tid, int64_t k0, int64_t k1) {
    const int64_t n = t.units, m = t.r1 - t.r0, nk = k1 - k0, mid = std::clamp(half, k0, k1);
    int8_t* s = sched_.scratch_blocks(pool, tid, 2 * n * nk);
    // steps k0..mid are gate's (its 64-row groups), mid..k1 up's
    transpose_units(*K_, d.gu_expert(gate, t.e), d.gu_kb(), t.unit, n, k0, mid, s, nk);
    transpose_units(*K_, d.gu_expert(up, t.e), d.gu_kb(), t.unit, n, mid - half, k1 - half,
                    s + (mid - k0) * kBlockBytes, nk);
    int32_t* Ci = sched_.scratch_ci(pool, tid);
    float* C = sched_.scratch_cf(pool, tid);
    float* out = parts + static_cast<int64_t>(pool) * R * H;
    for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
      const int64_t mm = std::min(kRowChunk, m - m0), row0 = t.r0 + m0;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t np = t.unit + j, nc = std::min<int64_t>(32, H - np * 32);
        const int8_t* sj = s + 2 * j * nk * kBlockBytes;
        if (nk > 0) {
          K_->gemm_block(ggq + (t.p0 + m0) * lda + k0 * kBlockK, lda, mm, sj, sj + nk * kBlockBytes, nk, Ci, 32);
          K_->dequant(Ci, 32, mm, nc, ggs + row0, nullptr, C, 32);
        } else {  // more pools than 64-column pieces of 2 Ip: this pool's part is zero
          std::fill(C, C + mm * 32, 0.f);
        }
        if (lora && lora_pool(np) == pool)  // grad_x += scale * A_e^T qg on these columns of H
          lora::expand_rows(K_->lora, lora->a, lora->rank, lora->scale, t.e, np * 32, nc, qg, row0, mm, C, 32,
                            sched_.lora_scratch(pool, tid));
        for (int64_t r = 0; r < mm; ++r) std::memcpy(out + (row0 + r) * H + np * 32, C + r * 32, nc * 4);
      }
    }
  };
  {
    const auto span = sched_.phase_clock().span("bwd gate_up: gemm");
    sched_.run_split(off, poff, E, units, /*split_units=*/false, 2 * half, kBwdTaskRows, task, kBwdGroup);
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

}  // namespace ktint8
