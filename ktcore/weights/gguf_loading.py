"""``load_model`` for GGUF files: the same guarantees as for safetensors checkpoints.

The HF config comes from the GGUF metadata (``gguf_config``), the model is built on the meta device, every
tensor is validated against the GGUF header before any is read, non-expert tensors go to the device and the
routed experts (``blk.L.ffn_{gate,up,down}_exps``; the dense MLP ``blk.L.ffn_*`` for Llama) are read layer
by layer from the mmap into the backend.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .loading import _resolve_dtype, fill_model
from .gguf_reader import GGUFFile, GGUFWeights, gguf_config


def load_gguf_model(path, config=None, *, device=None, dtype=None, need_backward: bool = True,
                    progress: bool = True):
    """Load a ``.gguf`` file with its routed experts (or Llama MLPs) in the backend chosen by ``config``.

    ``dtype`` defaults to float32 (GGUF tensors are F32/F16/BF16 or quantised; quantised tensors are
    dequantised, so there is no single on-disk dtype to keep)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    with GGUFFile(path) as file:
        hf_config = gguf_config(file)
        dtype = _resolve_dtype(hf_config, dtype or getattr(hf_config, "dtype", None) or torch.float32)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        fill_model(model, config, lambda m, arch: GGUFWeights(file, m, arch), path=path, dtype=dtype,
                   device=device, need_backward=need_backward, progress=progress)
    model.config.dtype = dtype
    return model.eval()
