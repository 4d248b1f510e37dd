"""`ktcore bench train` on the CPU (no GPU here: a tiny shape of the family): the fields each run reports, the
model it writes, and the scratch directory it cleans up. No timing assertions."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import ktcore
from ktcore.commands.bench_train import SHAPES, make_config, write_random_model
from ktcore.commands.cli import main

SPLIT = ("gpu_busy_s", "cpu_experts_s", "expert_lora_s", "h2d_gb", "h2d_gbps", "pcie_share", "copies_s",
         "lora_copies_s", "pin_s", "cpu_idle_s", "gpu_idle_s")


def bench(*args):
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--steps", "1", "--warmup", "1", *args, "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert "environment" in lines[0] and lines[0]["environment"]["cores"] >= 1
    return lines[1:]


def test_every_run_reports_its_speed_split_memory_and_kernel_time(tmp_path):
    rows = bench("--tokens", "16,24", "--kernel-seconds", "0.01", "--baseline", "--workdir", str(tmp_path))
    runs = [(r["run"], r.get("tokens")) for r in rows]
    assert runs == [("ktcore, no expert LoRA", 16), ("ktcore", 16), ("ktcore, no expert LoRA", 24), ("ktcore", 24),
                    ("transformers + PEFT, whole model on cpu", 16), ("transformers + PEFT, whole model on cpu", 24),
                    ("transformers + accelerate, routed experts offloaded to host memory", 16)]
    for row in rows[:4]:
        assert row["error"] is None and row["device"] == "cpu" and row["moe_layers"] == 2
        assert row["shape"] == "deepseek-v2-lite (tiny)" and row["backend"]
        assert row["tok_s"] > 0 and row["step_s"] > 0 and row["peak_host_gib"] > 0 and row["peak_gpu_gib"] is None
        assert row["kernel_s"] > 0 and row["kernel_no_lora_s"] > 0 and row["overhead_ratio"] > 0
        assert row["kernel_step_routing_s"] > 0 and row["routing_max_over_mean"] >= 1
        assert row["overhead_ratio"] == pytest.approx(
            row["step_s"] / (row["kernel_step_routing_s"] + row["split"]["gpu_busy_s"]))
        split = row["split"]
        assert set(split) == set(SPLIT)
        assert split["cpu_experts_s"] > 0 and split["gpu_busy_s"] > 0 and split["copies_s"] >= 0
        assert split["h2d_gb"] == 0 and split["h2d_gbps"] is None and split["pcie_share"] is None  # no copies
        assert split["cpu_idle_s"] == pytest.approx(row["step_s"] - split["cpu_experts_s"])
        assert (split["expert_lora_s"] is None) == (not row["expert_lora"])
        memory = row["memory"]  # counted on the CPU (LiveTensors): weights, LoRA and AdamW state are resident
        assert memory["resident_gib"] == pytest.approx(
            memory["weights_gib"] + memory["trainable_gib"] + memory["optimizer_state_gib"], rel=0.05)
        assert memory["optimizer_state_gib"] == pytest.approx(2 * memory["trainable_gib"], rel=0.01)  # + step counts
        assert 0 < memory["activations_gib"] < memory["layers_peak_gib"] - memory["resident_gib"]
        assert memory["step_peak_gib"] == max(memory[f"{p}_peak_gib"] for p in ("layers", "loss", "backward",
                                                                                "optimizer"))
        assert memory["peak_phase"] in ("layers", "loss", "backward", "optimizer")
    assert rows[1]["split"]["expert_lora_s"] == pytest.approx(rows[1]["step_s"] - rows[0]["step_s"])
    for row in rows[4:6]:
        assert row["error"] is None and row["tok_s"] > 0 and row["expert_lora"] is True
    assert rows[6]["error"] == "needs a GPU"
    assert list(tmp_path.iterdir()) == []  # the scratch model is gone


def test_placements_side_by_side(tmp_path):
    """--placement cpu,gpu_stream,hybrid: one run of each on the same model, the streamed one with no CPU-backend
    time (on the CPU nothing is copied: the host copy is the device copy)."""
    rows = bench("--tokens", "16", "--kernel-seconds", "0", "--no-expert-lora-off", "--placement",
                 "cpu,gpu_stream,hybrid", "--workdir", str(tmp_path))
    assert [(r["run"], r["placement"]) for r in rows] == [("ktcore", "cpu"), ("ktcore gpu_stream", "gpu_stream"),
                                                          ("ktcore hybrid", "hybrid")]
    for row in rows:
        assert row["error"] is None and row["tok_s"] > 0 and row["moe_layers"] == 2
        assert row["split"]["h2d_gb"] == 0
    assert rows[0]["split"]["cpu_experts_s"] > 0 and rows[1]["split"]["cpu_experts_s"] == 0
    assert rows[2]["split"]["cpu_experts_s"] > 0  # the CPU's share


def test_expert_lora_devices_side_by_side(tmp_path):
    """--expert-lora-device model,host: the run without expert LoRA once (by the model run), then each with it; on
    the CPU the host is the model's device, so nothing is copied either way and the host run names its factors."""
    rows = bench("--tokens", "16", "--kernel-seconds", "0", "--expert-lora-device", "model,host",
                 "--workdir", str(tmp_path))
    assert [(r["run"], r["expert_lora_device"]) for r in rows] == [
        ("ktcore, no expert LoRA", "model"), ("ktcore", "model"), ("ktcore, expert LoRA on host", "host")]
    for row in rows:
        assert row["error"] is None and row["tok_s"] > 0 and row["split"]["lora_copies_s"] == 0
    assert rows[1]["host_lora_gib"] == 0 and rows[2]["host_lora_gib"] > 0
    assert rows[2]["memory"]["trainable_gib"] == pytest.approx(rows[1]["memory"]["trainable_gib"])


def test_resident_experts_side_by_side(tmp_path):
    """--num-gpu-experts 0,2 with --placement cpu,gpu_stream: the cpu run without and with 2 experts a layer resident
    (their buffers counted, the run named), the stream's run only without (it refuses the combination)."""
    rows = bench("--tokens", "16", "--kernel-seconds", "0", "--no-expert-lora-off", "--num-gpu-experts", "0,2",
                 "--placement", "cpu,gpu_stream", "--workdir", str(tmp_path))
    assert [(r["run"], r["gpu_experts"]) for r in rows] == [
        ("ktcore", 0), ("ktcore, 2 experts resident", 2), ("ktcore gpu_stream", 0)]
    for row in rows:
        assert row["error"] is None and row["tok_s"] > 0
    assert rows[0]["gpu_experts_gib"] == 0 and rows[1]["gpu_experts_gib"] > 0
    assert rows[1]["split"]["gpu_experts_refreshes"] == 0  # 2 calls a layer: below the default interval
    rows = bench("--tokens", "16", "--kernel-seconds", "0", "--no-expert-lora-off", "--num-gpu-experts", "2",
                 "--gpu-experts-interval", "1", "--warmup", "0", "--steps", "3", "--workdir", str(tmp_path))
    assert rows[0]["split"]["gpu_experts_refreshes"] > 0 and rows[0]["split"]["gpu_experts_refresh_s"] > 0
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--num-gpu-experts", "2,x"])
    assert result.exit_code == 2 and "--num-gpu-experts 2,x" in result.output


def test_kept_model_is_timed_again_with_attention_only_checkpointing(tmp_path):
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--shape", "qwen3-30b-a3b", "--tokens", "8",
                                       "--steps", "1", "--warmup", "0", "--kernel-seconds", "0",
                                       "--no-expert-lora-off", "--workdir", str(tmp_path), "--keep"])
    assert result.exit_code == 0, result.output
    (scratch,) = tmp_path.iterdir()
    (row,) = bench("--model", str(scratch / "model"), "--tokens", "8", "--kernel-seconds", "0",
                   "--no-expert-lora-off", "--gradient-checkpointing")
    assert row["gradient_checkpointing"] is True and row["error"] is None and row["tok_s"] > 0
    assert row["kernel_s"] is None and row["overhead_ratio"] is None
    assert (scratch / "model").is_dir()  # --model: never deleted


def test_kernels_at_a_step_routing_time_every_layer_and_say_how_uneven_it_was(tmp_path):
    """kernel_time_routed: each layer called at the routing given for it, and routing_max_over_mean the busiest
    expert's rows over the mean: 1 when every expert gets as many rows, E / k when every token picks the same k."""
    from ktcore.commands.bench_train import kernel_time_routed

    model_dir = write_random_model(make_config(SHAPES["deepseek-v2-lite"], tiny=True), tmp_path / "model")
    model = ktcore.load_model(model_dir, {"kt_backend": "torch"}, dtype=torch.float32, progress=False)
    (name_a, a), (name_b, b) = model.ktcore.layers.items()
    experts, k = model.get_submodule(name_a).gate_up_proj.shape[0], model.config.num_experts_per_tok
    tokens = 2 * experts
    even = torch.stack([(torch.arange(k) + t) % experts for t in range(tokens)])
    same = torch.arange(k).repeat(tokens, 1)
    weights = torch.full((tokens, k), 1.0 / k)
    routed = kernel_time_routed(model, {a: (even, weights), b: (same, weights)}, 2, 0.02, True, torch.float32)
    assert routed["kernel_step_routing_s"] > 0
    assert routed["routing_max_over_mean"] == pytest.approx((1 + experts / k) / 2)
    untimed = kernel_time_routed(model, {b: (same, weights)}, 2, 0, False, torch.float32)
    assert untimed == {"kernel_step_routing_s": None, "routing_max_over_mean": pytest.approx(experts / k)}
    assert kernel_time_routed(model, {}, 2, 0.02, True) == {"kernel_step_routing_s": None,
                                                             "routing_max_over_mean": None}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_random_model_has_save_pretrained_names_and_loads_in_both(tmp_path, shape):
    from transformers import AutoModelForCausalLM

    config = make_config(SHAPES[shape], tiny=True)
    ours = write_random_model(config, tmp_path / "ours")
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "reference")

    def tensors(directory):
        out = {}
        for file in directory.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                out.update({k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()})
        return out

    assert tensors(ours) == tensors(tmp_path / "reference")
    plain = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32)
    kt = ktcore.load_model(ours, {"kt_backend": "torch"}, dtype=torch.float32, progress=False)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    expected, got = plain(ids).logits, kt(ids).logits
    # transformers would initialise experts it did not find, and ktcore refuses a checkpoint without them
    assert (got - expected).norm() <= 1e-5 * expected.norm()  # measured 3e-8 to 1.3e-7 (fp32)


def test_bad_tokens_are_one_line_and_exit_2_and_every_shape_is_offered():
    result = CliRunner().invoke(main, ["bench", "train", "--cpu", "--tokens", "2048,0"])
    assert result.exit_code == 2 and "positive token counts" in result.output
    shape_option = next(o for o in main.commands["bench"].commands["train"].params if o.name == "shape")
    assert sorted(shape_option.type.choices) == sorted(SHAPES)


def test_auto_reports_what_it_took(tmp_path):
    """--placement auto (and hybrid with --hybrid-cpu-share auto): the split each run's two layers took at the last
    call of each tokens (these rates put 16 tokens on the CPU by a margin of 1000x, more than what the layers
    measure can move in a few calls; at 128 what they measured decides)."""
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"cpu_expert_gflops": 100.0, "dram_gbps": 100.0, "cpu_cores": 2, "h2d_gbps": 0.01,
                                 "gpu_tflops": 1.0, "gpu_layer_ms": 0.0}))
    rows = bench("--tokens", "16,128", "--kernel-seconds", "0", "--no-expert-lora-off", "--placement", "auto,hybrid",
                 "--hybrid-cpu-share", "auto", "--rates", str(rates), "--workdir", str(tmp_path / "work"))
    assert [(r["run"], r["tokens"]) for r in rows] == [("ktcore auto", 16), ("ktcore auto", 128),
                                                      ("ktcore hybrid", 16), ("ktcore hybrid", 128)]
    assert all(r["error"] is None and r["tok_s"] > 0 for r in rows)
    assert rows[0]["auto_choice"] == "cpu x2"
    assert took_by_two_layers(r"cpu|gpu_stream|hybrid [1-7]/8", rows[1]["auto_choice"])
    assert all(took_by_two_layers(r"hybrid [1-7]/8", r["auto_choice"]) for r in rows[2:])


def took_by_two_layers(choice: str, took: str) -> bool:
    """``took`` is "choice xN[, choice xN]" over two layers (each layer learns its own split: they may differ)."""
    parts = re.findall(rf"({choice}) x([12])", took)
    return ", ".join(f"{c} x{n}" for c, n in parts) == took and sum(int(n) for _, n in parts) == 2


def test_a_run_prints_no_peft_or_transformers_warning(tmp_path):
    """PEFT rewrote the dense gate_proj/up_proj/down_proj targets of DeepSeek-V2 into the routed experts' (rank 2r
    on gate_up_proj, the shared experts without LoRA) and warned twice about the rank/alpha pattern it made; the
    wrap printed transformers' is_gradient_checkpointing FutureWarning. Both runs (ktcore, plain transformers)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = bench("--tokens", "8", "--kernel-seconds", "0", "--no-expert-lora-off", "--baseline",
                     "--workdir", str(tmp_path))
    ran = [r["run"] for r in rows if r["error"] is None]
    assert ran[0] == "ktcore" and any(run.startswith("transformers + PEFT") for run in ran), rows
    noise = [f"{w.category.__name__}: {w.message}" for w in caught
             if issubclass(w.category, (RuntimeWarning, FutureWarning))]
    assert noise == []


@pytest.mark.parametrize("experts", [True, False])
def test_bench_lora_is_on_every_dense_and_shared_mlp_linear(experts):
    """Issue 19's benchmark LoRA: rank r on the attention and dense linears, the dense MLP's and the shared
    experts' gate/up/down_proj included (PEFT would move those names onto the routed experts of a DeepSeek-V2),
    and on the routed experts exactly when asked."""
    from archs import tiny_model
    from peft import get_peft_model

    from ktcore.commands.bench_train import lora_config

    model = tiny_model("deepseek_v2")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    peft_model = get_peft_model(model, lora_config(model, 4, experts=experts))
    adapted = {n.removeprefix("base_model.model.").replace(".base_layer", ""): m.r["default"]
               for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    routed = {f"model.layers.{i}.mlp.experts" for i in (1, 2)}
    assert set(adapted) == linears | (routed if experts else set())
    assert set(adapted.values()) == {4}


def test_experts_are_labelled_in_the_format_the_backend_computes(tmp_path):
    """The bf16 model on amx_int8 (which quantises it as it loads) is labelled int8; on torch, bf16."""
    from test_stream import int8_usable_or_skip

    int8_usable_or_skip()
    for backend, label in (("amx_int8", "int8"), ("torch", "bf16")):
        rows = bench("--backend", backend, "--tokens", "16", "--kernel-seconds", "0.01", "--workdir", str(tmp_path))
        assert rows and all(r["error"] is None and r["backend"] == backend and r["expert_format"] == label
                            for r in rows), rows


def test_per_step_counts_cover_the_timed_steps_only():
    """The copies and refreshes a row reports per step are counted over the timed steps: not the warm-up, nor the
    memory step that follows them (which once made `h2d_gb` a third too high at one warm-up and two timed steps)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ktcore.commands.bench_train import train_steps

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    calls = [0]
    model.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    timed = train_steps(model, 8, warmup=2, steps=3, device=torch.device("cpu"), memory=True,
                        counters=lambda: (calls[0], 10 * calls[0]))
    assert calls[0] == 2 + 3 + 1  # the warm-up, the timed steps, the memory step
    assert timed["counted"] == (3, 30)


def test_pcie_share_is_the_copies_bound_over_the_step():
    """`pcie_share` = (bytes / pinned bandwidth) / step: 53.1 GB at 55.1 GB/s in 1.16 s is 0.83 of the PCIe bound;
    without copies or a measured bandwidth (no GPU) there is no share, and no bandwidth is measured on the CPU."""
    from ktcore.commands.bench_train import pcie_share, pinned_gbps

    assert pcie_share(53.1, 1.16, 55.1) == pytest.approx(0.8308, abs=1e-4)
    assert pcie_share(0.0, 1.16, 55.1) is None and pcie_share(53.1, 1.16, None) is None
    assert pinned_gbps(torch.device("cpu")) is None


def test_profile_lists_one_steps_most_expensive_ops(tmp_path):
    """--profile N: each ktcore run carries one more step's N ops with the most time of their own (the CPU's ops
    here), most first; the streamed run's include the grouped GEMMs its experts run on."""
    rows = bench("--tokens", "16", "--kernel-seconds", "0", "--no-expert-lora-off", "--placement", "cpu,gpu_stream",
                 "--profile", "40", "--workdir", str(tmp_path))
    for row in rows:
        ops = row["profile"]
        assert 0 < len(ops) <= 40 and all(op["ms"] >= 0 and op["calls"] >= 1 for op in ops)
        assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
    assert any(op["op"] == "aten::_grouped_mm" for op in rows[1]["profile"])
    assert bench("--tokens", "16", "--kernel-seconds", "0", "--no-expert-lora-off",
                 "--workdir", str(tmp_path))[0]["profile"] is None
