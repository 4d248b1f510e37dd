"""What a user watches and keeps: the progress bar, log lines, loss and reward plots."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm.auto import tqdm
from transformers.trainer_callback import ProgressCallback

from ktcore.files import atomic_file


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.4f}"
    return str(value)


class KtProgressCallback(ProgressCallback):
    """transformers' tqdm bar (steps, elapsed, ETA) with the last step's loss and tokens/s in its postfix,
    and one compact line per ``logging_steps`` on stderr (stdout is kept for the final JSON summary)."""

    SHOWN = ("loss", "grad_norm", "learning_rate", "rewards/accuracies", "rewards/margins")

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder  # ktcore.frontends.skeleton.StepRecorder
        self.started = None
        self.tokens_at_start = 0

    def on_train_begin(self, args, state, control, **kwargs):
        # the bar is made with its label: transformers' own on_train_begin draws an unlabelled "0%| 0/N" first,
        # which a log (or a terminal that does not redraw in place) keeps as a second bar stuck at 0%
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, desc="ktcore train", dynamic_ncols=True)
        self.current_step = 0
        self.started = time.perf_counter()
        self.tokens_at_start = self.recorder.tokens

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if self.training_bar is None:
            return
        postfix = {}
        loss = self.recorder.step_loss.get(state.global_step - 1)
        if loss is not None and loss[1]:
            postfix["loss"] = f"{loss[0] / loss[1]:.4f}"
        elapsed = time.perf_counter() - (self.started or time.perf_counter())
        if elapsed > 0:
            postfix["tok/s"] = f"{(self.recorder.tokens - self.tokens_at_start) / elapsed:.0f}"
        self.training_bar.set_postfix(postfix, refresh=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        parts = [f"step {state.global_step}/{state.max_steps}"]
        parts += [f"{key} {_fmt(logs[key])}" for key in self.SHOWN if key in logs]
        line = " | ".join(parts)
        if self.training_bar is not None:
            self.training_bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)


def _savefig(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return str(path)


def _smooth(values: list[float]) -> tuple[list[float], int]:
    window = max(1, len(values) // 20)
    out = [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
           for i in range(len(values))]
    return out, window


def plot_curve(steps: list[int], series: dict[str, list[float]], path: Path, title: str, ylabel: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        line, = ax.plot(steps, values, alpha=0.35 if len(series) == 1 else 0.9, label=name)
        if len(series) == 1:
            smooth, window = _smooth(values)
            ax.plot(steps, smooth, color=line.get_color(), label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return _savefig(fig, path)


def plot_training(records: dict[int, dict], output_dir, stage: str) -> dict:
    """training_loss.png, and for DPO training_rewards.png (chosen/rejected/margins) and
    training_rewards_accuracies.png, from the per-step records; returns {name: path}."""
    out = Path(output_dir)
    steps = sorted(records)
    if not steps:
        return {}
    xs = [s + 1 for s in steps]
    plots = {"loss_plot": plot_curve(xs, {"loss": [records[s]["loss"] for s in steps]}, out / "training_loss.png",
                                     f"{stage} training loss", "loss")}
    if stage == "dpo":
        plots["rewards_plot"] = plot_curve(
            xs, {key: [records[s][f"rewards/{key}"] for s in steps] for key in ("chosen", "rejected", "margins")},
            out / "training_rewards.png", "DPO rewards", "reward")
        plots["accuracy_plot"] = plot_curve(xs, {"accuracy": [records[s]["rewards/accuracies"] for s in steps]},
                                            out / "training_rewards_accuracies.png", "DPO reward accuracy",
                                            "accuracy")
    return plots
