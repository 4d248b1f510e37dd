"""The standard PEFT LoRA directory: adapter_config.json + adapter_model.safetensors.

Expert LoRA is in PEFT's own ``target_parameters`` layout, so the directory loads in plain
``PeftModel.from_pretrained`` on plain transformers. The reading and writing live in ``ktcore.adapters``.
"""

from __future__ import annotations

from pathlib import Path

from ktcore import adapters as core


class Format:
    name = "peft"

    def sniff(self, path) -> bool:
        path = Path(path)
        return path.is_dir() and (path / core.PEFT_CONFIG).is_file() and \
            not (path / "kt_adapter_manifest.json").exists()

    def save(self, adapter: core.Adapter, dst, base=None) -> Path:
        return core.write_peft_dir(adapter, dst)

    def load(self, path, base=None) -> core.Adapter:
        adapter = core.read_peft_dir(path)
        adapter.check()
        return adapter

    def verify(self, path, base=None) -> list[str]:
        path = core.local_adapter_path(path)
        adapter = self.load(path)
        checks = [f"{core.PEFT_CONFIG}: LoRA, r={adapter.r}, lora_alpha={adapter.alpha:g}, no DoRA/rsLoRA/"
                  "rank or alpha patterns",
                  f"{core.PEFT_WEIGHTS}: {len(adapter.linear)} linear LoRA pairs, {len(adapter.experts)} expert "
                  f"modules, every pair rank {adapter.r} with consistent shapes"]
        base_path = core.resolve_base(adapter.base_model, base)
        if base_path is not None:
            checks.append(check_against_base(adapter, base_path))
        return checks


def check_against_base(adapter: core.Adapter, base) -> str:
    """Every LoRA pair fits a tensor of the base model (shapes from its config, built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = Path(base)
    if base.suffix.lower() == ".gguf":
        return f"base {base}: GGUF base, shapes not checked"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    params = dict(model.named_parameters())
    for name, a, b in adapter.tensors():
        if isinstance(name, tuple):
            module, part = name
            weight = params.get(f"{module}.{core.EXPERT_PARAMS[part]}")
            want = None if weight is None else tuple(weight.shape)
            got = (a.shape[0], b.shape[1], a.shape[2])
        else:
            weight = params.get(f"{name}.weight")
            want = None if weight is None else tuple(weight.shape)
            got = (b.shape[0], a.shape[1])
        if want is None:
            raise core.AdapterError(f"LoRA on {name}: the base model {base} has no such weight (other base model?)")
        if tuple(got) != want:
            raise core.AdapterError(f"LoRA on {name}: delta shape {list(got)} does not match the base weight "
                                    f"{list(want)} of {base} (other base model?)")
    return f"base {base}: every LoRA pair matches a base weight's shape"
