"""The int8 expert weight scheme, ``int8-sym-channel-v1``: what `ktcore convert --format int8` stores and the
amx_int8 backend computes with.

A weight ``W [..., N, K]`` (N output channels, K inputs; gate/up ``[E, I, H]``, down ``[E, H, I]``) becomes

    scales[..., n] = max_k |W[..., n, k]| / 127                          (float32)
    codes[..., n, k] = clamp(round_half_even(W[..., n, k] / scales[..., n]), -127, 127)   (int8; 0 where the row is 0)

and ``W ~= codes * scales[..., None]``. Symmetric (no zero point), one scale per output channel and expert, -128
never used, so a transposed use of the same codes (the backward's ``W^T g``) is exact in the codes too. The
division is in float32, rounding to nearest even, so a native quantiser written the same way gives the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUT = "int8-sym-channel-v1"
QMAX = 127
BLOCK_VALUES = 1 << 22  # quantize's rows per pass: 16 MB of float32 scratch


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [..., N, K], scales float32 [..., N])`` of ``weight [..., N, K]``."""
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"expected a floating-point weight [..., N, K], got {weight.dtype} {tuple(weight.shape)}")
    rows = weight.reshape(-1, weight.shape[-1])
    codes = torch.empty(rows.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=weight.device)
    block = max(1, BLOCK_VALUES // rows.shape[1])  # rows at a time: the scratch stays small (a whole layer's would
    # be four bytes a weight)
    work = torch.empty((min(block, rows.shape[0]), rows.shape[1]), dtype=torch.float32, device=weight.device)
    magnitude = torch.empty(work.shape, dtype=rows.dtype, device=weight.device)
    for r in range(0, rows.shape[0], block):
        n = min(block, rows.shape[0] - r)
        quantize_into(rows[r:r + n], codes[r:r + n], scales[r:r + n], work[:n], magnitude[:n])
    return codes.view(weight.shape), scales.view(weight.shape[:-1])


def quantize_into(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, work: torch.Tensor,
                  magnitude: torch.Tensor) -> None:
    """``quantize(weight)`` written into ``codes`` and ``scales``, bit for bit, in fewer memory passes: one 2-D
    ``weight [N, K]`` (any float dtype; converting it to float32 is exact, so each row's maximum is taken in its
    own dtype), ``work`` float32 and ``magnitude`` of ``weight``'s dtype, both ``[N, K]``, as scratch. Small
    enough blocks stay in cache between the passes."""
    torch.abs(weight, out=magnitude)
    torch.div(magnitude.amax(dim=-1).to(torch.float32), QMAX, out=scales)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    work.copy_(weight)
    work.div_(divisor.unsqueeze(-1)).round_().clamp_(-QMAX, QMAX)
    codes.copy_(work)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales`` as ``dtype``: the weights the int8 backend computes with."""
    if codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.shape[:-1] != scales.shape:
        raise ValueError(f"expected int8 codes [..., N, K] and float32 scales [..., N], got {codes.dtype} "
                         f"{tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    return (codes.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)


@dataclass
class Int8Experts:
    """One layer's routed experts in ``LAYOUT``: ``(codes, scales)`` per projection, gate/up ``[E, I, H]`` /
    ``[E, I]``, down ``[E, H, I]`` / ``[E, H]``. An expert source that holds int8 weights (the packed store)
    offers ``read_int8() -> Int8Experts``; a backend that computes with int8 takes them through ``pack_source``."""

    gate: tuple[torch.Tensor, torch.Tensor]
    up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def quantize(cls, weights) -> "Int8Experts":
        """From dense ``ktcore.experts.ExpertWeights``."""
        return cls(quantize(weights.gate), quantize(weights.up), quantize(weights.down))

    def dequantize(self, dtype: torch.dtype = torch.float32):
        """The dense ``ExpertWeights`` these codes stand for."""
        from ktcore.experts import ExpertWeights

        return ExpertWeights(*(dequantize(c, s, dtype) for c, s in (self.gate, self.up, self.down)))
