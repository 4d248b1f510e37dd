"""``ktcore export``: base model + LoRA adapter merged into a standalone safetensors model.

The result is an ordinary Hugging Face model directory (config, tokenizer files, safetensors shards and an index)
that plain ``AutoModelForCausalLM.from_pretrained`` loads. It is streamed: base tensors are read from the
checkpoint one at a time, the LoRA delta ``scaling * B @ A`` (computed in fp32) is added to the tensors it
targets, and shards are written as they fill, so host memory stays near one shard plus one tensor however big
the model is. Routed experts keep the checkpoint's own layout (per-expert ``experts.N.gate_proj.weight`` keys or
the fused ``gate_up_proj``). Everything is written into a temp directory that is put in place when done
(``ktcore.outputs.output_path``: never over a directory ktcore's export did not write).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..adapters import load
from ..adapters.canonical import AdapterError, layer_of
from ..files import atomic_write_bytes, fault_point
from ..outputs import output_path

SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def _plan(adapter, arch, ckpt, names: dict, meta_model) -> dict:
    """checkpoint key -> function returning the fp32 delta for that tensor; every LoRA pair must land."""
    import torch

    scaling = adapter.scaling
    plan = {}
    for module, (a, b) in adapter.linear.items():
        key = names.get(f"{module}.weight")
        if key is None:
            raise AdapterError(f"LoRA on {module}: the base checkpoint has no {module}.weight (other base model, or "
                               "a tied embedding)")
        plan[key] = lambda a=a, b=b: scaling * (b.float() @ a.float())
    for module, parts in adapter.experts.items():
        layer = layer_of(module)
        experts = meta_model.get_submodule(module)
        transposed = getattr(experts, "is_transposed", False)
        concatenated = getattr(experts, "is_concatenated", True)
        per_expert = arch.expert_keys and arch.expert_keys["gate"].format(layer=layer, expert=0) in ckpt
        for part, (a, b) in parts.items():
            def full(a=a, b=b):
                return scaling * torch.bmm(b.float(), a.float())  # [E, out, in]
            if per_expert:
                num_experts, inter = a.shape[0], b.shape[1] // 2
                rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)} if part == "gate_up" \
                    else {"down": slice(None)}
                for proj, sl in rows.items():
                    for e in range(num_experts):
                        key = arch.expert_keys[proj].format(layer=layer, expert=e)
                        if key not in ckpt:
                            raise AdapterError(f"expert LoRA on {module}: the checkpoint has no {key}")
                        plan[key] = lambda a=a, b=b, e=e, sl=sl: scaling * (b[e, sl].float() @ a[e].float())
            elif arch.fused_expert_keys:
                key = arch.fused_expert_keys[part].format(layer=layer)
                if key not in ckpt:
                    raise AdapterError(f"expert LoRA on {module}: the checkpoint has no {key}")

                def fused(full=full, part=part):
                    d = full()
                    if part == "gate_up" and not concatenated:  # interleaved [g0, u0, g1, u1, ...] rows
                        inter = d.shape[1] // 2
                        d = torch.stack([d[:, :inter], d[:, inter:]], 2).reshape(d.shape)
                    return d.transpose(1, 2) if transposed else d
                plan[key] = fused
            else:
                raise AdapterError(f"expert LoRA on {module}: no expert tensors for layer {layer} in the checkpoint")
    return plan


def export_merged(cfg, out, *, max_shard_bytes: int = 2 << 30, base=None, overwrite: bool = False) -> dict:
    """Merge ``cfg.adapter_name_or_path`` into ``cfg.model_name_or_path`` and write the model to ``out``
    (an earlier export there is replaced only with ``overwrite``)."""
    from ..config import ConfigError, resolve_model_path

    # the config's mistakes first, one line each before torch or transformers is imported
    if not cfg.adapter_name_or_path:
        raise ConfigError(f"{cfg.where}: adapter_name_or_path is required (the adapter to merge)")
    base = Path(base) if base is not None else resolve_model_path(cfg)
    if base.suffix.lower() == ".gguf" or not (base / "config.json").is_file():
        raise ConfigError(f"{base}: export needs a safetensors model directory with config.json (GGUF bases are not "
                          "supported for export)")
    out = Path(out)
    if out.resolve() == base.resolve():
        raise ConfigError(f"--out {out} is the base model directory; choose another directory")

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.wrap import find_arch
    from ..weights.safetensors_reader import SafetensorsCheckpoint, checkpoint_names

    adapter = load(cfg.adapter_name_or_path, base=base)
    hf_config = AutoConfig.from_pretrained(base)
    arch = find_arch(hf_config)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    config_json = json.loads((base / "config.json").read_text(encoding="utf-8"))
    quant = config_json.pop("quantization_config", None)
    fp8_block = tuple((quant or {}).get("weight_block_size") or (128, 128))
    dense_dtype = getattr(torch, str(config_json.get("dtype") or config_json.get("torch_dtype") or "float32"))

    written, merged = 0, 0
    with SafetensorsCheckpoint(base, fp8_block) as ckpt, output_path(out, "export", overwrite) as tmp:
        tmp.mkdir()
        plan = _plan(adapter, arch, ckpt, checkpoint_names(ckpt, arch), meta_model)
        shards, shard, shard_bytes, index = [], {}, 0, {}

        def flush():
            nonlocal shard, shard_bytes
            if shard:
                name = f".shard-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                shards.append((name, list(shard)))
                shard, shard_bytes = {}, 0

        for key in list(ckpt.keys()):
            if quant and key.endswith("_scale_inv"):
                continue  # FP8 block scales: the weights come back dequantised
            tensor = ckpt.get(key)
            if tensor.dtype == torch.float32 and quant:
                tensor = tensor.to(dense_dtype)
            if key in plan:
                delta = plan.pop(key)()
                if tuple(delta.shape) != tuple(tensor.shape):
                    raise AdapterError(f"LoRA delta for {key} has shape {list(delta.shape)}, the base tensor "
                                       f"{list(tensor.shape)} (other base model?)")
                tensor = (tensor.float() + delta).to(tensor.dtype)
                merged += 1
            tensor = tensor.contiguous()
            if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
                flush()
            shard[key] = tensor
            shard_bytes += tensor.nbytes
            written += tensor.nbytes
            del tensor
        flush()
        if plan:
            raise AdapterError(f"LoRA targets not found in the checkpoint: {sorted(plan)[:5]}")
        final = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for (name, keys), target in zip(shards, final):
            (tmp / name).rename(tmp / target)
            fault_point("export:shard-renamed")
            index.update({k: target for k in keys})
        if len(shards) > 1:
            atomic_write_bytes(tmp / "model.safetensors.index.json", json.dumps(
                {"metadata": {"total_size": written}, "weight_map": index}, indent=2).encode())
        for f in sorted(base.iterdir()):
            if f.is_file() and not f.name.endswith(SKIP_SUFFIXES) and f.name != "model.safetensors.index.json" \
                    and f.name != "config.json" and not f.name.startswith("."):
                shutil.copy2(f, tmp / f.name)
        atomic_write_bytes(tmp / "config.json", json.dumps(config_json, indent=2).encode())
    return {"out": str(out), "base": str(base), "adapter": str(cfg.adapter_name_or_path), "tensors_merged": merged,
            "shards": len(shards), "bytes": written}
