"""``ktcore convert``: re-quantise the routed experts of a GGUF model with ktcore_llamafile's quantisers.

Layout of the output (``DIR/<stem>.<format>.gguf``, written atomically): a complete GGUF model file. Every
metadata key and every non-expert tensor is copied unchanged (quantised tensors as their raw blocks); the
routed experts (the family's ``gguf_expert_keys``: ``blk.L.ffn_{gate,up,down}_exps.weight``, or for dense
Llama the MLPs ``blk.L.ffn_*``, which ktcore runs as one expert) are written as ``--format`` blocks.
``general.file_type`` is left as it was; ``ktcore.converted_by`` marks the file as this converter's output
(the one kind of file ``--overwrite`` replaces). Rows whose length is not a multiple of the block size (e.g.
Q4_K with I = 1408) fall back to Q8_0, as llama.cpp's quantiser falls back for such rows
(``expert_block_format``). Every tensor header is written first and then the data tensor by tensor, so memory holds one layer's experts (as
float32 and as blocks) at most, whatever the model's size. Load it with
``ktcore.load_model(path, {"kt_backend": "llamafile"})``: the experts go into the backend as the file's
blocks, read from the mmap, never dequantised.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import blocks as B
from .plugin import CONVERT_FORMATS


CONVERTED_KEY = "ktcore.converted_by"  # marks a file this converter wrote: the only kind --overwrite replaces


def convert_gguf(src, out_dir, fmt: str = "q4_k", progress=None, overwrite: bool = False) -> dict:
    """Write ``out_dir/<stem>.<fmt>.gguf``. An existing file there is refused before anything is read unless it
    is an earlier output of ``ktcore convert`` and ``overwrite`` is given (``ktcore.outputs.output_path``)."""
    import gguf

    from ktcore.model.wrap import find_arch
    from ktcore.outputs import output_path
    from ktcore.weights.gguf_reader import GGUFFile, gguf_config

    if fmt not in CONVERT_FORMATS:
        raise ValueError(f"--format must be one of {', '.join(CONVERT_FORMATS)}, not {fmt!r}")
    src = Path(src)
    dst = Path(out_dir) / f"{src.stem}.{fmt}.gguf"
    summary = {"source": str(src), "output": str(dst), "format": fmt, "experts": {}, "copied": 0}
    with output_path(dst, "convert", overwrite, written_by_convert) as tmp, GGUFFile(src) as f:
        keys = find_arch(gguf_config(f)).gguf_expert_keys.values()
        experts = {key.format(layer=layer) for key in keys for layer in range(int(f.arch_meta("block_count")))}
        writer = gguf.GGUFWriter(tmp, f.architecture)
        f.copy_metadata_to(writer, skip=(CONVERTED_KEY,))  # a source that is itself an output gets a fresh mark
        writer.add_string(CONVERTED_KEY, f"ktcore convert --format {fmt}")
        # every tensor's header first, then the data one tensor at a time: one layer's blocks in memory, never all
        for name, t in f.tensors.items():
            if name in experts:
                shape = f.shape(name)
                use = expert_block_format(fmt, shape[-1])
                summary["experts"][name] = use
                blocks = (*shape[:-1], B.row_bytes(shape[-1], use))
                writer.add_tensor_info(name, blocks, np.dtype(np.uint8), int(np.prod(blocks)),
                                       raw_dtype=gguf.GGMLQuantizationType[use.upper()])
            else:
                data = np.asarray(t.data)  # a view of the mapping: nothing is read here
                writer.add_tensor_info(name, data.shape, data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
                summary["copied"] += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, t in f.tensors.items():
            if name in experts:
                use = summary["experts"][name]
                writer.write_tensor_data(B.quantize_rows(f.get(name).float(), use).numpy())
                if progress:
                    progress(name, use)
            else:
                writer.write_tensor_data(np.asarray(t.data))
        writer.close()
    return summary


def written_by_convert(path) -> bool:
    """Whether ``path`` is a GGUF this converter wrote (it carries ``CONVERTED_KEY``)."""
    import gguf

    try:
        return CONVERTED_KEY in gguf.GGUFReader(str(path)).fields
    except Exception:  # noqa: BLE001 - not a readable GGUF: not ours
        return False


def expert_block_format(fmt: str, k: int) -> str:
    """The block type rows of length ``k`` get for ``fmt``: Q8_0 where ``k`` is no multiple of the format's block
    (Q4_K's 256, e.g. DeepSeek-V2-Lite's I = 1408), as llama.cpp's quantiser falls back for such rows; F16 where
    even Q8_0's 32 does not divide it."""
    for use in (fmt, "q8_0"):
        if k % B.block_info(use)[0] == 0:
            return use
    return "f16"
