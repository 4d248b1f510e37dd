"""The llamafile expert backend: torch glue around the GGUF-block kernels in ``ktcore_llamafile._ext``.

Packed experts are ggml blocks, one ``uint8 [E, N, row_bytes]`` tensor per projection (gate/up ``[E, I, H]``,
down ``[E, H, I]``, blocks along the reduction dimension, exactly a GGUF ``ffn_*_exps`` tensor), either
quantised by :meth:`LlamafileBackend.pack` or taken as they are from a GGUF file
(:meth:`LlamafileBackend.pack_source` / :meth:`LlamafileBackend.pack_blocks`, zero-copy on the file's mmap).

Forward: the routed rows are sorted by expert; activations are quantised per 32 elements to int16 (one fp32
scale per block; or int8 by ggml's Q8_0 rule, see ``activations``) and dotted against the weight blocks
(integer dot per 32-element block -> int32, scaled in fp32); float block types (F32/F16/BF16) are dotted in fp32.
SiLU(gate) * up and the routing weights are applied in fp32. Backward computes the transposed products (grad through down, gate and up)
straight from the blocks, dequantising a few blocks at a time, and the routing-weight gradient from the
saved per-expert outputs. Expert LoRA runs in fp32 inside the same C++ tasks (ktcore/include/ktcore/expert_lora.hpp):
a prologue per expert's rows projects them onto the rank, each output block adds its LoRA term, and the backward's
transposed products accumulate the LoRA gradients per expert in row order. With SiLU, q16 activations and quantised
blocks the whole forward is one C++ call, ``Engine.forward16``, bit for bit the phased calls.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ktcore.experts.native_call import address, check_lora_as_saved, engine_threads
from ktcore.experts.native_lora import NativeProjection, native_grads, native_projections
from ktcore.experts import ExpertBackendBase, ExpertLoRA, ExpertLoRAGrads, ExpertWeights, activation_function
from ktcore.experts.saved_buffers import Lease, SavedBufferPool

from . import blocks as B


def _ext():
    from . import _ext as ext

    return ext


@dataclass
class Projection:
    """One projection of every expert: ``blocks`` uint8 [E, n, row_bytes], rows of k (padded) elements."""

    blocks: torch.Tensor
    qtype: int
    n: int
    k: int

    @property
    def kp(self) -> int:
        return B.padded(self.k, self.qtype)

    @property
    def row_bytes(self) -> int:
        return B.row_bytes(self.k, self.qtype)

    @property
    def quantised(self) -> bool:
        return B.NAMES[self.qtype] not in ("f32", "f16", "bf16")

    @property
    def format(self) -> str:
        return B.NAMES[self.qtype]

    def native(self) -> tuple:
        """(qtype, address, expert_stride, row_bytes, rows, kp): the projection as ``_ext.Layer`` takes it."""
        return self.qtype, self.blocks.data_ptr(), self.blocks.stride(0), self.row_bytes, self.n, self.kp


@dataclass
class LlamafilePacked:
    gate: Projection
    up: Projection
    down: Projection
    num_experts: int
    hidden: int
    inter: int
    activation: str = "silu"
    source: object = None  # keeps an mmapped GGUF file alive while its blocks are in use

    @property
    def nbytes(self) -> int:
        return sum(p.blocks.numel() for p in (self.gate, self.up, self.down))

    @property
    def formats(self) -> tuple[str, str, str]:
        return self.gate.format, self.up.format, self.down.format

    @functools.cached_property
    def native_layer(self):
        """The three projections as one ``_ext.Layer`` (forward16), or None where a type is not quantised."""
        if not (self.gate.quantised and self.up.quantised and self.down.quantised):
            return None
        return _ext().Layer(self.gate.native(), self.up.native(), self.down.native(), self.num_experts, self.hidden,
                            self.inter)


@dataclass
class _Route:
    T: int
    K: int
    R: int
    offsets: torch.Tensor  # int64 [E+1]
    row_tok: torch.Tensor  # int32 [R]
    order: torch.Tensor  # int64 [R] flat slot of each row
    w_row: torch.Tensor  # fp32 [R]


@dataclass
class _Saved:
    x: torch.Tensor  # fp32 [T, H]
    route: _Route
    g: torch.Tensor  # fp32 [R, I] (LoRA included)
    u: torch.Tensor
    h: torch.Tensor  # act(g) * u
    out: torch.Tensor  # fp32 [R, H] expert outputs before the routing weights
    ax: Optional[torch.Tensor]  # fp32 [R, r]: A x of the gate_up LoRA (None without it)
    ah: Optional[torch.Tensor]  # fp32 [R, r]: A h of the down LoRA
    w_dtype: torch.dtype
    lease: Optional[Lease] = None  # when set, owns g, u, h, out, ax and ah: they go back to the backend's pool with it


class _Acts:
    """Activations of R rows in the form a projection's kernel reads (quantised int16 or int8 blocks, or fp32)."""

    def __init__(self, eng, src: torch.Tensor, rows: Optional[torch.Tensor], R: int, k: int, kp: int,
                 quantised: bool, bits: int = 16):
        self.kp = kp
        self.bits = bits  # 16: int16 (quantize_act16, matmul16); 8: int8 (quantize_act, matmul)
        rp = 0 if rows is None else rows.data_ptr()
        if quantised:
            nc = kp // 32
            if bits == 16:
                nc = (nc + 7) // 8 * 8  # scales zero-padded to whole groups of 8 chunks
            self.xq = torch.empty(R, kp, dtype=torch.int16 if bits == 16 else torch.int8)
            self.xd = torch.empty(R, nc, dtype=torch.float32)
            self.xm = torch.empty(R, nc, dtype=torch.float32)
            quantize = eng.quantize_act16 if bits == 16 else eng.quantize_act
            quantize(src.data_ptr(), src.stride(0), rp, R, k, kp, self.xq.data_ptr(), self.xd.data_ptr(),
                     self.xm.data_ptr())
            self.ptrs = (self.xq.data_ptr(), self.xd.data_ptr(), self.xm.data_ptr(), 0)
        else:
            xs = src if rows is None else src[rows.long()]
            self.xf = F.pad(xs, (0, kp - k)).contiguous() if kp != k else xs.contiguous()
            self.ptrs = (0, 0, 0, self.xf.data_ptr())



def _native(proj: Optional[NativeProjection]):
    return None if proj is None else proj.native(_ext())


def _route_arrays(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E: int, with_outputs: bool = True) -> tuple:
    """The routing as the C++ side reads it (ids int64 and weights fp32, flat) and, with_outputs, the arrays its
    routing fills: offsets [E+1], order [T*K], row_tok [T*K], w_row [T*K]."""
    n = topk_ids.numel()
    inputs = (topk_ids.reshape(-1).to(torch.int64).contiguous(),
              topk_weights.reshape(-1).to(torch.float32).contiguous())
    if not with_outputs:
        return inputs
    return (*inputs, torch.empty(E + 1, dtype=torch.int64), torch.empty(n, dtype=torch.int64),
            torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.float32))


# activations mode -> bits per activation; "q8x2" is the former name of the ~15-bit mode (two int8 planes, x and
# its residual), now computed as one int16 plane.
ACTIVATIONS_MODES = {"q16": 16, "q8": 8}
ACTIVATIONS_ALIASES = {"q8x2": "q16"}


class LlamafileBackend(ExpertBackendBase):
    """GGUF-block expert backend. ``isa`` (or ``KTCORE_LLAMAFILE_ISA``): auto | vnni | avx2 | scalar.

    ``activations`` (or ``KTCORE_LLAMAFILE_ACT``): how activations meet quantised weight blocks.
    ``q16`` (default; ``q8x2`` is accepted as its former name): int16 per 32-element block, d = amax / 32767
    (error <= amax / 65534, as fine as the former two int8 planes x and residual); weight rows are expanded
    to int16 in L1 and dotted with vpmaddwd in register tiles of 4 rows x 2 tokens (4 x 1 on AVX2; experts
    with at most 3 tokens: Q8_0/Q4_0/Q4_1/Q4_K rows dotted straight from the blocks); logits match the
    dequantised fp32 model far inside bf16 tolerance. ``q8``: one int8 plane, exactly ggml's Q8_0/Q8_1
    activations (about 1.2% relative error per SmolLM2 MLP: 3.1% on its logits over 30 layers, more than the
    bf16 model's 2.3%), dotted by the older int8 row kernels (1 row x 4 tokens: slower than q16 at prefill).
    """

    name = "llamafile"

    def __init__(self, config=None, isa: Optional[str] = None, activations: Optional[str] = None):
        super().__init__(config)
        activations = activations or os.environ.get("KTCORE_LLAMAFILE_ACT", "q16")
        activations = ACTIVATIONS_ALIASES.get(activations, activations)
        if activations not in ACTIVATIONS_MODES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS_MODES)}, not {activations!r}")
        self.activations = activations
        self._bits = ACTIVATIONS_MODES[activations]
        isa = isa or os.environ.get("KTCORE_LLAMAFILE_ISA", "auto")
        threads, _ = engine_threads(self.config)  # one pool: the llamafile engine splits no work by pool
        self._engine = _ext().Engine(threads, isa)
        self._saved = SavedBufferPool()

    @property
    def isa(self) -> str:
        return self._engine.isa

    @property
    def num_threads(self) -> int:
        return self._engine.num_threads

    # -- pack ----------------------------------------------------------------------------------------------
    def weight_format(self, dtype: torch.dtype = torch.float32) -> str:
        """The block type dense experts are packed into: ``auto`` keeps the weights' own float type (lossless:
        f32/bf16/f16), ``gguf`` means q8_0, any other value names the block type."""
        fmt = self.config.kt_expert_weight_format
        if fmt == "auto":
            return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")
        if fmt == "gguf":
            return B.DEFAULT_FORMAT
        if fmt == "fp32":
            return "f32"
        if fmt not in B.QUANTISERS:
            raise ValueError(f"the llamafile backend quantises dense experts to {', '.join(B.QUANTISERS)}, not "
                             f"{fmt!r} (Q5_K/Q6_K experts are read from GGUF files as they are)")
        return fmt

    def pack(self, weights: ExpertWeights, activation: str = "silu") -> LlamafilePacked:
        weights.validate()
        activation_function(activation)
        fmt = self.weight_format(weights.gate.dtype)
        e, i, h = weights.gate.shape

        def quantise(w: torch.Tensor) -> torch.Tensor:
            out = torch.empty(w.shape[0], w.shape[1], B.row_bytes(w.shape[2], fmt), dtype=torch.uint8)
            for e0 in range(0, w.shape[0], 8):  # a few experts at a time: bounded fp32 staging
                out[e0:e0 + 8] = B.quantize_rows(w[e0:e0 + 8], fmt)
            return out

        t = B.type_number(fmt)
        return LlamafilePacked(Projection(quantise(weights.gate), t, i, h), Projection(quantise(weights.up), t, i, h),
                               Projection(quantise(weights.down), t, h, i), e, h, i, activation)

    def pack_blocks(self, gate, up, down, types, hidden: int, inter: int, activation: str = "silu",
                    source=None) -> LlamafilePacked:
        """Experts as GGUF blocks: ``gate``/``up`` uint8 [E, I, row_bytes(H)], ``down`` [E, H, row_bytes(I)]
        (numpy arrays, e.g. a GGUFReader tensor's mmapped ``data``, or torch tensors; not copied).
        ``types``: one block type or a (gate, up, down) triple (names like "q4_k" or ggml type numbers)."""
        activation_function(activation)
        if not isinstance(types, (tuple, list)):
            types = (types, types, types)
        parts = []
        for arr, t, n, k, what in ((gate, types[0], inter, hidden, "gate"), (up, types[1], inter, hidden, "up"),
                                   (down, types[2], hidden, inter, "down")):
            t = B.type_number(t)
            rb = B.row_bytes(k, t)
            row = arr.shape[-1] * (arr.itemsize if isinstance(arr, np.ndarray) else arr.element_size())
            if arr.ndim > 1 and row != rb:
                # e.g. a GGUF file's float rows, which are not padded to the kernels' 32-element blocks (their
                # bytes may still be a whole number of padded matrices: 8 experts of 24 columns read as 6)
                raise ValueError(f"{what}: rows of {row} bytes, where {k} {B.NAMES[t]} elements padded to whole "
                                 f"blocks take {rb}; pack() the dense weights instead")
            if isinstance(arr, np.ndarray):
                with warnings.catch_warnings():  # read-only mmap: the kernels never write to it
                    warnings.simplefilter("ignore")
                    arr = torch.from_numpy(arr.view(np.uint8))
            if arr.numel() % (n * rb):
                raise ValueError(f"{what}: {arr.numel()} bytes are not whole [{n}, {rb}] {B.NAMES[t]} expert "
                                 f"matrices (rows of {k} elements)")
            arr = arr.view(torch.uint8).reshape(-1, n, rb)
            if not arr.is_contiguous():
                raise ValueError(f"{what}: blocks must be contiguous")
            parts.append(Projection(arr, t, n, k))
        if not (parts[0].blocks.shape[0] == parts[1].blocks.shape[0] == parts[2].blocks.shape[0]):
            raise ValueError("gate, up and down disagree on the number of experts")
        return LlamafilePacked(*parts, parts[0].blocks.shape[0], hidden, inter, activation, source)

    def pack_source(self, source, activation: str = "silu") -> Optional[LlamafilePacked]:
        """``load_model`` hook: a GGUF expert source whose blocks this backend computes with directly (when
        ``kt_expert_weight_format`` is auto or gguf, or names the file's own type) is packed zero-copy from the
        file's mmap; anything else returns None and the loader falls back to read() + pack()."""
        file, keys = getattr(source, "file", None), getattr(source, "keys", None)
        if file is None or keys is None or not hasattr(file, "tensors"):
            return None
        types = [file.tensors[keys[p]].tensor_type for p in ("gate", "up", "down")]
        names = [getattr(t, "name", str(t)).lower() for t in types]
        fmt = self.config.kt_expert_weight_format
        if any(n not in B.TYPES for n in names) or (fmt not in ("auto", "gguf") and set(names) != {fmt}):
            return None
        inter, hidden = file.shape(keys["gate"])[-2:]
        if B.padded(hidden, types[0]) != hidden or B.padded(inter, types[2]) != inter:
            return None  # float rows the kernels cannot read in place (pack_blocks): read() pads them
        t = {p: file.tensors[keys[p]] for p in ("gate", "up", "down")}
        return self.pack_blocks(t["gate"].data, t["up"].data, t["down"].data, tuple(int(x) for x in types), hidden,
                                inter, activation, source=file)

    def unpack(self, packed: LlamafilePacked, ids: Optional[torch.Tensor] = None) -> ExpertWeights:
        """Experts ``ids`` (all without) as the dense float32 weights their blocks stand for."""
        return ExpertWeights(*(B.dequantize_rows(p.blocks if ids is None else p.blocks.index_select(0, ids),
                                                 p.qtype, p.k) for p in (packed.gate, packed.up, packed.down)))

    # -- C++ calls -----------------------------------------------------------------------------------------
    def _route(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, E: int) -> _Route:
        T, K = topk_ids.shape
        ids, wts, offsets, order, row_tok, w_row = _route_arrays(topk_ids, topk_weights, E)
        R = self._engine.route(ids.data_ptr(), wts.data_ptr(), T * K, K, E, offsets.data_ptr(), order.data_ptr(),
                               row_tok.data_ptr(), w_row.data_ptr())
        return _Route(T, K, R, offsets, row_tok[:R], order[:R], w_row[:R])

    def _acts(self, proj: Projection, src: torch.Tensor, rows: Optional[torch.Tensor], R: int,
              cache: Optional[dict] = None) -> _Acts:
        key = (proj.kp, proj.quantised)
        if cache is not None and key in cache:
            return cache[key]
        acts = _Acts(self._engine, src, rows, R, proj.k, proj.kp, proj.quantised, self._bits)
        if cache is not None:
            cache[key] = acts
        return acts

    def _matmul(self, proj: Projection, acts: _Acts, route: _Route, out: torch.Tensor, lora=None, lora_c0: int = 0,
                q: Optional[torch.Tensor] = None) -> None:
        """out = the projection of the rows (plus lora's term, B columns lora_c0.. times q, where given)."""
        b = proj.blocks
        tail = (out.data_ptr(), out.stride(0), lora, lora_c0, address(q))
        if proj.quantised and acts.bits == 16:
            self._engine.matmul16(proj.qtype, b.data_ptr(), b.stride(0), proj.row_bytes, proj.n, proj.kp,
                                  route.offsets.data_ptr(), b.shape[0], *acts.ptrs[:3], *tail)
            return
        self._engine.matmul(proj.qtype, b.data_ptr(), b.stride(0), proj.row_bytes, proj.n, proj.kp,
                            route.offsets.data_ptr(), b.shape[0], *acts.ptrs, *tail)

    def _matmul_t(self, proj: Projection, g: torch.Tensor, route: _Route, out: torch.Tensor, lora=None,
                  q_in: Optional[torch.Tensor] = None, v_in: Optional[torch.Tensor] = None, in_rows=None,
                  u_b: Optional[torch.Tensor] = None, b_c0: int = 0) -> None:
        """out += g @ W per expert; with lora also its gradients (Engine.matmul_t). g must be contiguous."""
        b = proj.blocks
        self._engine.matmul_t(proj.qtype, b.data_ptr(), b.stride(0), proj.row_bytes, proj.n, proj.k,
                              route.offsets.data_ptr(), b.shape[0], g.data_ptr(), g.stride(0), out.data_ptr(),
                              out.stride(0), lora, address(q_in), address(v_in), 0 if v_in is None else v_in.stride(0),
                              address(in_rows), address(u_b), b_c0)

    def _lora_rank(self, lora, which: int, c0: int, n: int, src: torch.Tensor, rows, route: _Route, q: torch.Tensor,
                   accumulate: bool = False) -> None:
        """q (+)= A_e src_r (which 0) or B_e^T src_r (which 1, B's columns c0..c0+n) for every routed row."""
        self._engine.lora_rank(lora, which, c0, n, src.data_ptr(), src.stride(0), address(rows),
                               route.offsets.data_ptr(), len(route.offsets) - 1, q.data_ptr(), accumulate)

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, packed: LlamafilePacked, x, topk_ids, topk_weights, lora: Optional[ExpertLoRA] = None,
                save: bool = False):
        if x.dim() != 2 or x.shape[1] != packed.hidden:
            raise ValueError(f"x must be [T, {packed.hidden}], got {tuple(x.shape)}")
        if packed.activation == "silu" and self._bits == 16 and packed.native_layer is not None:
            return self._forward_one_call(packed, x, topk_ids, topk_weights, lora, save)
        return self._forward_phased(packed, x, topk_ids, topk_weights, lora, save)

    def _forward_phased(self, packed: LlamafilePacked, x, topk_ids, topk_weights, lora: Optional[ExpertLoRA] = None,
                        save: bool = False):
        """One C++ call per phase: route, each projection (with its LoRA prologue), the activation, the combine."""
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        xf = x.detach().to(torch.float32).contiguous()
        lora_gu, lora_dn = native_projections(lora, E, H, I)
        gu, dn = _native(lora_gu), _native(lora_dn)
        route = self._route(topk_ids, topk_weights, E)
        R = route.R
        cache: dict = {}
        g = torch.empty(R, I, dtype=torch.float32)
        u = torch.empty(R, I, dtype=torch.float32)
        ax = torch.empty(R, gu.rank, dtype=torch.float32) if gu else None
        if gu:
            self._lora_rank(gu, 0, 0, H, xf, route.row_tok, route, ax)
        self._matmul(packed.gate, self._acts(packed.gate, xf, route.row_tok, R, cache), route, g, gu, 0, ax)
        self._matmul(packed.up, self._acts(packed.up, xf, route.row_tok, R, cache), route, u, gu, I, ax)
        del cache
        h = self._act_mul(packed.activation, g, u)
        ah = torch.empty(R, dn.rank, dtype=torch.float32) if dn else None
        if dn:
            self._lora_rank(dn, 0, 0, I, h, None, route, ah)
        out = torch.empty(R, H, dtype=torch.float32)
        self._matmul(packed.down, self._acts(packed.down, h, None, R), route, out, dn, 0, ah)
        # y[t] = sum_k w * out over the token's K slots, in C++: torch's scatters (index_add_, index_put) run an
        # OpenMP team that keeps spinning on the cores afterwards and slows the kernels' pool on few cores
        y = torch.empty(route.T, H, dtype=torch.float32)
        self._engine.combine(out.data_ptr(), out.stride(0), route.w_row.data_ptr(), route.order.data_ptr(), R,
                             route.T, route.K, H, y.data_ptr(), y.stride(0))
        ctx = _Saved(xf, route, g, u, h, out, ax, ah, topk_weights.dtype) if save else None
        return y.to(x.dtype), ctx

    def _forward_one_call(self, packed: LlamafilePacked, x, topk_ids, topk_weights, lora: Optional[ExpertLoRA],
                          save: bool):
        """Engine.forward16: the same results as the phased forward, in one C++ call (one pool dispatch)."""
        T, K = topk_ids.shape
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        xf = x.detach().to(torch.float32).contiguous()
        lora_gu, lora_dn = native_projections(lora, E, H, I)
        gu, dn = _native(lora_gu), _native(lora_dn)
        ids, wts, *route_arrays = _route_arrays(topk_ids, topk_weights, E, with_outputs=save)
        y = torch.empty(T, H, dtype=torch.float32)
        lease = self._saved.lease() if save else None
        saved = [lease.empty((T * K, n), torch.float32) for n in (I, I, I, H)] if save else []
        ax = lease.empty((T * K, gu.rank), torch.float32) if save and gu else None
        ah = lease.empty((T * K, dn.rank), torch.float32) if save and dn else None
        # without save, the routing and the intermediates stay in the engine's own buffers (addresses 0)
        R = self._engine.forward16(packed.native_layer, xf.data_ptr(), xf.stride(0), T, K, ids.data_ptr(),
                                   wts.data_ptr(), *[t.data_ptr() for t in route_arrays] or [0] * 4, y.data_ptr(),
                                   y.stride(0), *[t.data_ptr() for t in saved] or [0] * 4, gu, dn, address(ax),
                                   address(ah))
        ctx = None
        if save:
            offsets, order, row_tok, w_row = route_arrays
            g, u, h, out = (t[:R] for t in saved)
            ctx = _Saved(xf, _Route(T, K, R, offsets, row_tok[:R], order[:R], w_row[:R]), g, u, h, out,
                         None if ax is None else ax[:R], None if ah is None else ah[:R], topk_weights.dtype, lease)
        return y.to(x.dtype), ctx

    def _act_mul(self, activation: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """act(g) * u; silu in C++ (see Engine.silu_mul for why), the other activations in torch."""
        if activation != "silu":
            return activation_function(activation)(g) * u
        h = torch.empty_like(g)
        self._engine.silu_mul(g.data_ptr(), u.data_ptr(), g.numel(), h.data_ptr())
        return h

    # -- backward ------------------------------------------------------------------------------------------
    def backward(self, packed: LlamafilePacked, ctx: _Saved, grad_y, lora: Optional[ExpertLoRA] = None):
        if ctx is None:
            raise ValueError("backward needs the context of forward(..., save=True)")
        E, H, I = packed.num_experts, packed.hidden, packed.inter
        route = ctx.route
        R, T, K = route.R, route.T, route.K
        lora_gu, lora_dn = native_projections(lora, E, H, I, route.offsets, pinned=self.pin_outputs)
        check_lora_as_saved(ctx, lora_gu, lora_dn)
        gu, dn = _native(lora_gu), _native(lora_dn)
        rows = route.row_tok.long()
        gy = grad_y.detach().to(torch.float32)[rows]  # [R, H]
        grad_w = torch.zeros(T * K, dtype=torch.float32)
        grad_w[route.order] = (gy * ctx.out).sum(1)
        go = gy * route.w_row.unsqueeze(1)  # gradient of each expert's output
        gh = torch.zeros(R, I, dtype=torch.float32)
        qd = torch.empty(R, dn.rank, dtype=torch.float32) if dn else None
        if dn:
            self._lora_rank(dn, 1, 0, H, go, None, route, qd)
        self._matmul_t(packed.down, go, route, gh, dn, qd, ctx.h, None, ctx.ah, 0)
        with torch.enable_grad():
            gt = ctx.g.detach().requires_grad_(True)
            act = activation_function(packed.activation)(gt)
            (dg,) = torch.autograd.grad(act, gt, gh * ctx.u)
        dg = dg.contiguous()
        du = gh * act.detach()
        gx = torch.zeros(R, H, dtype=torch.float32)
        qg = torch.empty(R, gu.rank, dtype=torch.float32) if gu else None
        if gu:  # B_e^T [dg | du]: B's gate columns, then its up columns
            self._lora_rank(gu, 1, 0, I, dg, None, route, qg)
            self._lora_rank(gu, 1, I, I, du, None, route, qg, accumulate=True)
        self._matmul_t(packed.gate, dg, route, gx, gu, qg, ctx.x, route.row_tok, ctx.ax, 0)
        self._matmul_t(packed.up, du, route, gx, gu, None, None, None, ctx.ax, I)
        grad_x = torch.zeros(T, H, dtype=torch.float32).index_add_(0, rows, gx)
        grads = native_grads(lora, lora_gu, lora_dn) if lora is not None else ExpertLoRAGrads()
        return grad_x.to(grad_y.dtype), grad_w.view(T, K).to(ctx.w_dtype), grads
