"""Peak host memory while loading ~1 GB of routed experts stays near the packed size plus one layer."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

LAYERS, EXPERTS, HIDDEN, INTER = 5, 64, 1024, 512  # bf16 experts: 5 x 64 x 3 x 1024 x 512 x 2 B = 1.0 GB


def write_checkpoint(path):
    """A Qwen3-MoE checkpoint written layer by layer (the model itself is never built here)."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    path.mkdir()
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * INTER, moe_intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         num_experts=EXPERTS, num_experts_per_tok=4, dtype="bfloat16", tie_word_embeddings=False)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map = {}
    base = {"model.embed_tokens.weight": rnd(256, HIDDEN), "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            "lm_head.weight": rnd(256, HIDDEN)}
    save_file(base, path / "model-base.safetensors", metadata={"format": "pt"})
    weight_map.update({k: "model-base.safetensors" for k in base})
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors = {p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                   p + "self_attn.q_proj.weight": rnd(512, HIDDEN), p + "self_attn.k_proj.weight": rnd(256, HIDDEN),
                   p + "self_attn.v_proj.weight": rnd(256, HIDDEN), p + "self_attn.o_proj.weight": rnd(HIDDEN, 512),
                   p + "self_attn.q_norm.weight": torch.ones(64, dtype=torch.bfloat16),
                   p + "self_attn.k_norm.weight": torch.ones(64, dtype=torch.bfloat16),
                   p + "mlp.gate.weight": rnd(EXPERTS, HIDDEN)}
        for e in range(EXPERTS):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = rnd(INTER, HIDDEN)
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = rnd(INTER, HIDDEN)
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = rnd(HIDDEN, INTER)
        name = f"model-{layer:05d}.safetensors"
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


PROBE = textwrap.dedent("""
    import json, sys
    import torch, transformers, ktcore  # imports first: the baseline includes them
    def status(key):  # this process's own counters (ru_maxrss would include a forking parent's RSS)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    before = status("VmRSS")
    model = ktcore.load_model(sys.argv[1], {"kt_backend": "torch"}, device="cpu", progress=False)
    print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"),
                      "packed": model.ktcore.packed_bytes}))
""")


@pytest.mark.perf
@pytest.mark.slow
def test_peak_rss_while_loading_1gb_of_experts(tmp_path):
    write_checkpoint(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    layer_bytes = EXPERTS * 3 * HIDDEN * INTER * 2
    assert m["packed"] == LAYERS * layer_bytes
    grown = m["peak"] - m["before"]
    bound = (m["packed"] + layer_bytes) * 1.2
    assert grown <= bound, f"grew {grown / 2**30:.2f} GiB, bound {bound / 2**30:.2f} GiB ({m})"
