"""Issue 20 items 4, 6, 7: every bad input is one line on stderr with exit code 2, found from the YAML, the dataset
headers and the checkpoint headers before any weight is read.

"No weight read" is checked without mocks: the model directory the commands get has the demo model's config and
tokenizer but garbage bytes in place of its safetensors, so anything that read a weight (or even a weight
file's header) would fail with "unreadable safetensors file" instead of the expected line.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from test_adapters import _rewrite_gguf, strip_offsets

from ktcore import adapters as core
from ktcore.commands.cli import main

pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The demo's tiny model, data and YAML; a copy of the model with garbage weights; adapters made for it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ktcore.commands.demo import build_demo_files

    root = tmp_path_factory.mktemp("bad_inputs")
    files = build_demo_files(root / "demo", steps=2, n_train=8, n_test=1, kt_config={"kt_backend": "torch"})
    model_dir = files["model_dir"]
    garbage = root / "garbage_model"
    shutil.copytree(model_dir, garbage)
    for f in garbage.glob("*.safetensors"):
        f.write_bytes(os.urandom(f.stat().st_size))
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)  # non-zero, as after training
    peft_model.peft_config["default"].base_model_name_or_path = str(model_dir)
    peft_model.save_pretrained(root / "plain_peft")
    peft = Path(core.convert(root / "plain_peft", root / "peft", "peft")["dst"])  # written by ktcore
    fused = Path(core.convert(peft, root / "fused", "fused_expert")["dst"])
    gguf_adapter = Path(core.convert(peft, root / "adapter.gguf", "gguf", base=model_dir)["dst"])
    return {"root": root, "config": files["config"], "model": model_dir, "garbage": garbage, "peft": peft,
            "fused": fused, "gguf": gguf_adapter, "data": files["data_dir"]}


def _copy(world, name, tmp_path) -> Path:
    src = world[name]
    dst = tmp_path / src.name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def _json_edit(path: Path, change):
    data = json.loads(path.read_text())
    data = change(data) or data
    path.write_text(json.dumps(data))


def _peft_variant(world, tmp_path, change) -> str:
    d = _copy(world, "peft", tmp_path)
    (d / "kt_integrity.json").unlink()  # as another tool writes it: only the content checks can refuse it
    change(d)
    return f"adapter_name_or_path={d}"


def _fused_variant(world, tmp_path, change) -> str:
    d = _copy(world, "fused", tmp_path)
    change(d)
    return f"adapter_name_or_path={d}"


def _gguf_tmap_not_json(world, tmp_path) -> str:
    out = _rewrite_gguf(world["gguf"], tmp_path / "a.gguf", meta={"ktcore.adapter.tensor_map": "{blk"},
                        drop=("ktcore.adapter.integrity",))
    return f"adapter_name_or_path={out}"


def _dataset_outside(world, tmp_path) -> str:
    data = tmp_path / "data"
    shutil.copytree(world["data"], data)
    _json_edit(data / "dataset_info.json", lambda info: info["reverse"].update(file_name="../../../etc/passwd"))
    return f"dataset_dir={data}"


def _pickle_adapter(world, tmp_path) -> str:
    d = _copy(world, "peft", tmp_path)
    state = load_file(d / "adapter_model.safetensors")
    torch.save(state, d / "adapter_model.bin")  # what save_pretrained(safe_serialization=False) writes
    (d / "adapter_model.safetensors").unlink()
    (d / "kt_integrity.json").unlink()
    return f"adapter_name_or_path={d}"


def _output_file(world, tmp_path) -> str:
    (tmp_path / "out").write_text("not a directory")
    return f"output_dir={tmp_path / 'out'}"


def _partial_gguf_model(world, tmp_path) -> str:
    from archs import tiny_model
    from test_gguf import write_gguf

    full = tmp_path / "model.gguf"
    write_gguf(tiny_model("qwen3_moe"), "qwen3_moe", full)
    part = tmp_path / "partial.gguf"
    part.write_bytes(full.read_bytes()[: full.stat().st_size * 2 // 3])  # what a killed `ktcore convert` left
    return f"model_name_or_path={part}"


def _config_not_json(world, tmp_path) -> str:
    model = tmp_path / "model"
    shutil.copytree(world["garbage"], model)
    (model / "config.json").write_text('{"model_type": "qwen3_moe",')
    return f"model_name_or_path={model}"


def _model_without_offsets(world, tmp_path) -> str:
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    strip_offsets(model / "model.safetensors")
    return f"model_name_or_path={model}"


# (command, overrides: literal "KEY=VALUE"s or functions (world, tmp_path) -> "KEY=VALUE", expected in the line)
CASES = {
    "learning_rate negative": ("train", ["learning_rate=-0.001"], "learning_rate must be > 0"),
    "lora_alpha negative": ("train", ["lora_alpha=-16"], "lora_alpha must be > 0"),
    "warmup_ratio 2": ("train", ["warmup_ratio=2"], "warmup_ratio must be in [0, 1]"),
    "max_steps 0": ("train", ["max_steps=0"], "max_steps must be > 0"),
    "num_train_epochs -1": ("train", ["max_steps=-1", "num_train_epochs=-1"], "num_train_epochs must be > 0"),
    "output_dir a file": ("train", [_output_file], "is an existing file"),
    "unknown lora_target": ("train", ["lora_target=q_proj,qq_proj"], "lora_target 'qq_proj' matches no linear"),
    "unknown backend": ("train", ["kt_config.kt_backend=nope"], "expert backend 'nope' is not available"),
    "chat unknown backend": ("chat", ["kt_config.kt_backend=nope"], "expert backend 'nope' is not available"),
    "dataset file_name leaves dataset_dir": ("train", [_dataset_outside], "file_name: '../../../etc/passwd' leaves"),
    "train adapter is a pickle": ("train", [_pickle_adapter], "adapter_model.bin is a pickle"),
    "export adapter is a pickle": ("export", [_pickle_adapter], "adapter_model.bin is a pickle"),
    "chat adapter is a pickle": ("chat", [_pickle_adapter], "adapter_model.bin is a pickle"),
    "adapter r sixteen": ("train", [lambda w, t: _peft_variant(w, t, lambda d: _json_edit(
        d / "adapter_config.json", lambda c: c.update(r="sixteen")))], "r must be an integer > 0"),
    "adapter_config not json": ("train", [lambda w, t: _peft_variant(w, t, lambda d: (
        d / "adapter_config.json").write_text("{\"r\": 4,"))], "adapter_config.json: not valid JSON"),
    "truncated peft safetensors": ("chat", [lambda w, t: _peft_variant(w, t, lambda d: (
        d / "adapter_model.safetensors").write_bytes((d / "adapter_model.safetensors").read_bytes()[:-64]))],
        "adapter_model.safetensors: truncated"),
    "manifest is a list": ("chat", [lambda w, t: _fused_variant(w, t, lambda d: (
        d / "kt_adapter_manifest.json").write_text("[]"))], "must be a JSON object, got a list"),
    "manifest files is a list": ("chat", [lambda w, t: _fused_variant(w, t, lambda d: _json_edit(
        d / "kt_adapter_manifest.json", lambda m: m.update(files=["fused_expert_lora.safetensors"])))],
        "files must be an object, got a list"),
    "header without data_offsets": ("export", [lambda w, t: _peft_variant(w, t, lambda d: strip_offsets(
        d / "adapter_model.safetensors"))], "is not {dtype, shape, data_offsets}"),
    "tensor_map not json": ("chat", [_gguf_tmap_not_json], "tensor_map is not valid JSON"),
    "chat on a partial GGUF": ("chat", [_partial_gguf_model], "truncated"),
    "model header without data_offsets": ("chat", [_model_without_offsets], "is not {dtype, shape, data_offsets}"),
    "model config.json not JSON": ("train", [_config_not_json], "cannot build the model from its config"),
    "kt_num_gpu_experts negative": ("train", ["kt_config.kt_num_gpu_experts=-1"],
                                    "kt_num_gpu_experts must be an integer >= 0"),
    "kt_num_gpu_experts all experts": ("train", ["kt_config.kt_num_gpu_experts=8"],
                                       "kt_num_gpu_experts 8 needs fewer than the layer's 8 experts"),
    "kt_num_gpu_experts with gpu_stream": ("train", ["kt_config.kt_num_gpu_experts=2",
                                                     "kt_config.kt_expert_placement=gpu_stream"],
                                           "works with kt_expert_placement: cpu, not gpu_stream"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_before_any_weight_is_read(world, tmp_path, case):
    command, overrides, expected = CASES[case]
    args = [o if isinstance(o, str) else o(world, tmp_path) for o in overrides]
    if not any(a.startswith("model_name_or_path=") for a in args):
        args.append(f"model_name_or_path={world['garbage']}")
    head = {"train": ["train", str(world["config"]), "--frontend", "trl"],
            "chat": ["chat", str(world["config"]), "--prompt", "hi"],
            "export": ["export", str(world["config"]), "--out", str(tmp_path / "merged")]}[command]
    if command != "train" and not any(a.startswith("adapter_name_or_path=") for a in args):
        args.append(f"adapter_name_or_path={world['peft']}")
    result = CliRunner().invoke(main, head + args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "merged").exists()


def test_the_garbage_model_would_have_been_noticed(world):
    """The control of the table: the same commands with good input do reach the weights and fail on them."""
    result = CliRunner().invoke(main, ["chat", str(world["config"]), "--prompt", "hi",
                                       f"model_name_or_path={world['garbage']}", "kt_config.kt_backend=torch"])
    assert result.exit_code == 2 and "safetensors" in result.stderr, result.output


@pytest.mark.parametrize("entry", ["/etc/passwd", "../../../../etc/passwd"])
def test_weight_map_leaving_the_model_dir_is_refused(world, tmp_path, entry):
    import ktcore
    from ktcore.errors import KtcoreError

    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    state = load_file(model / "model.safetensors")
    names = sorted(state)
    save_file(state, str(model / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    (model / "model.safetensors").unlink()
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names}
    weight_map[names[0]] = entry
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(KtcoreError, match=f"weight_map entry {names[0]!r}: {entry!r} (must be a relative|leaves)"):
        ktcore.load_model(model, {"kt_backend": "torch"}, progress=False)
    result = CliRunner().invoke(main, ["chat", str(world["config"]), "--prompt", "hi", f"model_name_or_path={model}"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "weight_map entry" in result.stderr


def test_chat_refuses_more_resident_experts_than_a_layer_has(world):
    """chat checks the layers' expert counts when the model is built (after the headers, before any weight):
    one line, not a traceback from inside the load."""
    result = CliRunner().invoke(main, ["chat", str(world["config"]), "--prompt", "hi", "kt_config.kt_backend=torch",
                                       f"model_name_or_path={world['model']}", "kt_config.kt_num_gpu_experts=9"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "kt_num_gpu_experts 9 needs fewer than the layer's 8 experts" in lines[0]
