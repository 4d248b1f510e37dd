"""The amx_int8 expert backend: torch glue around the compiled kernels in ``ktcore_amx_int8._ext``.

Weights are int8 codes with one float32 scale per output channel and expert (``ktcore.experts.int8``,
``int8-sym-channel-v1``), packed into AMX INT8 B-tile blocks. Per call C++ sorts the routing by expert, quantises
each routed row (symmetric, one scale per row), multiplies codes by codes in int32 (AMX TDPBSSD for many rows per
expert, AVX-512 VNNI for few) and dequantises in each output block's epilogue: gate and up with the SiLU(gate) * up
epilogue, then h quantised per row for the down projection, then the combine with the routing weights in fp32.
Backward multiplies by W^T from the forward's own codes (transposed blocks derived per task, nothing resident):
the weight scales are folded into the gradient rows before they are quantised, so no second rounding of the
weights enters. Expert LoRA (fp32/bf16) runs inside the same phases (ktcore/include/ktcore/expert_lora.hpp).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ktcore.experts import ExpertLoRA, ExpertLoRAGrads, ExpertWeights, hugepages
from ktcore.experts.native_call import (EngineBackend, Route, Workspace, address, check_lora_as_saved,
                                        combine_parts, engine_threads, route_rows, token_rows, unpack_tiles)
from ktcore.experts.native_lora import native_grads, native_projections
from ktcore.experts.saved_buffers import Lease, SavedBufferPool
from ktcore.experts.int8 import LAYOUT, Int8Experts

KERNELS = ("auto", "amx", "vnni", "portable")


def _ext():
    from . import _ext as ext

    return ext


def _rup(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def _ld(n: int) -> int:
    """Row stride (bytes) of an int8 row buffer of n columns: not a multiple of 1 KiB, so the 16 rows of a tile load
    do not all fall into the same L1 cache sets."""
    return n + 64 if n % 1024 == 0 else n


@dataclass
class Int8Packed:
    """One layer's experts: codes in the kernels' block layout (gate/up ``[E, Ip/16, Hp/64, 1024]``, down
    ``[E, Hp/16, Ip/64, 1024]``, int8; Hp, Ip = H, I rounded up to 64) and float32 scales per output channel
    (gate/up ``[E, I]``, down ``[E, H]``)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scales: torch.Tensor
    up_scales: torch.Tensor
    down_scales: torch.Tensor
    num_experts: int
    hidden: int
    inter: int
    activation: str = "silu"
    layout: str = LAYOUT

    @property
    def hidden_padded(self) -> int:
        return _rup(self.hidden, 64)

    @property
    def inter_padded(self) -> int:
        return _rup(self.inter, 64)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.gate, self.up, self.down, self.gate_scales, self.up_scales,
                                      self.down_scales))



@dataclass
class Int8Saved:
    x: torch.Tensor  # [T, H] fp32 or bf16, contiguous: the token rows
    route: Route
    g: torch.Tensor  # fp32 [R, I] gate pre-activation (LoRA included)
    u: torch.Tensor  # fp32 [R, I]
    h: torch.Tensor  # bf16 [R, Ip] silu(g) * u as the down projection quantised it
    ax: Optional[torch.Tensor]  # fp32 [R, r]: A x of the gate_up LoRA (None without it)
    ah: Optional[torch.Tensor]  # fp32 [R, r]: A h of the down LoRA
    w_dtype: torch.dtype
    lease: Lease  # owns g, u, h, ax and ah: they go back to the backend's pool with this context





class AMXInt8Backend(EngineBackend):
    """Int8 expert backend. ``kernels`` (or ``KTCORE_AMX_INT8_KERNELS``): ``auto`` (AMX INT8 where this process may
    use it, else AVX-512 VNNI), ``amx``, ``vnni``, or ``portable`` (plain C++, for tests)."""

    name = "amx_int8"

    def __init__(self, config=None, kernels: Optional[str] = None):
        super().__init__(config)
        kernels = kernels or os.environ.get("KTCORE_AMX_INT8_KERNELS", "auto")
        if kernels not in KERNELS:
            raise ValueError(f"KTCORE_AMX_INT8_KERNELS={kernels!r}: choose one of {', '.join(KERNELS)}")
        threads, pools = engine_threads(self.config)
        try:
            self._engine = _ext().Engine(threads, pools, kernels)
        except RuntimeError as exc:
            raise RuntimeError(f"the amx_int8 backend cannot run here: {exc}; choose kt_backend: torch with "
                               "kt_expert_weight_format: bf16 on this CPU") from None
        self._ws = Workspace()
        self._saved = SavedBufferPool()

    # -- pack ----------------------------------------------------------------------------------------------
    def _check(self, activation: str) -> None:
        if activation != "silu":
            raise ValueError(f"the amx_int8 backend implements the silu activation only, not {activation!r}; "
                             "use kt_backend: torch for this model")
        fmt = self.config.kt_expert_weight_format
        if fmt not in ("auto", "int8"):
            raise ValueError(f"the amx_int8 backend packs int8 experts, not {fmt!r}; set "
                             "kt_config.kt_expert_weight_format to int8")

    def _codes_buffer(self, e: int, n: int, k: int) -> torch.Tensor:
        return hugepages.empty(e * _rup(n, 64) * _rup(k, 64), torch.int8)

    def pack(self, weights: ExpertWeights, activation: str = "silu") -> Int8Packed:
        """Quantise dense experts (int8-sym-channel-v1: the codes and scales of ``ktcore.experts.int8.quantize``)."""
        weights.validate()
        self._check(activation)
        e, i, h = weights.gate.shape

        def quantize(w: torch.Tensor, n: int, k: int):
            codes, scales = self._codes_buffer(e, n, k), torch.empty(e, n, dtype=torch.float32)
            per = _rup(n, 64) * _rup(k, 64)
            for e0 in range(0, e, 16):  # a few experts at a time: bounded extra memory
                src = w[e0:e0 + 16].detach().to("cpu")
                src = (src if src.dtype in (torch.float32, torch.bfloat16) else src.float()).contiguous()
                self._engine.quantize_weights(src.data_ptr(), src.dtype == torch.bfloat16, src.shape[0], n, k,
                                              codes[e0 * per:].data_ptr(), scales[e0:].data_ptr())
            return codes, scales

        (gc, gs), (uc, us), (dc, ds) = quantize(weights.gate, i, h), quantize(weights.up, i, h), \
            quantize(weights.down, h, i)
        return Int8Packed(gc, uc, dc, gs, us, ds, e, h, i, activation)

    def pack_source(self, source, activation: str = "silu") -> Optional[Int8Packed]:
        """The int8 codes and scales of a source that holds them (``read_int8()``, the packed store) as they are;
        None for any other source (then ``pack`` quantises its dense weights)."""
        read_int8 = getattr(source, "read_int8", None)
        if read_int8 is None:
            return None
        self._check(activation)
        return self.pack_int8(read_int8(), activation)

    def pack_int8(self, experts: Int8Experts, activation: str = "silu") -> Int8Packed:
        (gc, gs), (uc, us), (dc, ds) = experts.gate, experts.up, experts.down
        e, i, h = gc.shape
        expected = {"gate": ((e, i, h), (e, i)), "up": ((e, i, h), (e, i)), "down": ((e, h, i), (e, h))}
        for name, (codes, scales) in (("gate", experts.gate), ("up", experts.up), ("down", experts.down)):
            want_c, want_s = expected[name]
            if (codes.dtype != torch.int8 or scales.dtype != torch.float32 or tuple(codes.shape) != want_c
                    or tuple(scales.shape) != want_s):
                raise ValueError(f"int8 experts ({LAYOUT}): {name} has {codes.dtype} codes {tuple(codes.shape)} and "
                                 f"{scales.dtype} scales {tuple(scales.shape)}; expected int8 {want_c} and float32 "
                                 f"{want_s}")

        def pack_codes(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
            dst = self._codes_buffer(e, n, k)
            src = codes.contiguous()
            self._engine.pack_codes(src.data_ptr(), e, n, k, dst.data_ptr())
            return dst

        return Int8Packed(pack_codes(gc, i, h), pack_codes(uc, i, h), pack_codes(dc, h, i),
                          gs.contiguous().clone(), us.contiguous().clone(), ds.contiguous().clone(), e, h, i,
                          activation)

    def unpack(self, packed: Int8Packed, ids: Optional[torch.Tensor] = None) -> Int8Experts:
        """The codes and scales of experts ``ids`` (all without) as ``Int8Experts``: what they compute with."""
        h, i = packed.hidden, packed.inter
        ids = torch.arange(packed.num_experts) if ids is None else ids

        def part(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple:
            return (unpack_tiles(codes, ids, n, k, torch.int8, row_multiple=64),
                    scales.index_select(0, ids))

        return Int8Experts(part(packed.gate, packed.gate_scales, i, h), part(packed.up, packed.up_scales, i, h),
                           part(packed.down, packed.down_scales, h, i))

    # -- routing and row quantisation ----------------------------------------------------------------------
    def _quantize(self, name: str, route: Route, src: torch.Tensor, n: int, npad: int, by_token: bool,
                  mul: Optional[torch.Tensor] = None):
        """(codes, lda, scales): the routed rows of src (token rows when by_token, else row r of src) quantised per
        row into a workspace buffer, each multiplied by its expert's row of mul first when given."""
        lda = _ld(npad)
        codes = self._ws.get(name, (route.padded_rows, lda), torch.int8)
        scales = self._ws.get(name + "_scales", (route.R,), torch.float32)
        self._engine.quantize_rows(src.data_ptr(), src.dtype == torch.bfloat16, src.stride(0), n, npad,
                                   route.offsets.data_ptr(), route.padded.data_ptr(), len(route.offsets) - 1,
                                   route.row_tok.data_ptr() if by_token else 0, address(mul), codes.data_ptr(), lda,
                                   scales.data_ptr())
        return codes, lda, scales

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, packed: Int8Packed, x, topk_ids, topk_weights, lora: Optional[ExpertLoRA] = None,
                save: bool = False):
        if x.dim() != 2 or x.shape[1] != packed.hidden:
            raise ValueError(f"x must be [T, {packed.hidden}], got {tuple(x.shape)}")
        eng = self._engine
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        hp, ip = packed.hidden_padded, packed.inter_padded
        lora_gu, lora_dn = native_projections(lora, E, H, I)
        route = route_rows(self._engine, topk_ids, topk_weights, E)
        R, off, poff = route.R, route.offsets, route.padded
        x_rows = token_rows(x)
        xq, lda_x, xs = self._quantize("xq", route, x_rows, H, hp, by_token=True)
        lease = self._saved.lease() if save else None

        def buffer(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            # saved for backward: leased from the pool; needed only within this call: the workspace's
            return lease.empty(shape, dtype) if save else self._ws.get(name, shape, dtype)

        h = buffer("h", (R, ip), torch.bfloat16)
        g = buffer("g", (R, I), torch.float32) if save else None
        u = buffer("u", (R, I), torch.float32) if save else None
        ax = buffer("ax", (R, lora_gu.rank), torch.float32) if lora_gu else None
        eng.gate_up(xq.data_ptr(), lda_x, xs.data_ptr(), off.data_ptr(), poff.data_ptr(), packed.gate.data_ptr(),
                    packed.gate_scales.data_ptr(), packed.up.data_ptr(), packed.up_scales.data_ptr(), E, H, I,
                    h.data_ptr(), ip, address(g), address(u), lora_gu and lora_gu.native(_ext()), x_rows.data_ptr(),
                    x_rows.dtype == torch.bfloat16, x_rows.stride(0), route.row_tok.data_ptr(), address(ax))
        hq, lda_h, hs = self._quantize("hq", route, h, I, ip, by_token=False)
        ah = buffer("ah", (R, lora_dn.rank), torch.float32) if lora_dn else None
        parts = self._ws.get("parts", (eng.num_pools, R, H), torch.float32)
        eng.down(hq.data_ptr(), lda_h, hs.data_ptr(), off.data_ptr(), poff.data_ptr(), packed.down.data_ptr(),
                 packed.down_scales.data_ptr(), E, H, I, parts.data_ptr(), lora_dn and lora_dn.native(_ext()),
                 h.data_ptr(), ip, address(ah))
        y = combine_parts(eng, parts, route, True, x.dtype, self.pin_outputs)
        ctx = Int8Saved(x_rows, route, g, u, h, ax, ah, topk_weights.dtype, lease) if save else None
        return y, ctx

    # -- backward ------------------------------------------------------------------------------------------
    def backward_parts(self, packed: Int8Packed, ctx: Int8Saved, grad_y, lora: Optional[ExpertLoRA] = None):
        if ctx is None:
            raise ValueError("backward needs the context of forward(..., save=True)")
        eng = self._engine
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        hp, ip = packed.hidden_padded, packed.inter_padded
        route = ctx.route
        R, T, K, off, poff = route.R, route.T, route.K, route.offsets, route.padded
        lora_gu, lora_dn = native_projections(lora, E, H, I, off, pinned=self.pin_outputs, zero_idle=False)
        check_lora_as_saved(ctx, lora_gu, lora_dn)

        gy_rows = token_rows(grad_y)
        # gy . (codes * scales) = (gy * scales) . codes: the down scales go into the rows before they are quantised
        gyq, lda_gy, gys = self._quantize("gyq", route, gy_rows, H, hp, by_token=True, mul=packed.down_scales)
        gh = self._ws.get("gh", (R, I), torch.float32)
        qd = self._ws.get("qd", (R, lora_dn.rank), torch.float32) if lora_dn else None
        # gh (and the LoRA's part of it) is taken before the routing weights; bwd_act applies them
        gy_bf16 = gy_rows.dtype == torch.bfloat16
        eng.bwd_down(gyq.data_ptr(), lda_gy, gys.data_ptr(), off.data_ptr(), poff.data_ptr(), packed.down.data_ptr(),
                     E, H, I, gh.data_ptr(), lora_dn and lora_dn.native(_ext()), gy_rows.data_ptr(), gy_bf16,
                     gy_rows.stride(0), route.row_tok.data_ptr(), address(qd))
        lda_gg = _ld(2 * ip)
        ggq = self._ws.get("ggq", (route.padded_rows, lda_gg), torch.int8)
        ggs = self._ws.get("ggs", (R,), torch.float32)
        # expert LoRA reads the gate and up gradients as bf16 rows (as amx_bf16's do)
        ggu_rows = self._ws.get("ggu_rows", (R, 2 * I), torch.bfloat16) if lora_gu else None
        # slots with no expert keep 0
        grad_w = torch.empty(T * K, dtype=torch.float32, pin_memory=self.pin_outputs)
        eng.memzero(grad_w.data_ptr(), grad_w.nbytes)
        eng.bwd_act(gh.data_ptr(), ctx.h.data_ptr(), ip, ctx.g.data_ptr(), ctx.u.data_ptr(), route.w_row.data_ptr(),
                    off.data_ptr(), poff.data_ptr(), E, I, packed.gate_scales.data_ptr(), packed.up_scales.data_ptr(),
                    ggq.data_ptr(), lda_gg, ggs.data_ptr(), address(ggu_rows), grad_w.data_ptr(),
                    route.order.data_ptr())
        parts = self._ws.get("parts", (eng.num_pools, R, H), torch.float32)
        qg = self._ws.get("qg", (R, lora_gu.rank), torch.float32) if lora_gu else None
        eng.bwd_gate_up(ggq.data_ptr(), lda_gg, ggs.data_ptr(), off.data_ptr(), poff.data_ptr(),
                        packed.gate.data_ptr(), packed.up.data_ptr(), E, H, I, parts.data_ptr(),
                        lora_gu and lora_gu.native(_ext()), address(ggu_rows), address(qg))
        grad_x = combine_parts(eng, parts, route, False, grad_y.dtype, self.pin_outputs)
        grad_w = grad_w.view(T, K).to(ctx.w_dtype)

        def lora_grads() -> ExpertLoRAGrads:  # reads this call's workspace: before the backend's next call
            if lora_dn:
                eng.bwd_down_lora_grads(off.data_ptr(), E, H, I, lora_dn.native(_ext()), qd.data_ptr(),
                                        route.w_row.data_ptr(), ctx.h.data_ptr(), ip, ctx.ah.data_ptr(),
                                        gy_rows.data_ptr(), gy_bf16, gy_rows.stride(0), route.row_tok.data_ptr())
            if lora_gu:
                eng.bwd_gate_up_lora_grads(off.data_ptr(), E, H, I, lora_gu.native(_ext()), qg.data_ptr(),
                                           ctx.x.data_ptr(), ctx.x.dtype == torch.bfloat16, ctx.x.stride(0),
                                           route.row_tok.data_ptr(), ctx.ax.data_ptr(), ggu_rows.data_ptr())
            return native_grads(lora, lora_gu, lora_dn) if lora is not None else ExpertLoRAGrads()

        return grad_x, grad_w, lora_grads
