// The amx_bf16 engine: one MoE layer's forward and backward phases over packed bf16 experts (engine.cpp).
// Tensors arrive as raw addresses (ints from torch's data_ptr()) plus sizes; nothing here links libtorch.
#pragma once

#include <cstdint>
#include <string>

#include "kernels.hpp"
#include "ktcore/expert_lora.hpp"
#include "scheduler.hpp"

namespace ktamx {

namespace lora = ktcore::lora;

class Engine {
 public:
  // kernels: "amx" or "portable" (select.hpp); num_threads <= 0: every hardware thread
  Engine(int num_threads, int num_pools, const std::string& kernels);

  int num_threads() const { return sched_.num_threads(); }
  int num_pools() const { return sched_.num_pools(); }
  // wall time per phase, while switched on (phase_clock_binding.hpp)
  ktcore::PhaseClock& phase_clock() { return sched_.phase_clock(); }
  std::string kernels() const { return K_->name; }

  // src bf16 [E, N, K] contiguous -> dst [E, rup(N,32)/16, rup(K,32)/32, 512] (kernels.hpp's block layout)
  void pack(uintptr_t src, int64_t E, int64_t N, int64_t K, uintptr_t dst);

  // ktcore::route_rows (ktcore/route.hpp): the rows of the call by expert. Returns R.
  int64_t route(uintptr_t ids, int64_t T, int64_t K, int64_t E, uintptr_t w, uintptr_t off, uintptr_t poff,
                uintptr_t row_tok, uintptr_t row_of, uintptr_t order, uintptr_t w_row);

  // tiled dst (Hp columns, poff[E] rows): row r = bf16(src[tok[r], 0:H]), zero padded
  void gather(uintptr_t src, bool src_bf16, int64_t src_stride, int64_t H, int64_t Hp, uintptr_t off,
              uintptr_t poff, int64_t E, uintptr_t tok, uintptr_t dst);

  // out[t] = sum_k wgt[t,k] * sum_p parts[p, row_of[t,k]]  (wgt null: weight 1); out fp32 or bf16
  void combine(uintptr_t parts, int64_t nparts, int64_t R, int64_t H, uintptr_t row_of, uintptr_t wgt, int64_t T,
               int64_t K, uintptr_t out, bool out_bf16);

  // Forward. gate and up in one pass, h = bf16(silu(g) * u) in the epilogue; g/u (fp32 [R, I], LoRA included)
  // saved when their address != 0. xs: the gathered rows, tiled (Hp columns, padded rows). With LoRA (lora not
  // null, expert_lora.hpp): first ax[r] = A_e x_tok[r] (fp32 [R, rank]; x: the token rows, fp32 or bf16, x_stride
  // elements apart), then each output block adds scale * B_e ax before the SiLU.
  void gate_up(uintptr_t xs, uintptr_t off, uintptr_t poff, uintptr_t gate, uintptr_t up, int64_t E, int64_t H,
               int64_t I, uintptr_t h, uintptr_t g, uintptr_t u, int64_t ldh, const lora::Projection* lora,
               uintptr_t x, bool x_bf16, int64_t x_stride, uintptr_t tok, uintptr_t ax);
  // parts[p, r, 0:H] = h[r] @ down_e^T restricted to pool p's slice of I. With LoRA: first ah[r] = A_e h[r] (fp32
  // [R, rank]), then one pool per output block adds scale * B_e ah.
  void down(uintptr_t h, uintptr_t off, uintptr_t down, int64_t E, int64_t H, int64_t I, uintptr_t parts, int64_t ldh,
            const lora::Projection* lora, uintptr_t ah);

  // Backward. gh[r, 0:I] = gys[r] @ down_e (down^T tiles derived per task from the packed down: no resident
  // copy). gys: the gathered output gradients, tiled like xs. With LoRA: first qd[r] = B_e gy_tok[r] (fp32 [R, rank];
  // gy: the output gradient's token rows; like gh, before the routing weights), gh gets scale * A_e^T qd.
  void bwd_down(uintptr_t gys, uintptr_t off, uintptr_t poff, uintptr_t down, int64_t E, int64_t H, int64_t I,
                uintptr_t gh, const lora::Projection* lora, uintptr_t gy, bool gy_bf16, int64_t gy_stride,
                uintptr_t tok, uintptr_t qd);
  // Down's LoRA gradients (lora::grad_phase), apart from bwd_down so that the input gradient can leave first:
  // dA = scale * sum_r w_r qd_r h_r^T and dB = scale * sum_r w_r gy_r ah_r^T (ah: the forward's).
  void bwd_down_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora, uintptr_t qd,
                           uintptr_t w_row, uintptr_t h, int64_t ldh, uintptr_t ah, uintptr_t gy, bool gy_bf16,
                           int64_t gy_stride, uintptr_t tok);
  // per row: grad_w[order[r]] = dot(gh[r], h[r]); ggu[r] = [dL/dg | dL/du] (bf16, Ip each, tiled with padded
  // rows like xs; padding rows zero); ggu_rows, if set (expert LoRA reads it), the same bf16 values as plain rows
  // [R, 2I]
  void bwd_act(uintptr_t gh, uintptr_t h, uintptr_t g, uintptr_t u, uintptr_t w_row, uintptr_t off, uintptr_t poff,
               int64_t E, int64_t I, uintptr_t ggu, uintptr_t ggu_rows, uintptr_t grad_w, int64_t ldh,
               uintptr_t order);
  // parts[p, r, 0:H] = ggu[r, gate part] @ gate_e + ggu[r, up part] @ up_e, over pool p's slice of I. With LoRA:
  // first qg[r] = B_e ggu_rows[r] (fp32 [R, rank]), one pool per output block adds scale * A_e^T qg.
  void bwd_gate_up(uintptr_t ggu, uintptr_t off, uintptr_t poff, uintptr_t gate, uintptr_t up, int64_t E,
                   int64_t H, int64_t I, uintptr_t parts, const lora::Projection* lora, uintptr_t ggu_rows,
                   uintptr_t qg);
  // Gate/up's LoRA gradients, apart like bwd_down_lora_grads: dA = scale * sum_r qg_r x_r^T and dB = scale *
  // sum_r ggu_rows_r ax_r^T.
  void bwd_gate_up_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora,
                              uintptr_t qg, uintptr_t x, bool x_bf16, int64_t x_stride, uintptr_t tok, uintptr_t ax,
                              uintptr_t ggu_rows);

  // memset without waking torch's CPU threads
  void memzero(uintptr_t p, int64_t nbytes);

 private:
  template <class Fill>
  void fill_tiled(const int64_t* off, const int64_t* poff, int64_t E, int64_t cols, uint16_t* dst, Fill fill);
  // the pool that adds the LoRA term of an output unit computed by every pool (partial sums over slices of I)
  int lora_pool(int64_t unit) const { return static_cast<int>(unit % sched_.num_pools()); }

  const KernelTable* K_;
  Scheduler sched_;
};

}  // namespace ktamx
