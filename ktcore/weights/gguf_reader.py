"""Reading GGUF files (llama.cpp's format), validated before use, and mapping them onto HF models.

The file is memory-mapped by ``gguf.GGUFReader``; only the header is parsed up front. Every tensor a model
needs is checked for presence and shape before a byte of weights is read, so a broken file fails with the
file and tensor name. Tensors are then read one at a time: F32/F16/BF16 straight from the mmap, quantised
types (Q4_0, Q4_1, Q8_0, Q4_K, ...) dequantised with ``gguf.quants.dequantize``, one tensor (one layer of
experts) at a time, never the whole file.

Shapes are given in torch (row-major, HF) order: GGUF stores ``ne[0]`` (the innermost dimension) first, so a
``[E, I, H]`` expert tensor is ``ne = (H, I, E)`` in the file.

What is particular to a model family comes from its architecture plugin (``ktcore.specs.ArchSpec``): the
GGUF architecture it is written under, the function building its transformers config, the names of its
experts, the tensors gguf's own name maps (``gguf.get_tensor_name_map``) lack, and whether llama.cpp's
converter permuted the rows of ``attn_q``/``attn_k`` for its rope (loading inverts it). One convention is
llama.cpp's for every family: newer converters split MLA's ``kv_b_proj`` into ``attn_k_b`` (transposed) and
``attn_v_b`` for absorption; loading merges them back (older files carry ``attn_kv_b`` as is).
"""

from __future__ import annotations

import functools
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from ..experts import ExpertWeights
from ..plugins import get_registry
from ..specs import ArchSpec, import_object

GGUF_MAGIC = b"GGUF"


@functools.lru_cache(maxsize=None)
def _plain_reader_class(gguf):
    """``gguf.GGUFReader`` over a plain ndarray view of its ``np.memmap``, cutting metadata arrays in one pass.

    The reader slices its buffer a few times per metadata element (SmolLM2-135M: ~590,000 parts, most of them
    the tokenizer's 49,152 tokens and 48,900 merges). On an ``np.memmap`` every slice goes through memmap's
    Python-level ``__getitem__``/``__array_finalize__``: 2.8-4.1 s per parse of a 100 MB file on the 2-core
    host, 0.65-0.75 s on the plain view (benchmarks/RESULTS.md, "ktcore chat: load time"). The view keeps the
    memmap (and so the mapping) alive through its ``base``. An array of strings or numbers (in the host's byte
    order) is then cut into the very parts gguf's reader makes, with one slice per part instead of its several
    numpy calls each (tests/test_gguf.py compares every part)."""
    value_type = gguf.GGUFValueType

    class PlainViewGGUFReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != value_type.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            data = self._plain_data
            item_type = data[orig_offs:orig_offs + 4].view(np.uint32)
            count = data[orig_offs + 4:orig_offs + 12].view(np.uint64)
            item, n = value_type(int(item_type[0])), int(count[0])
            parts, offs = [item_type, count], orig_offs + 12
            if item == value_type.STRING:  # per string: its uint64 length, then its bytes (the data part)
                buffer = memoryview(data)
                for _ in range(n):
                    length = struct.unpack_from("=Q", buffer, offs)[0]
                    parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + length])
                    offs += 8 + length
                indices = list(range(3, 2 + 2 * n, 2))
            elif item in self.gguf_scalar_to_np:  # per number: a one-element array
                number = np.dtype(self.gguf_scalar_to_np[item])
                values = data[offs:offs + n * number.itemsize].view(number)
                parts += [values[i:i + 1] for i in range(n)]
                offs += values.nbytes
                indices = list(range(2, 2 + n))
            else:  # arrays of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, parts, indices, [value_type.ARRAY] + ([item] if n else [])

    return PlainViewGGUFReader


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("reading GGUF files needs the gguf package: pip install 'ktcore[gguf]'") from exc
    return gguf


class GGUFFile:
    """One memory-mapped GGUF file: metadata, tensor shapes (torch order) and tensors."""

    def __init__(self, path):
        gguf = _gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            self.reader = _plain_reader_class(gguf)(self.path)
        except Exception as exc:  # noqa: BLE001 - the reader raises ValueError/IndexError on short files
            raise CheckpointError(f"{self.path}: unreadable or truncated GGUF file ({exc}); download it again") from exc
        size = self.path.stat().st_size
        self.tensors = {}
        for t in self.reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise CheckpointError(f"{self.path}: truncated ({size} bytes); tensor {t.name!r} needs bytes up to "
                                      f"{int(t.data_offset) + int(t.n_bytes)}; download it again")
            self.tensors[t.name] = t

    # ---- metadata ------------------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @property
    def architecture(self) -> str:
        arch = self.meta("general.architecture")
        if arch is None:
            raise CheckpointError(f"{self.path}: no general.architecture in the GGUF metadata")
        return arch

    def arch_meta(self, key: str, default=None):
        """``{arch}.key`` metadata, e.g. ``arch_meta("expert_count")``."""
        return self.meta(f"{self.architecture}.{key}", default)

    @property
    def metadata(self) -> dict:
        """Every metadata value except the (large) tokenizer arrays."""
        return {k: self.meta(k) for k in self.reader.fields
                if not k.startswith("GGUF.") and not (k.startswith("tokenizer.ggml.") and
                                                       k.rsplit(".", 1)[1] in ("tokens", "scores", "token_type",
                                                                               "merges"))}

    def copy_metadata_to(self, writer, skip: tuple[str, ...] = ()) -> None:
        """Every metadata field (tokenizer included) but those named in ``skip`` onto a ``gguf.GGUFWriter`` made
        for this architecture."""
        gguf = _gguf()
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture" or key in skip:  # the writer writes these
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)

    # ---- tensors -------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def shape(self, name: str) -> tuple:
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def expect(self, name: str, shape: tuple, what: str = "") -> None:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r}{what} is missing from the GGUF file")
        got = self.shape(name)
        if got != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r}{what} has shape {list(got)}, the model needs "
                                  f"{list(shape)}; the GGUF file does not match its metadata")

    def get(self, name: str) -> torch.Tensor:
        """The tensor in torch order, as an owned tensor (float types as stored, quantised ones as fp32)."""
        gguf = _gguf()
        t = self.tensors[name]
        shape = self.shape(name)
        qtype = t.tensor_type
        try:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                out = torch.from_numpy(np.array(t.data, copy=True))
            elif qtype == gguf.GGMLQuantizationType.BF16:
                out = torch.from_numpy(np.array(t.data, copy=True).view(np.int16)).view(torch.bfloat16)
            elif qtype in (gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16,
                           gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64,
                           gguf.GGMLQuantizationType.F64):
                out = torch.from_numpy(np.array(t.data, copy=True))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, qtype)))
            return out.reshape(shape)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r} ({qtype.name}: {exc})") from exc

    def close(self) -> None:
        self.tensors = {}
        self.reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- GGUF -> HF --------------------------------------------------------------------------------------


def rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's rope row order of q/k weights: per head, rows in halves -> rows in interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of ``rope_permute``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def is_rope_permuted(arch: ArchSpec, gguf_name: str) -> bool:
    """Whether llama.cpp's converter permuted the rows of this tensor of the family ``arch``."""
    return arch.gguf_rope_permuted and re.search(r"\.attn_(q|k)\.weight$", gguf_name) is not None


class GGUFNames:
    """Model tensor name -> GGUF tensor name for the family ``arch``: gguf's own name map for its GGUF
    architecture, then the family's ``gguf_extra_names``."""

    def __init__(self, arch: ArchSpec, num_layers: int, where):
        gguf = _gguf()
        enum = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch.gguf_architecture), None)
        if enum is None:
            raise CheckpointError(f"{where}: the installed gguf package does not know architecture "
                                  f"{arch.gguf_architecture!r}; upgrade it (pip install -U gguf)")
        self.name_map = gguf.get_tensor_name_map(enum, num_layers)
        self.extra = arch.gguf_extra_names

    def __call__(self, name: str):
        target = self.name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        for pattern, replacement in self.extra:
            if target is None and re.fullmatch(pattern, name):
                target = re.sub(pattern, replacement, name)
        return target


class GGUFWeights:
    """The tensors of a GGUF file under the HF model's names (what ``load_model`` asks for)."""

    def __init__(self, file: GGUFFile, model, arch: ArchSpec):
        self.file, self.arch = file, arch
        self.config = model.config.get_text_config()
        gguf_name = GGUFNames(arch, self.config.num_hidden_layers, file.path)
        self.names = {}  # HF name -> GGUF name (or a ("kv_b", k_b, v_b) triple)
        for hf_name, _ in [*model.named_parameters(), *model.named_buffers()]:
            target = gguf_name(hf_name)
            if target is None:
                continue
            if target.endswith(".attn_kv_b.weight") and target not in file and \
                    target.replace("attn_kv_b", "attn_k_b") in file:
                target = ("kv_b", target.replace("attn_kv_b", "attn_k_b"), target.replace("attn_kv_b", "attn_v_b"))
            self.names[hf_name] = target
        self._warn_unused()

    def _warn_unused(self) -> None:
        used = set()
        for target in self.names.values():
            used.update(target[1:] if isinstance(target, tuple) else (target,))
        experts = re.compile("|".join(re.escape(k).replace(re.escape("{layer}"), r"\d+")
                                      for k in self.arch.gguf_expert_keys.values()))
        unused = sorted(n for n in self.file.keys() if n not in used and not experts.fullmatch(n))
        if unused:
            warnings.warn(f"{self.file.path}: {len(unused)} GGUF tensor(s) have no place in the "
                          f"{self.arch.name} model and are ignored: {', '.join(unused[:8])}"
                          f"{' ...' if len(unused) > 8 else ''}", stacklevel=3)

    def __contains__(self, name: str) -> bool:
        target = self.names.get(name)
        if isinstance(target, tuple):
            return all(t in self.file for t in target[1:])
        return target is not None and target in self.file

    def describe(self, name: str) -> str:
        target = self.names.get(name)
        if target is None:
            return " (no GGUF name for it)"
        return f" (GGUF {' + '.join(target[1:]) if isinstance(target, tuple) else target})"

    def _kv_b_shapes(self):
        c = self.config
        return ((c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim),
                (c.num_attention_heads, c.v_head_dim, c.kv_lora_rank))

    def expect(self, name: str, shape: tuple) -> None:
        target = self.names[name]
        what = f" ({name})"
        if isinstance(target, tuple):
            for key, want in zip(target[1:], self._kv_b_shapes()):
                self.file.expect(key, want, what)
            return
        got = self.file.shape(target) if target in self.file else None
        if got is not None and got != tuple(shape) and [d for d in got if d != 1] == [d for d in shape if d != 1]:
            return  # e.g. Qwen2-MoE's shared_expert_gate: [H] in GGUF, [1, H] in HF
        self.file.expect(target, shape, what)

    def get(self, name: str) -> torch.Tensor:
        target = self.names[name]
        if isinstance(target, tuple):  # [H, kv_lora, nope] and [H, v, kv_lora] -> [H * (nope + v), kv_lora]
            k_b, v_b = self.file.get(target[1]), self.file.get(target[2])
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
            return kv_b.reshape(-1, kv_b.shape[-1])
        value = self.file.get(target)
        if is_rope_permuted(self.arch, target):
            heads = self.config.num_attention_heads if ".attn_q." in target else self.config.num_key_value_heads
            value = rope_unpermute(value, heads)
        return value

    def experts(self, layer: int, module) -> "GGUFExpertSource":
        return GGUFExpertSource(self.file, self.arch, layer, module)


class GGUFExpertSource:
    """One layer's routed experts (``blk.L.ffn_*_exps``) or dense MLP (``blk.L.ffn_*``), validated."""

    def __init__(self, file: GGUFFile, arch: ArchSpec, layer: int, module):
        self.file, self.layer = file, layer
        self.dense = arch.dense_mlp
        if self.dense:
            self.num_experts = 1
            inter, hidden = module.gate_proj.weight.shape
        else:
            self.num_experts, rows, cols = module.gate_up_proj.shape
            transposed = getattr(module, "is_transposed", False)
            hidden, inter = (rows, cols // 2) if transposed else (cols, rows // 2)
        self.keys = {p: k.format(layer=layer) for p, k in arch.gguf_expert_keys.items()}
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        self.shapes = {p: s if self.dense else (self.num_experts, *s) for p, s in shapes.items()}
        for part in ("gate", "up", "down"):
            file.expect(self.keys[part], self.shapes[part], f" (routed experts of layer {layer})")

    def read(self, dtype) -> ExpertWeights:
        parts = {}
        for part in ("gate", "up", "down"):
            value = self.file.get(self.keys[part]).to(dtype)
            parts[part] = value.unsqueeze(0) if self.dense else value
        return ExpertWeights(parts["gate"], parts["up"], parts["down"])


# ---- HF config from GGUF metadata (the families' builders use these) -------------------------------------


def _tokens(file: GGUFFile) -> dict:
    out = {}
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        value = file.meta(f"tokenizer.ggml.{key}")
        if value is not None:
            out[hf] = int(value)
    return out


def _rope(file: GGUFFile) -> dict:
    params = {"rope_type": "default", "rope_theta": float(file.arch_meta("rope.freq_base", 10000.0))}
    kind = file.arch_meta("rope.scaling.type")
    if kind == "yarn":  # DeepSeek's YaRN; llama.cpp keeps one mscale (yarn_log_multiplier = 0.1 * mscale_all_dim)
        mscale = float(file.arch_meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        params.update(rope_type="yarn", factor=float(file.arch_meta("rope.scaling.factor", 1.0)),
                      original_max_position_embeddings=int(file.arch_meta("rope.scaling.original_context_length")),
                      mscale=mscale, mscale_all_dim=mscale, beta_fast=32.0, beta_slow=1.0)
    elif kind == "linear":
        params.update(rope_type="linear", factor=float(file.arch_meta("rope.scaling.factor", 1.0)))
    elif kind not in (None, "none"):
        raise CheckpointError(f"{file.path}: rope scaling {kind!r} is not supported for GGUF loading yet")
    return params


def common_config_kwargs(file: GGUFFile) -> dict:
    """The transformers config keys every decoder family shares (sizes, heads, norms, rope, special tokens)."""
    m = file.arch_meta
    heads = int(m("attention.head_count"))
    return dict(vocab_size=file.shape("token_embd.weight")[0], hidden_size=int(m("embedding_length")),
                num_hidden_layers=int(m("block_count")), num_attention_heads=heads,
                num_key_value_heads=int(m("attention.head_count_kv", heads)),
                max_position_embeddings=int(m("context_length", 4096)),
                rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
                tie_word_embeddings="output.weight" not in file, rope_parameters=_rope(file), **_tokens(file))


def transformers_config(file: GGUFFile):
    """transformers' own config loading of a GGUF file (the architectures it supports)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(file.path.parent, gguf_file=file.path.name)
    cfg.tie_word_embeddings = "output.weight" not in file
    return cfg


def gguf_config(file: GGUFFile):
    """The HF config of a GGUF file, from the architecture plugins written under its GGUF architecture (the
    first whose ``gguf_config`` recognises the file)."""
    archs = get_registry().specs("arch").values()
    arch = file.architecture
    builders = list(dict.fromkeys(s.gguf_config for s in archs if s.gguf_architecture == arch and s.gguf_config))
    if not builders:
        known = sorted({s.gguf_architecture for s in archs if s.gguf_config})
        raise CheckpointError(f"{file.path}: GGUF architecture {arch!r} is not supported; ktcore loads "
                              f"{', '.join(known)} (see `ktcore list-archs`)")
    for ref in builders:
        try:
            config = import_object(ref)(file)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{file.path}: cannot build a {arch} config from the GGUF metadata ({exc})") from exc
        if config is not None:
            return config
    raise CheckpointError(f"{file.path}: no architecture plugin recognises this {arch} file")
