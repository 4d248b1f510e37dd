"""Issue 25's loss criterion with controls: the loss curve of a random DeepSeek-V2-Lite-shaped model (cut to
``--layers``) trained on bf16 experts, on the same experts perturbed far less than quantisation perturbs them, and
on its Q8_0 / Q4_K GGUFs; prints each curve's last step and its means over the last 5 and 10 steps against bf16.

    python benchmarks/gguf_loss_controls.py [--layers 3] [--tokens 128] [--steps 50] [--noise 0.002]
        [--seeds 1,2] [--formats q8_0,q4_k] [--workdir DIR] [--json]

Runs at the real width on whatever device there is (``ktcore bench train`` runs only a tiny shape without a GPU):
bf16 on the torch backend (``--backend``), GGUFs on llamafile, each through the bench's own model writers and loss
run. A control multiplies every expert weight by (1 + noise x a normal draw of its seed) and rounds to bf16 again;
how far that moves the curve is what a single run cannot tell apart from the quantised base's effect.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import ktcore
from ktcore.commands import bench_train as bt
from ktcore.model.lm_loss import chunk_lm_loss


@dataclass
class RealWidth(bt.Settings):
    @property
    def tiny(self) -> bool:
        return False


def perturbed(model: Path, out: Path, noise: float, seed: int) -> Path:
    """A copy of ``model`` whose routed-expert shards (``model-experts-*``, as write_random_model names them) are
    perturbed; the other files copied as they are."""
    out.mkdir()
    g = torch.Generator().manual_seed(seed)
    from safetensors.torch import load_file, save_file

    for f in sorted(model.iterdir()):
        if not f.name.startswith("model-experts-"):
            shutil.copy(f, out / f.name)
            continue
        tensors = {k: (w.float() * (1 + noise * torch.randn(w.shape, generator=g))).to(torch.bfloat16)
                   for k, w in load_file(str(f)).items()}
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return out


def curve(settings: RealWidth, path: Path, backend: str) -> list:
    base = ktcore.load_model(path, {"kt_backend": backend, "kt_num_threads": settings.threads},
                             device=settings.device, dtype=settings.dtype, progress=False)
    chunk_lm_loss(base)  # as ktcore train
    (row,) = bt._loss_run(settings, base, {"expert_format": "", "backend": backend})
    if row["error"]:
        raise RuntimeError(row["error"])
    return row["losses"]


def summary(name: str, losses: list, bf16: list) -> dict:
    out = {"run": name, "losses": losses}
    for key, n in (("last", 1), ("mean5", 5), ("mean10", 10)):
        ours, ref = statistics.mean(losses[-n:]), statistics.mean(bf16[-n:])
        out[key], out[key + "_vs_bf16"] = ours, ours / ref - 1
    return out


def show(run: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(run), flush=True)
    else:
        print(f"{run['run']:32s}" + "".join(f"  {k} {run[k]:.3f} ({run[k + '_vs_bf16']:+.1%})"
                                            for k in ("last", "mean5", "mean10")), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--noise", type=float, default=0.002)
    ap.add_argument("--seeds", default="1,2", help="one control per seed ('' for none)")
    ap.add_argument("--formats", default="q8_0,q4_k")
    ap.add_argument("--backend", default="torch", help="the bf16 runs' expert backend")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    args = ap.parse_args()

    settings = RealWidth(shape=bt.SHAPES["deepseek-v2-lite"], layers=args.layers, tokens=(args.tokens,),
                         threads=args.threads, loss_steps=args.steps)
    scratch = Path(tempfile.mkdtemp(prefix="ktcore-loss-", dir=args.workdir))
    try:
        model = bt.write_random_model(bt.make_config(settings.shape, args.layers, False), scratch / "model")
        bf16 = curve(settings, model, args.backend)
        show(summary("bf16", bf16, bf16), args.json)
        formats = [f for f in args.formats.split(",") if f]
        for fmt, path in bt.write_gguf_models(model, formats, scratch).items():
            show(summary(fmt, curve(settings, path, bt.GGUF_BACKEND), bf16), args.json)
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            path = perturbed(model, scratch / f"perturbed-{seed}", args.noise, seed)
            show(summary(f"bf16 x (1 + {args.noise} N), seed {seed}", curve(settings, path, args.backend), bf16),
                 args.json)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
