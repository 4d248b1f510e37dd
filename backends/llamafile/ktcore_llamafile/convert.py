"""``ktcore convert``: re-quantise the routed experts of a GGUF model with ktcore_llamafile's quantisers.

Layout of the output (``DIR/<stem>.<format>.gguf``, written atomically): a complete GGUF model file. Every
metadata key and every non-expert tensor is copied unchanged (quantised tensors as their raw blocks); the
routed experts (the family's ``gguf_expert_keys``: ``blk.L.ffn_{gate,up,down}_exps.weight``, or for dense
Llama the MLPs ``blk.L.ffn_*``, which ktcore runs as one expert) are written as ``--format`` blocks.
``general.file_type`` is left as it was. Rows whose length is not a multiple of the block size (e.g. Q4_K with
I = 1408) fall back to Q8_0, as llama.cpp's quantiser falls back for such rows. Load it with
``ktcore.load_model(path, {"kt_backend": "llamafile"})``: the experts go into the backend as the file's
blocks, read from the mmap, never dequantised.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import blocks as B
from .plugin import CONVERT_FORMATS


def convert_gguf(src, out_dir, fmt: str = "q4_k", progress=None) -> dict:
    import gguf

    from ktcore.files import atomic_file
    from ktcore.model.wrap import find_arch
    from ktcore.weights.gguf_reader import GGUFFile, gguf_config

    if fmt not in CONVERT_FORMATS:
        raise ValueError(f"--format must be one of {', '.join(CONVERT_FORMATS)}, not {fmt!r}")
    src = Path(src)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{src.stem}.{fmt}.gguf"
    summary = {"source": str(src), "output": str(dst), "format": fmt, "experts": {}, "copied": 0}
    with GGUFFile(src) as f, atomic_file(dst) as tmp:
        keys = find_arch(gguf_config(f)).gguf_expert_keys.values()
        experts = {key.format(layer=layer) for key in keys for layer in range(int(f.arch_meta("block_count")))}
        writer = gguf.GGUFWriter(tmp, f.architecture)
        f.copy_metadata_to(writer)
        for name, t in f.tensors.items():
            if name in experts:
                value = f.get(name).float()  # one tensor (one layer's experts) at a time
                k = value.shape[-1]
                use = fmt if k % B.block_info(fmt)[0] == 0 else "q8_0"
                if k % B.block_info(use)[0]:
                    use = "f16"
                blocks = B.quantize_rows(value, use).numpy()
                qtype = gguf.GGMLQuantizationType[use.upper()]
                writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
                summary["experts"][name] = use
                if progress:
                    progress(name, use)
            else:
                data = np.asarray(t.data)
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
                summary["copied"] += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return summary
