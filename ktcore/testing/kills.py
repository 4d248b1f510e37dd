"""What the kill tests of both frontends share (tests/test_safe_train.py, the LLaMA-Factory suite's
test_llamafactory_safe.py): the real CLI in a subprocess, SIGKILLed at a named step, and a previous run's adapter
for it to replace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from ..files import FAULT_ENV


def run_ktcore(*args, fault: Optional[str] = None) -> subprocess.CompletedProcess:
    """``python -m ktcore.commands.cli ARGS``; with ``fault`` it kills itself at that step (``ktcore.files``)."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "ktcore.commands.cli", *map(str, args)], env=env,
                          capture_output=True, text=True)


def previous_adapter(model_dir, out: Path) -> None:
    """A previous run's PEFT adapter of ``model_dir`` in ``out``: lora_alpha 32 (a run that trains 64 must never
    leave its weights beside this config)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(out)
