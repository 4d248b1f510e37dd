"""Where the checkpointed training step's GPU memory goes, by phase, before and after issue 19's cuts.

Runs ``ktcore bench train``'s step (``ktcore.commands.bench_train.train_steps``: PEFT LoRA r on the attention
and dense linears and the routed experts, AdamW, one sequence) in bf16 at a model shape's real dimensions, with
``--layers N`` of its layers, on the GPU (the allocator's counters) or, with ``--device cpu`` or without a GPU,
on the CPU, where the step's CPU tensors are counted (``ktcore.model.memory.LiveTensors``): on a GPU these are
the tensors the allocator holds (the routed experts' backend runs on other threads, in host memory there as
here). Each variant is one way of running the step:

- ``before``: attention blocks and dense MLPs checkpointed (``ktcore.testing.checkpointing``), transformers'
  loss on the full logits (the code before ``ktcore.model.lm_loss`` and whole-layer ``checkpoint_non_experts``);
- ``chunked-loss``: the same checkpointing, the loss over chunks of the LM head (``ktcore.model.lm_loss``);
- ``now``: what ``ktcore train`` and ``ktcore bench train --gradient-checkpointing`` run: whole decoder layers
  checkpointed, the routed experts' output replayed in the recompute.

    python benchmarks/train_memory.py --layers 6,12 --tokens 2048            # on the GPU
    python benchmarks/train_memory.py --layers 2,3 --tokens 2048 --device cpu

Two layer counts give what one more MoE layer adds (the slope) and the rest (the intercept). Slow on the CPU: a
step of DeepSeek-V2-Lite's LM head at 2,048 tokens is ~2.6 TFLOP there, and the attention's scores are
materialised (CPU transients the GPU's fused attention does not have).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

import ktcore
from ktcore.commands.bench_train import SHAPES, lora_config, make_config, train_steps, write_random_model
from ktcore.model.checkpointing import checkpoint_non_experts
from ktcore.model.lm_loss import chunk_lm_loss
from ktcore.testing.checkpointing import checkpoint_attention_only

VARIANTS = ("before", "chunked-loss", "now")


def measure(model_dir: Path, variant: str, tokens: int, rank: int, backend: str, device: torch.device) -> dict:
    import gc

    from peft import get_peft_model

    gc.collect()  # the variant before is gone: resident is this one's
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = ktcore.load_model(model_dir, {"kt_backend": backend}, device=device, dtype=torch.bfloat16, progress=False)
    if variant != "before":
        chunk_lm_loss(base)
    (checkpoint_non_experts if variant == "now" else checkpoint_attention_only)(base)
    torch.manual_seed(0)
    model = get_peft_model(base, lora_config(base, rank))
    model.train()
    timed = train_steps(model, tokens, warmup=0, steps=1, device=device, memory=True)
    return {"step_s": timed["step_s"], **timed["memory"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek-v2-lite", choices=sorted(SHAPES))
    parser.add_argument("--layers", default="2,3", help="comma-separated layer counts")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    for layers in (int(n) for n in args.layers.split(",")):
        scratch = Path(tempfile.mkdtemp(prefix="ktcore-memory-"))
        try:
            model_dir = write_random_model(make_config(SHAPES[args.shape], layers), scratch / "model")
            for variant in args.variants.split(","):
                row = measure(model_dir, variant, args.tokens, args.rank, args.backend, device)
                print(json.dumps({"shape": args.shape, "layers": layers, "tokens": args.tokens, "variant": variant,
                                  "device": device.type,
                                  **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}}),
                      flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
