"""``ktcore eval CFG.yaml`` (and ``llamafactory-cli eval CFG.yaml`` with ``use_kt``): evaluation loss and
perplexity on ``eval_dataset``.

LLaMA-Factory 0.9.5's own ``llamafactory-cli eval`` is gone ("Evaluation will be deprecated in the future": it
raises NotImplementedError); what it keeps is ``do_eval`` in ``run_exp``: its data pipeline, template and
collator, ``trainer.evaluate()`` and ``eval_results.json``. That is what runs here, with ``do_train: false`` and
the same scoped patch as training (``train.patched_llamafactory``: ktcore loads the model, its routed experts in
the CPU backend, and the adapter ``adapter_name_or_path`` names in any installed format). ``eval_dataset``
defaults to ``dataset``; the output directory is ``output_dir`` or a temporary one.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import replace

from ktcore.config import ConfigError, TrainConfig
from ktcore.frontends.skeleton import StepRecorder

from . import integration
from .train import apply_env, check_config, llamafactory_args, metadata_dir, patched_llamafactory


def run(cfg: TrainConfig) -> dict:
    """Evaluate the model the YAML describes on its ``eval_dataset``; returns the summary."""
    names = cfg.eval_dataset or cfg.dataset
    cfg = replace(apply_env(cfg), do_train=False, dataset=names, eval_dataset=names)
    check_config(cfg)  # the model, the adapter (verified against it) and dataset_dir, before any weight is read
    os.environ["DISABLE_VERSION_CHECK"] = "1"  # as in training: llamafactory 0.9.5 asks peft<=0.20
    from llamafactory.train.tuner import run_exp

    trainers: list = []
    recorder = StepRecorder(pairwise=cfg.stage == "dpo")  # the patch's; evaluation steps record nothing
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ktcore-eval-") as tmp:
        cfg = replace(cfg, output_dir=cfg.output_dir or tmp, overwrite_output_dir=True)
        try:
            with metadata_dir(cfg) as model_dir, \
                    patched_llamafactory(integration.loader_for(cfg), recorder, trainers):
                args = llamafactory_args(cfg, model_dir)
                args.pop("dataset")  # nothing to train on: LLaMA-Factory reads only eval_dataset
                run_exp({**args, "do_eval": True})
        except ValueError as exc:  # LLaMA-Factory's argument and data errors: one message
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{cfg.where}: llamafactory: {msg}") from exc
    metrics = next((h for h in reversed(trainers[-1].state.log_history) if "eval_loss" in h), None) \
        if trainers else None
    if metrics is None:
        raise ConfigError(f"{cfg.where}: llamafactory ran no evaluation (no eval_loss reported)")
    loss = float(metrics["eval_loss"])
    summary = {"frontend": "llamafactory", "stage": cfg.stage, "eval_dataset": names, "eval_loss": loss,
               "metrics": {k: v for k, v in metrics.items() if k.startswith("eval_")},
               "adapter": cfg.adapter_name_or_path, "use_kt": cfg.use_kt, "runtime_s": time.perf_counter() - start}
    if cfg.stage == "sft":  # the mean per-token cross-entropy: perplexity is its exponential
        summary["perplexity"] = math.exp(loss) if loss < 700 else math.inf
    return summary
