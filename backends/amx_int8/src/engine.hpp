// The amx_int8 engine: one MoE layer's forward and backward phases over int8 experts (engine.cpp). Tensors arrive
// as raw addresses (ints from torch's data_ptr()) plus sizes; nothing here links libtorch.
//
// Weights: int8 codes in the block layout of kernels.hpp, gate/up [E, Ip/16, Hp/64, 1024 B] and down [E, Hp/16,
// Ip/64, 1024 B] (Hp, Ip: H and I rounded up to 64), and float32 scales per output channel, gate/up [E, I], down
// [E, H] (ktcore.experts.int8, int8-sym-channel-v1). Activations are quantised per row on the fly (symmetric, one
// float32 scale per row) into int8 row buffers whose experts' rows are padded to 16 (poff), lda bytes apart.
#pragma once

#include <cstdint>
#include <string>

#include "kernels.hpp"
#include "ktcore/expert_lora.hpp"
#include "scheduler.hpp"

namespace ktint8 {

namespace lora = ktcore::lora;

class Engine {
 public:
  // kernels: "auto", "amx", "vnni" or "portable" (select.hpp); num_threads <= 0: every hardware thread
  Engine(int num_threads, int num_pools, const std::string& kernels);

  int num_threads() const { return sched_.num_threads(); }
  int num_pools() const { return sched_.num_pools(); }
  // wall time per phase, while switched on (phase_clock_binding.hpp)
  ktcore::PhaseClock& phase_clock() { return sched_.phase_clock(); }
  std::string kernels() const { return K_->name; }

  // src [E, N, K] fp32 or bf16, contiguous -> codes in dst (block layout, rup(N,64) x rup(K,64) per expert) and
  // scales [E, N]: int8-sym-channel-v1, the codes of ktcore.experts.int8.quantize to the bit.
  void quantize_weights(uintptr_t src, bool src_bf16, int64_t E, int64_t N, int64_t K, uintptr_t dst,
                        uintptr_t scales);
  // codes int8 [E, N, K] contiguous -> dst (block layout); the backend's unpack (Python) is the inverse
  void pack_codes(uintptr_t codes, int64_t E, int64_t N, int64_t K, uintptr_t dst);

  // ktcore::route_rows (ktcore/route.hpp): the rows of the call by expert. Returns R.
  int64_t route(uintptr_t ids, int64_t T, int64_t K, int64_t E, uintptr_t w, uintptr_t off, uintptr_t poff,
                uintptr_t row_tok, uintptr_t row_of, uintptr_t order, uintptr_t w_row);

  // Quantises rows into dst (poff[E] rows, lda bytes apart, padding rows zero) and scales [R]: row r is row tok[r]
  // (tok 0: row r) of src (fp32 or bf16, src_stride elements apart), n columns (npad with zeros), multiplied first
  // by mul[e * n : (e + 1) * n] of its expert e where mul is set (the backward folds weight scales in).
  void quantize_rows(uintptr_t src, bool src_bf16, int64_t src_stride, int64_t n, int64_t npad, uintptr_t off,
                     uintptr_t poff, int64_t E, uintptr_t tok, uintptr_t mul, uintptr_t dst, int64_t lda,
                     uintptr_t scales);

  // out[t] = sum_k wgt[t,k] * sum_p parts[p, row_of[t,k]]  (wgt 0: weight 1); out fp32 or bf16
  void combine(uintptr_t parts, int64_t nparts, int64_t R, int64_t H, uintptr_t row_of, uintptr_t wgt, int64_t T,
               int64_t K, uintptr_t out, bool out_bf16);

  // Forward. g, u = dequantised (xq @ gate_e^T, xq @ up_e^T) (+ LoRA), h[r] = silu(g) * u (bf16, ldh elements per
  // row); g, u (fp32 [R, I]) saved where their address != 0. With LoRA: first ax[r] = A_e x_tok[r] (fp32 [R, rank];
  // x: the token rows, fp32 or bf16), then each output block adds scale * B_e ax before the SiLU.
  void gate_up(uintptr_t xq, int64_t lda, uintptr_t xs, uintptr_t off, uintptr_t poff, uintptr_t gate,
               uintptr_t gate_scales, uintptr_t up, uintptr_t up_scales, int64_t E, int64_t H, int64_t I, uintptr_t h,
               int64_t ldh, uintptr_t g, uintptr_t u, const lora::Projection* lora, uintptr_t x, bool x_bf16,
               int64_t x_stride, uintptr_t tok, uintptr_t ax);
  // parts[p, r, 0:H] = dequantised hq[r] @ down_e^T over pool p's slice of I. With LoRA: first ah[r] = A_e h[r]
  // (h: bf16, ldh), then one pool per output block adds scale * B_e ah.
  void down(uintptr_t hq, int64_t lda, uintptr_t hs, uintptr_t off, uintptr_t poff, uintptr_t down,
            uintptr_t down_scales, int64_t E, int64_t H, int64_t I, uintptr_t parts, const lora::Projection* lora,
            uintptr_t h, int64_t ldh, uintptr_t ah);

  // Backward. gh[r, 0:I] = dequantised gyq[r] @ codes(down_e), where gyq are the rows gy_tok[r] * down_scales[e]
  // quantised (so the transposed product uses the very codes and scales of the forward; W^T blocks derived per
  // task). With LoRA: first qd[r] = B_e gy_tok[r], gh gets scale * A_e^T qd (gh is before w_row).
  void bwd_down(uintptr_t gyq, int64_t lda, uintptr_t gys, uintptr_t off, uintptr_t poff, uintptr_t down, int64_t E,
                int64_t H, int64_t I, uintptr_t gh, const lora::Projection* lora, uintptr_t gy, bool gy_bf16,
                int64_t gy_stride, uintptr_t tok, uintptr_t qd);
  // Down's LoRA gradients (lora::grad_phase), apart from bwd_down so that the input gradient can leave first:
  // dA = scale * sum_r w_r qd_r h_r^T (h bf16) and dB = scale * sum_r w_r gy_r ah_r^T.
  void bwd_down_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora, uintptr_t qd,
                           uintptr_t w_row, uintptr_t h, int64_t ldh, uintptr_t ah, uintptr_t gy, bool gy_bf16,
                           int64_t gy_stride, uintptr_t tok);
  // Per row: grad_w[order[r]] = dot(gh[r], h[r]); ggq[r] = quantised [dL/dg * gate_scales[e] (Ip columns) | dL/du *
  // up_scales[e] (Ip)] (routing weight in), ggs[r] its scale; ggu_rows, if set (expert LoRA reads it), [dL/dg |
  // dL/du] as bf16 rows [R, 2I].
  void bwd_act(uintptr_t gh, uintptr_t h, int64_t ldh, uintptr_t g, uintptr_t u, uintptr_t w_row, uintptr_t off,
               uintptr_t poff, int64_t E, int64_t I, uintptr_t gate_scales, uintptr_t up_scales, uintptr_t ggq,
               int64_t lda, uintptr_t ggs, uintptr_t ggu_rows, uintptr_t grad_w, uintptr_t order);
  // parts[p, r, 0:H] = dequantised ggq[r] @ [codes(gate_e); codes(up_e)] over pool p's slice of the 2 Ip inputs.
  // With LoRA: first qg[r] = B_e ggu_rows[r], one pool per output block adds scale * A_e^T qg.
  void bwd_gate_up(uintptr_t ggq, int64_t lda, uintptr_t ggs, uintptr_t off, uintptr_t poff, uintptr_t gate,
                   uintptr_t up, int64_t E, int64_t H, int64_t I, uintptr_t parts, const lora::Projection* lora,
                   uintptr_t ggu_rows, uintptr_t qg);
  // Gate/up's LoRA gradients, apart like bwd_down_lora_grads: dA = scale * sum_r qg_r x_r^T and dB = scale *
  // sum_r ggu_rows_r ax_r^T.
  void bwd_gate_up_lora_grads(uintptr_t off, int64_t E, int64_t H, int64_t I, const lora::Projection* lora,
                              uintptr_t qg, uintptr_t x, bool x_bf16, int64_t x_stride, uintptr_t tok, uintptr_t ax,
                              uintptr_t ggu_rows);

  // memset without waking torch's CPU threads
  void memzero(uintptr_t p, int64_t nbytes);

 private:
  // the pool that adds the LoRA term of an output unit computed by every pool (partial sums over slices of K)
  int lora_pool(int64_t unit) const { return static_cast<int>(unit % sched_.num_pools()); }

  const KernelTable* K_;
  Scheduler sched_;
};

}  // namespace ktint8
