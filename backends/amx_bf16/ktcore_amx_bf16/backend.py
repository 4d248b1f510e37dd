"""The amx_bf16 expert backend: torch glue around the compiled kernels in ``ktcore_amx_bf16._ext``.

Tensors cross into C++ as addresses (``data_ptr()``) and sizes only. Per call C++ sorts the routing by expert
(a stable counting sort), gathers the rows as bf16 straight into AMX tile order, runs gate+up in one pass with
the SiLU(gate)*up epilogue, the down projection, and combines with the routing weights in fp32. Backward derives
the transposed weight tiles per task from the packed weights (nothing transposed stays resident). Expert LoRA runs
in the same C++ phases on the same thread pool (ktcore/include/ktcore/expert_lora.hpp): a per-expert prologue
projects the rows onto the rank, each output block adds its LoRA term in its epilogue, and the backward tasks
accumulate the LoRA gradients per expert in row order.
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

_SLACK = 32  # extra rows after the row-major h buffer: AMX tiles read whole 16-row groups


def _ext():
    from . import _ext as ext

    return ext


def _rup(a: int, b: int) -> int:
    return (a + b - 1) // b * b


@dataclass
class AMXPacked:
    gate: torch.Tensor  # int16 storage, VNNI tile blocks [E, Ip/16, Hp/32, 512]
    up: torch.Tensor
    down: torch.Tensor  # [E, Hp/16, Ip/32, 512]
    num_experts: int
    hidden: int
    inter: int
    activation: str = "silu"

    @property
    def hidden_padded(self) -> int:
        return _rup(self.hidden, 32)

    @property
    def inter_padded(self) -> int:
        return _rup(self.inter, 32)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes



@dataclass
class AMXSaved:
    x: torch.Tensor  # [T, H] fp32 or bf16, contiguous: the token rows
    route: Route
    g: torch.Tensor  # fp32 [R, I] gate pre-activation (LoRA included)
    u: torch.Tensor  # fp32 [R, I]
    h: torch.Tensor  # bf16 [R+slack, Ip]  silu(g) * u as the down projection saw it
    ax: Optional[torch.Tensor]  # fp32 [R, r]: A x of the gate_up LoRA (None without it)
    ah: Optional[torch.Tensor]  # fp32 [R, r]: A h of the down LoRA
    w_dtype: torch.dtype
    lease: Lease  # owns g, u, h, ax and ah: they go back to the backend's pool with this context


def _ld(n: int) -> int:
    """Row stride (elements) for a bf16 buffer of n columns: avoid multiples of 2 KiB so the 16 rows of a tile
    load do not all fall into the same L1 cache set."""
    return n + 32 if (2 * n) % 2048 == 0 else n


class AMXBF16Backend(EngineBackend):
    """BF16 expert backend. ``kernels`` (or ``KTCORE_AMX_BF16_KERNELS``): ``auto`` (AMX tiles where this process
    may use them, else AVX-512 BF16 dot products on the same packed experts), ``amx``, ``avx512``, or ``portable``
    (plain C++ kernels, for tests)."""

    name = "amx_bf16"

    def __init__(self, config=None, kernels: Optional[str] = None):
        super().__init__(config)
        ext = _ext()
        kernels = kernels or os.environ.get("KTCORE_AMX_BF16_KERNELS", "auto")
        if kernels == "auto":
            kernels = "amx" if not ext.amx_unavailable_reason() else "avx512"
        why = {"amx": ext.amx_unavailable_reason, "avx512": ext.avx512_bf16_unavailable_reason}.get(
            kernels, lambda: "")()
        if why:
            raise RuntimeError(f"the amx_bf16 backend cannot run its {kernels} kernels here: {why}; choose "
                               "kt_backend: auto on this CPU")
        threads, pools = engine_threads(self.config)
        self._engine = ext.Engine(threads, pools, kernels)
        self._ws = Workspace()
        self._saved = SavedBufferPool()

    # -- pack ----------------------------------------------------------------------------------------------
    def pack(self, weights: ExpertWeights, activation: str = "silu") -> AMXPacked:
        weights.validate()
        if activation != "silu":
            raise ValueError(f"the amx_bf16 backend implements the silu activation only, not {activation!r}; "
                             "use kt_backend: torch for this model")
        fmt = self.config.kt_expert_weight_format
        if fmt not in ("auto", "bf16"):
            raise ValueError(f"the amx_bf16 backend packs bf16 experts, not {fmt!r}; set "
                             "kt_config.kt_expert_weight_format to auto or bf16")
        e, i, h = weights.gate.shape

        def pack_one(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
            dst = hugepages.empty(e * (_rup(n, 32) // 16) * (_rup(k, 32) // 32) * 512, torch.int16)
            for e0 in range(0, e, 16):  # convert a few experts at a time: bounded extra memory
                src = w[e0:e0 + 16].detach().to("cpu", torch.bfloat16).contiguous()
                per = (_rup(n, 32) // 16) * (_rup(k, 32) // 32) * 512
                self._engine.pack(src.data_ptr(), src.shape[0], n, k, dst[e0 * per:].data_ptr())
            return dst

        return AMXPacked(pack_one(weights.gate, i, h), pack_one(weights.up, i, h), pack_one(weights.down, h, i),
                         e, h, i, activation)

    def unpack(self, packed: AMXPacked, ids: Optional[torch.Tensor] = None) -> ExpertWeights:
        h, i = packed.hidden, packed.inter
        ids = torch.arange(packed.num_experts) if ids is None else ids
        return ExpertWeights(*(unpack_tiles(t, ids, n, k, torch.bfloat16, row_multiple=32)
                               for t, n, k in ((packed.gate, i, h), (packed.up, i, h), (packed.down, h, i))))

    # -- routing -------------------------------------------------------------------------------------------
    def _gather(self, src: torch.Tensor, route: Route, hp: int) -> torch.Tensor:
        """The routed rows of src (``_token_rows``) as bf16 in the tiled A layout (kernels.hpp ALayout::tiles), hp
        columns (a workspace buffer: valid until the next gather on this thread)."""
        out = self._ws.get("rows", (route.padded_rows, hp), torch.bfloat16)
        self._engine.gather(src.data_ptr(), src.dtype == torch.bfloat16, src.shape[1], src.shape[1], hp,
                            route.offsets.data_ptr(), route.padded.data_ptr(), len(route.offsets) - 1,
                            route.row_tok.data_ptr(), out.data_ptr())
        return out

    def _zero_rows(self, buf: torch.Tensor, start: int) -> None:
        # plain memset in C++: a torch fill of this size would wake torch's OpenMP threads, whose spinning
        # then competes with this backend's own threads for the cores
        row = buf.stride(0) * buf.element_size()
        self._engine.memzero(buf.data_ptr() + start * row, (buf.shape[0] - start) * row)

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, packed: AMXPacked, x, topk_ids, topk_weights, lora: Optional[ExpertLoRA] = None,
                save: bool = False):
        if x.dim() != 2 or x.shape[1] != packed.hidden:
            raise ValueError(f"x must be [T, {packed.hidden}], got {tuple(x.shape)}")
        eng = self._engine
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        hp, ip = packed.hidden_padded, packed.inter_padded
        lora_gu, lora_dn = native_projections(lora, E, H, I)
        route = route_rows(self._engine, topk_ids, topk_weights, E)
        R = route.R
        x_rows = token_rows(x)
        xs = self._gather(x_rows, route, hp)
        ldh = _ld(ip)
        lease = self._saved.lease() if save else None

        def buffer(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            # saved for backward: leased from the pool; needed only within this call: the workspace's
            return lease.empty(shape, dtype) if save else self._ws.get(name, shape, dtype)

        h = buffer("h", (R + _SLACK, ldh), torch.bfloat16)
        self._zero_rows(h, R)
        g = buffer("g", (R, I), torch.float32) if save else None
        u = buffer("u", (R, I), torch.float32) if save else None
        ax = buffer("ax", (R, lora_gu.rank), torch.float32) if lora_gu else None
        off = route.offsets
        eng.gate_up(xs.data_ptr(), off.data_ptr(), route.padded.data_ptr(), packed.gate.data_ptr(),
                    packed.up.data_ptr(), E, H, I, h.data_ptr(), address(g), address(u), ldh,
                    lora_gu and lora_gu.native(_ext()), x_rows.data_ptr(), x_rows.dtype == torch.bfloat16,
                    x_rows.stride(0), route.row_tok.data_ptr(), address(ax))
        ah = buffer("ah", (R, lora_dn.rank), torch.float32) if lora_dn else None
        parts = self._ws.get("parts", (eng.num_pools, R, H), torch.float32)
        eng.down(h.data_ptr(), off.data_ptr(), packed.down.data_ptr(), E, H, I, parts.data_ptr(), ldh,
                 lora_dn and lora_dn.native(_ext()), address(ah))
        y = combine_parts(eng, parts, route, True, x.dtype, self.pin_outputs)
        ctx = AMXSaved(x_rows, route, g, u, h, ax, ah, topk_weights.dtype, lease) if save else None
        return y, ctx

    # -- backward ------------------------------------------------------------------------------------------
    def backward_parts(self, packed: AMXPacked, ctx: AMXSaved, grad_y, lora: Optional[ExpertLoRA] = None):
        if ctx is None:
            raise ValueError("backward needs the context of forward(..., save=True)")
        eng = self._engine
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        hp, ip = packed.hidden_padded, packed.inter_padded
        route = ctx.route
        R, T, K = route.R, route.T, route.K
        off = route.offsets
        lora_gu, lora_dn = native_projections(lora, E, H, I, off, pinned=self.pin_outputs, zero_idle=False)
        check_lora_as_saved(ctx, lora_gu, lora_dn)

        gy_rows = token_rows(grad_y)
        gys = self._gather(gy_rows, route, hp)
        gh = self._ws.get("gh", (R, I), torch.float32)
        qd = self._ws.get("qd", (R, lora_dn.rank), torch.float32) if lora_dn else None
        # gh (and the LoRA's part of it) is taken before the routing weights; bwd_act applies them
        gy_bf16 = gy_rows.dtype == torch.bfloat16
        eng.bwd_down(gys.data_ptr(), off.data_ptr(), route.padded.data_ptr(), packed.down.data_ptr(), E, H, I,
                     gh.data_ptr(), lora_dn and lora_dn.native(_ext()), gy_rows.data_ptr(), gy_bf16,
                     gy_rows.stride(0), route.row_tok.data_ptr(), address(qd))
        ggu = self._ws.get("ggu", (route.padded_rows, 2 * ip), torch.bfloat16)  # tiled like the gathered rows
        # expert LoRA reads the same bf16 gradients as plain rows (a tiled row is not contiguous)
        ggu_rows = self._ws.get("ggu_rows", (R, 2 * I), torch.bfloat16) if lora_gu else None
        # slots with no expert keep 0
        grad_w = torch.empty(T * K, dtype=torch.float32, pin_memory=self.pin_outputs)
        eng.memzero(grad_w.data_ptr(), grad_w.nbytes)
        eng.bwd_act(gh.data_ptr(), ctx.h.data_ptr(), ctx.g.data_ptr(), ctx.u.data_ptr(), route.w_row.data_ptr(),
                    off.data_ptr(), route.padded.data_ptr(), E, I, ggu.data_ptr(), address(ggu_rows), grad_w.data_ptr(),
                    ctx.h.shape[1], route.order.data_ptr())
        parts = self._ws.get("parts", (eng.num_pools, R, H), torch.float32)
        qg = self._ws.get("qg", (R, lora_gu.rank), torch.float32) if lora_gu else None
        eng.bwd_gate_up(ggu.data_ptr(), off.data_ptr(), route.padded.data_ptr(), packed.gate.data_ptr(),
                        packed.up.data_ptr(), E, H, I, parts.data_ptr(), lora_gu and lora_gu.native(_ext()),
                        address(ggu_rows), address(qg))
        grad_x = combine_parts(eng, parts, route, False, grad_y.dtype, self.pin_outputs)
        grad_w = grad_w.view(T, K).to(ctx.w_dtype)

        def lora_grads() -> ExpertLoRAGrads:  # reads this call's workspace: before the backend's next call
            if lora_dn:
                eng.bwd_down_lora_grads(off.data_ptr(), E, H, I, lora_dn.native(_ext()), qd.data_ptr(),
                                        route.w_row.data_ptr(), ctx.h.data_ptr(), ctx.h.shape[1], ctx.ah.data_ptr(),
                                        gy_rows.data_ptr(), gy_bf16, gy_rows.stride(0), route.row_tok.data_ptr())
            if lora_gu:
                eng.bwd_gate_up_lora_grads(off.data_ptr(), E, H, I, lora_gu.native(_ext()), qg.data_ptr(),
                                           ctx.x.data_ptr(), ctx.x.dtype == torch.bfloat16, ctx.x.stride(0),
                                           route.row_tok.data_ptr(), ctx.ax.data_ptr(), ggu_rows.data_ptr())
            return native_grads(lora, lora_gu, lora_dn) if lora is not None else ExpertLoRAGrads()

        return grad_x, grad_w, lora_grads
