"""`ktcore bench train --expert-format` on the CPU (tiny DeepSeek-V2 shape): the GGUF files it writes of its random
model load through the real loader and give plain transformers' logits on gguf's own dequantisation of their
blocks; every format's row and the loss-curve rows carry their fields. No timing assertions."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from ktcore_tiny import backend_unusable

import ktcore
from ktcore.commands.bench_train import (SHAPES, loss_curve, lora_config, make_config, task_ids, write_gguf_models,
                                         write_random_model)
from ktcore.commands.cli import main
from ktcore.weights.gguf_reader import GGUFFile, gguf_config

gguf = pytest.importorskip("gguf")
Q8_0, Q4_K = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K


@pytest.fixture(autouse=True)
def _llamafile():
    why = backend_unusable("llamafile")
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The bench's tiny DeepSeek-V2 (3 layers: 1 dense, 2 MoE; H = 256, I = 32) as bf16 safetensors and as its
    Q8_0 and Q4_K GGUF files."""
    root = tmp_path_factory.mktemp("bench_gguf")
    config = make_config(SHAPES["deepseek-v2-lite"], tiny=True)
    model_dir = write_random_model(config, root / "model")
    return config, model_dir, write_gguf_models(model_dir, ["q8_0", "q4_k"], root)


def _oracle(model_dir, path):
    """Plain transformers on the safetensors model, its routed experts replaced by gguf's own dequantisation of
    the file's blocks (read with gguf's reader, not ktcore's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reader = gguf.GGUFReader(str(path))
    blocks = {t.name: t for t in reader.tensors}
    types = {}
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            if f"blk.{layer}.ffn_gate_exps.weight" not in blocks:
                continue
            parts = {}
            for part in ("gate", "up", "down"):
                t = blocks[f"blk.{layer}.ffn_{part}_exps.weight"]
                types[part] = t.tensor_type
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                parts[part] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
                parts[part] = parts[part].reshape(shape)
            block.mlp.experts.gate_up_proj.copy_(torch.cat([parts["gate"], parts["up"]], dim=1))
            block.mlp.experts.down_proj.copy_(parts["down"])
    return model, types


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_the_gguf_it_writes_gives_transformers_logits_on_gguf_dequantisation(tiny_models, fmt):
    from transformers import AutoModelForCausalLM

    config, model_dir, files = tiny_models
    oracle, types = _oracle(model_dir, files[fmt])
    # Q4_K where rows are a multiple of 256 (gate/up: H = 256), else Q8_0 (down: I = 32), as llama.cpp falls back
    assert types == ({"gate": Q8_0, "up": Q8_0, "down": Q8_0} if fmt == "q8_0" else
                     {"gate": Q4_K, "up": Q4_K, "down": Q8_0})
    with GGUFFile(files[fmt]) as file:  # the metadata the architecture plugin wrote reads back as the same config
        read = gguf_config(file)
    for key in SHAPES["deepseek-v2-lite"].config:
        want = getattr(config, key)
        assert getattr(read, key) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
    ours = ktcore.load_model(files[fmt], {"kt_backend": "llamafile"}, dtype=torch.float32, progress=False)
    for layer in ours.ktcore.layers.values():  # the file's blocks as they are, not dequantised
        assert layer.packed.source is not None and layer.packed.formats == tuple(t.name.lower() for t in types.values())
    unquantised = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, bf16 = ours(ids).logits, oracle(ids).logits, unquantised(ids).logits
    error = float((got - want).norm() / want.norm())
    quantisation = float((bf16 - want).norm() / want.norm())
    print(f"{fmt}: ktcore vs oracle {error:.2e}; quantisation moves the logits by {quantisation:.2e}")
    # measured 3.7e-6 (q8_0) and 3.8e-6 (q4_k): llamafile's int16 activations against fp32 math on the same weights
    assert error <= 4e-5, (error, quantisation)
    # the quantisation moves them 8e-4 (q8_0) and 9e-3 (q4_k): the file's blocks were matched, not the bf16 weights
    assert quantisation > 10 * error, (error, quantisation)


def test_the_task_loss_falls_towards_its_floor(tiny_models):
    from peft import get_peft_model

    _, model_dir, _ = tiny_models
    ids = task_ids(512, 200, 3)[0]
    order = torch.randperm(512, generator=torch.Generator().manual_seed(1234))[:64].tolist()
    places = [order.index(t) for t in ids.tolist()]  # every token is in the order, one or two places after the last
    assert {(b - a) % 64 for a, b in zip(places, places[1:])} == {1, 2}
    assert torch.equal(task_ids(512, 200, 3)[0], ids) and not torch.equal(task_ids(512, 200, 4)[0], ids)
    base = ktcore.load_model(model_dir, {"kt_backend": "llamafile"}, dtype=torch.float32, progress=False)
    torch.manual_seed(0)
    model = get_peft_model(base, lora_config(base, 8))
    losses = loss_curve(model, 64, 40, torch.device("cpu"))
    print("losses", [round(x, 3) for x in losses])
    assert losses[-1] < 0.8 * losses[0], losses  # measured: 6.33 -> 4.22 (the floor is ln 2)


def test_bench_train_times_every_expert_format_and_its_loss_curve(tmp_path):
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--expert-format", "q4_k,bf16,q8_0",
                                       "--loss-steps", "2", "--tokens", "32", "--steps", "1", "--warmup", "0",
                                       "--kernel-seconds", "0", "--no-expert-lora-off", "--workdir", str(tmp_path),
                                       "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()][1:]
    assert [(r["run"], r["expert_format"]) for r in rows] == [
        (run, fmt) for fmt in ("bf16", "q8_0", "q4_k") for run in ("ktcore", "loss curve")]  # bf16 first
    config = make_config(SHAPES["deepseek-v2-lite"], tiny=True)
    hidden, inter, experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
    q8_row, q4k_row = 34 / 32, 144 / 256  # bytes per weight of a Q8_0 and a Q4_K block
    per_layer = {"q8_0": experts * 3 * hidden * inter * q8_row,
                 "q4_k": experts * hidden * inter * (2 * q4k_row + q8_row)}  # down (rows of I = 32) is Q8_0
    for row in rows:
        assert row["error"] is None and row["moe_layers"] == 2 and row["peak_host_gib"] > 0, row
        fmt = row["expert_format"]
        if fmt != "bf16":
            assert row["backend"] == "llamafile"
            assert row["expert_gib"] * 2**30 == pytest.approx(2 * per_layer[fmt]), row
    assert rows[0]["expert_gib"] * 2**30 >= 2 * experts * 3 * hidden * inter * 2  # at least bf16's 2 bytes
    for row in rows[1::2]:
        assert len(row["losses"]) == 2 and row["loss_first"] == row["losses"][0] and row["tokens"] == 32
        assert row["loss_last"] == row["losses"][-1] > 0
        if row["expert_format"] == "bf16":
            assert row["loss_vs_bf16"] is None
        else:
            assert row["loss_vs_bf16"] == pytest.approx((row["loss_last"] - rows[1]["loss_last"]) / rows[1]["loss_last"])
            assert abs(row["loss_vs_bf16"]) < 0.05, row  # the quantisation barely moves the tiny model's loss
    assert list(tmp_path.iterdir()) == []  # the scratch model and its GGUF files are gone


def test_bad_expert_format_is_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--expert-format", "bf16,q5_0"])
    assert result.exit_code == 2 and "choose from bf16, q8_0, q4_k" in result.output
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--model", str(gguf_file), "--expert-format", "q8_0"])
    assert result.exit_code == 2 and "timed with the experts it has" in result.output
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--shape", "qwen3-30b-a3b", "--expert-format", "q8_0",
                                       "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 2 and "writes no GGUF of the qwen3_moe family" in result.output, result.output
    assert list((tmp_path / "work").iterdir()) == []  # refused before a model was built
