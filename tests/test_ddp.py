"""Several processes: ``torchrun --nproc_per_node 2 -m ktcore train`` on CPU-only ranks (gloo DDP) trains what one
process trains (issue 24, item 3).

Launched with torchrun (torch backend) and with ``accelerate launch`` (llamafile backend). Two ranks with ``per_device_train_batch_size: 1`` against one process with 2, same YAML otherwise (fp32, same seed,
the ktcore torch backend, and the llamafile backend where it is built, whose C++ pool each rank runs with half the
cores): the dataset holds two examples, so every step of both runs sees both of them (one per
rank, or both in one batch) whatever the samplers' order, and transformers normalises the loss by the global token
count in both. The per-step losses (each rank's records summed over the ranks) and the final adapter (attention
and expert LoRA, all-reduced by DDP) agree within 1e-5. Without the all-reduce the ranks' adapters would part at
step two; without ktcore's DDP fixes the run fails at DDP's initial broadcast of the expert placeholders.

The model's ``router_aux_loss_coef`` is 0: the load-balancing loss of a batch is not the mean of its halves'
(it multiplies per-expert token fractions by mean router probabilities), so with it on the two runs optimise
different objectives by design, not by a bug.

A checkpoint is saved at step 2 in both: with two ranks it holds both ranks' ``rng_state_N.pth`` (each rank wrote
into rank 0's staging directory), sealed once. The summary and the one-line notes come from rank 0 alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ktcore.testing.tiny import save_tiny_chat_moe

    path = save_tiny_chat_moe(tmp_path_factory.mktemp("ddp_model"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.0}))
    return path


def _config(tmp_path, name, model_dir, data_dir, **keys) -> Path:
    cfg = dict(model_name_or_path=str(model_dir), stage="sft", lora_target="all", lora_rank=8, dataset_dir=str(data_dir),
               dataset="identity", max_samples=2, template="default", cutoff_len=64, output_dir=str(tmp_path / name),
               learning_rate=1e-3, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1, save_steps=2,
               seed=0, use_kt=True, **keys)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(command, cwd) -> tuple[dict, str]:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, f"{command[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count('"frontend"') == 1, f"one summary expected (rank 0's):\n{proc.stdout[-3000:]}"
    return json.loads(proc.stdout[proc.stdout.index("{\n"):]), proc.stderr


def _adapter(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "adapter_model.safetensors"))


def _backend(name):
    from ktcore.plugins import get_registry

    if name not in get_registry().specs("expert_backend"):
        pytest.skip(f"the {name} backend is not installed here")
    return name


# the two launchers a user has, one per backend (each run is ~20 s on 2 cores): accelerate's CPU launch is
# --multi_gpu without GPUs (its --cpu starts one process); both start torch.distributed ranks that pick gloo
LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
             "accelerate": ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]}


@pytest.mark.slow
@pytest.mark.parametrize("backend,launcher", [("torch", "torchrun"), ("llamafile", "accelerate")])
def test_two_gloo_ranks_train_what_one_process_trains(tmp_path, model_dir, shared_data, backend, launcher):
    from ktcore.plugins.threads import usable_cores

    kt = {"kt_backend": _backend(backend)}  # llamafile: its own C++ pool per rank, fp32 weights as they are
    one = _config(tmp_path, "one", model_dir, shared_data, per_device_train_batch_size=2, kt_config=kt)
    two = _config(tmp_path, "two", model_dir, shared_data, per_device_train_batch_size=1, kt_config=kt)
    single, _ = _train([sys.executable, "-m", "ktcore", "train", str(one), "--frontend", "trl"], tmp_path)
    ddp, stderr = _train([sys.executable, *LAUNCHERS[launcher], "-m", "ktcore", "train", str(two), "--frontend", "trl"],
                         tmp_path)

    assert single["steps"] == ddp["steps"] == STEPS and ddp["kt_backend"] == backend
    if single["kt_backend_threads"]:  # a backend with a pool: each of the 2 ranks runs half the cores
        assert (single["kt_backend_threads"], ddp["kt_backend_threads"]) == (usable_cores(), max(1, usable_cores() // 2))
    assert ddp["tokens"] == single["tokens"]  # both ranks' tokens counted
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-5, rel=0)
    assert stderr.count("trainable parameters") == 1  # rank 0 prints the one-line messages

    a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "two")
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((a[k] - _adapter(tmp_path / "one" / "checkpoint-2")[k]).abs().max().item() for k in a)
    # equal (issue 24's bound; measured 3e-7), and not because nothing trained after step 2
    assert worst <= 1e-5 < moved, (worst, moved)

    ckpt = tmp_path / "two" / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "ktcore_checkpoint.json"} <= names, names
    assert not [p for p in (tmp_path / "two").iterdir() if p.name.startswith(".tmp-")]


def test_ranks_split_the_cores(monkeypatch):
    """With LOCAL_WORLD_SIZE ranks on the host, a rank's backend pool defaults to its share of the usable cores;
    kt_num_threads still sets it."""
    from ktcore.plugins.threads import backend_threads, usable_cores

    cores = usable_cores()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert backend_threads(None) == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert backend_threads(None) == max(1, cores // 2)
    assert backend_threads(1) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert backend_threads(None) == 1
