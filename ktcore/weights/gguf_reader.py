"""Reading GGUF files (llama.cpp's format), validated before use, and mapping them onto HF models.

The file is memory-mapped by ``gguf.GGUFReader``; only the header is parsed up front. Every tensor a model
needs is checked for presence and shape before a byte of weights is read, so a broken file fails with the
file and tensor name. Tensors are then read one at a time: F32/F16/BF16 straight from the mmap, quantised
types (Q4_0, Q4_1, Q8_0, Q4_K, ...) dequantised with ``gguf.quants.dequantize``, one tensor (one layer of
experts) at a time, never the whole file.

Shapes are given in torch (row-major, HF) order: GGUF stores ``ne[0]`` (the innermost dimension) first, so a
``[E, I, H]`` expert tensor is ``ne = (H, I, E)`` in the file.

GGUF -> HF naming uses gguf's own name maps (``gguf.get_tensor_name_map``), applied to the HF model's
parameter names; the few tensors llama.cpp's converter writes differently are handled explicitly:

* ``llama`` (and Mixtral, written as ``llama`` with ``expert_count > 0``): the converter permutes the rows of
  ``attn_q``/``attn_k`` for its rope layout; loading inverts the permutation.
* ``deepseek2``: newer converters split ``kv_b_proj`` into ``attn_k_b`` (transposed) and ``attn_v_b`` for
  MLA absorption; loading merges them back (older files carry ``attn_kv_b`` as is).
* dense MLPs in layers of MoE families that llama.cpp's arch tables lack (``mlp_only_layers``) are read from
  ``blk.L.ffn_{gate,up,down}``; ``e_score_correction_bias`` is ``blk.L.exp_probs_b.bias``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from .safetensors_reader import CheckpointError

GGUF_MAGIC = b"GGUF"
EXPERT_KEYS = {"gate": "blk.{layer}.ffn_gate_exps.weight", "up": "blk.{layer}.ffn_up_exps.weight",
               "down": "blk.{layer}.ffn_down_exps.weight"}
DENSE_KEYS = {"gate": "blk.{layer}.ffn_gate.weight", "up": "blk.{layer}.ffn_up.weight",
              "down": "blk.{layer}.ffn_down.weight"}
# GGUF general.architecture -> what ktcore builds from it
SUPPORTED_ARCHS = ("llama", "qwen2moe", "qwen3moe", "deepseek2")
# tensors llama.cpp's arch tables do not list for the family but that our HF models have
_FALLBACK = {
    r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight": r"blk.\1.ffn_\2.weight",
    r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias": r"blk.\1.exp_probs_b.bias",
}


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
            self.reader = gguf.GGUFReader(self.path)
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

    def copy_metadata_to(self, writer) -> None:
        """Every metadata field (tokenizer included) onto a ``gguf.GGUFWriter`` made for this architecture."""
        gguf = _gguf()
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these itself
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


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's rope permutation of q/k rows: per head, rows (pairs interleaved) -> halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFWeights:
    """The tensors of a GGUF file under the HF model's names (what ``load_model`` asks for)."""

    def __init__(self, file: GGUFFile, model, arch):
        gguf = _gguf()
        self.file, self.arch = file, arch
        self.config = model.config.get_text_config()
        name = file.architecture
        gguf_arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name), None)
        if gguf_arch is None:
            raise CheckpointError(f"{file.path}: the installed gguf package does not know architecture {name!r}; "
                                  "upgrade it (pip install -U gguf)")
        name_map = gguf.get_tensor_name_map(gguf_arch, self.config.num_hidden_layers)
        self.permute = name == "llama"
        self.names = {}  # HF name -> GGUF name (or a ("kv_b", k_b, v_b) triple)
        for hf_name, _ in [*model.named_parameters(), *model.named_buffers()]:
            target = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if target is None:
                for pattern, repl in _FALLBACK.items():
                    if re.fullmatch(pattern, hf_name):
                        target = re.sub(pattern, repl, hf_name)
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
        expert = re.compile(r"blk\.\d+\.ffn_(gate|up|down)(_exps)?\.weight$")
        unused = sorted(n for n in self.file.keys() if n not in used and not expert.match(n))
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
        if self.permute and re.search(r"\.attn_(q|k)\.weight$", target):
            heads = self.config.num_attention_heads if ".attn_q." in target else self.config.num_key_value_heads
            value = _unpermute(value, heads)
        return value

    def experts(self, layer: int, module) -> "GGUFExpertSource":
        return GGUFExpertSource(self.file, self.arch, layer, module)


class GGUFExpertSource:
    """One layer's routed experts (``blk.L.ffn_*_exps``) or dense MLP (``blk.L.ffn_*``), validated."""

    def __init__(self, file: GGUFFile, arch, layer: int, module):
        self.file, self.layer = file, layer
        self.dense = arch.dense_mlp
        if self.dense:
            self.num_experts = 1
            inter, hidden = module.gate_proj.weight.shape
            keys = DENSE_KEYS
        else:
            self.num_experts, rows, cols = module.gate_up_proj.shape
            transposed = getattr(module, "is_transposed", False)
            hidden, inter = (rows, cols // 2) if transposed else (cols, rows // 2)
            keys = EXPERT_KEYS
        self.keys = {p: k.format(layer=layer) for p, k in keys.items()}
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        self.shapes = {p: s if self.dense else (self.num_experts, *s) for p, s in shapes.items()}
        for part in ("gate", "up", "down"):
            file.expect(self.keys[part], self.shapes[part], f" (routed experts of layer {layer})")

    def read(self, dtype):
        from ..experts import ExpertWeights

        parts = {}
        for part in ("gate", "up", "down"):
            value = self.file.get(self.keys[part]).to(dtype)
            parts[part] = value.unsqueeze(0) if self.dense else value
        return ExpertWeights(parts["gate"], parts["up"], parts["down"])


# ---- HF config from GGUF metadata --------------------------------------------------------------------


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


def _common(file: GGUFFile) -> dict:
    m = file.arch_meta
    heads = int(m("attention.head_count"))
    return dict(vocab_size=file.shape("token_embd.weight")[0], hidden_size=int(m("embedding_length")),
                num_hidden_layers=int(m("block_count")), num_attention_heads=heads,
                num_key_value_heads=int(m("attention.head_count_kv", heads)),
                max_position_embeddings=int(m("context_length", 4096)),
                rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
                tie_word_embeddings="output.weight" not in file, rope_parameters=_rope(file), **_tokens(file))


def _mixtral_config(file: GGUFFile):
    from transformers import MixtralConfig

    m = file.arch_meta
    return MixtralConfig(**_common(file), intermediate_size=int(m("expert_feed_forward_length", 0) or
                                                               m("feed_forward_length")),
                         num_local_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
                         architectures=["MixtralForCausalLM"])


def _deepseek_config(file: GGUFFile):
    from transformers import DeepseekV2Config, DeepseekV3Config

    m = file.arch_meta
    common = _common(file)
    rope_dim = int(m("rope.dimension_count"))
    key_length = int(m("attention.key_length_mla", 0) or m("attention.key_length"))
    value_length = int(m("attention.value_length_mla", 0) or m("attention.value_length"))
    n_group = int(m("expert_group_count", 1) or 1)
    kwargs = dict(common, intermediate_size=int(m("feed_forward_length")),
                  moe_intermediate_size=int(m("expert_feed_forward_length")),
                  n_routed_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
                  n_shared_experts=int(m("expert_shared_count", 0)),
                  first_k_dense_replace=int(m("leading_dense_block_count", 0)),
                  kv_lora_rank=int(m("attention.kv_lora_rank")), q_lora_rank=int(m("attention.q_lora_rank", 0)) or None,
                  qk_rope_head_dim=rope_dim, qk_nope_head_dim=key_length - rope_dim, v_head_dim=value_length,
                  n_group=n_group, topk_group=int(m("expert_group_used_count", 1) or 1),
                  routed_scaling_factor=float(m("expert_weights_scale", 1.0)),
                  norm_topk_prob=bool(m("expert_weights_norm", False)))
    sigmoid = int(m("expert_gating_func", 1) or 1) == 2 or "blk.{}.exp_probs_b.bias".format(
        kwargs["first_k_dense_replace"]) in file
    if sigmoid:
        return DeepseekV3Config(**kwargs, architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV2Config(**kwargs, topk_method="group_limited_greedy" if n_group > 1 else "greedy",
                            architectures=["DeepseekV2ForCausalLM"])


def _transformers_config(file: GGUFFile):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(file.path.parent, gguf_file=file.path.name)
    if file.architecture in ("qwen2moe", "qwen3moe"):
        n = cfg.num_hidden_layers
        dense = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in file]
        cfg.mlp_only_layers = dense
        cfg.decoder_sparse_step = 1
        expert_ff = file.arch_meta("expert_feed_forward_length")
        if expert_ff:
            cfg.moe_intermediate_size = int(expert_ff)
        if file.architecture == "qwen2moe":
            shexp = file.arch_meta("expert_shared_feed_forward_length")
            if shexp:
                cfg.shared_expert_intermediate_size = int(shexp)
        # llama.cpp normalises the top-k weights of qwen3moe and not of qwen2moe unless the file says otherwise
        cfg.norm_topk_prob = bool(file.arch_meta("expert_weights_norm", file.architecture == "qwen3moe"))
        key_length = file.arch_meta("attention.key_length")
        if key_length and hasattr(cfg, "head_dim"):
            cfg.head_dim = int(key_length)
    cfg.tie_word_embeddings = "output.weight" not in file
    return cfg


def gguf_config(file: GGUFFile):
    """The HF config of a GGUF file: transformers' own GGUF config loading where it handles the architecture,
    a small explicit mapping of the metadata keys otherwise (deepseek2, llama with experts = Mixtral)."""
    arch = file.architecture
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{file.path}: GGUF architecture {arch!r} is not supported; ktcore loads "
                              f"{', '.join(SUPPORTED_ARCHS)}")
    try:
        if arch == "deepseek2":
            return _deepseek_config(file)
        if arch == "llama" and int(file.arch_meta("expert_count", 0) or 0) > 0:
            return _mixtral_config(file)
        return _transformers_config(file)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{file.path}: cannot build a {arch} config from the GGUF metadata ({exc})") from exc
