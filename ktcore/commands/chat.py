"""``ktcore chat``: load the model a YAML describes (experts on the CPU backend, adapter if any) and talk to it."""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

from ..config import TrainConfig, resolve_model_path
from ..weights.model_path import load_plain_model, load_tokenizer


def check_config(cfg: TrainConfig) -> Path:
    """The config's own mistakes, one line each before torch or transformers is imported (a fraction of a
    second): a Hub adapter ID, a model path that does not exist, an expert backend that cannot run here.
    Returns the model path."""
    from ..frontends.skeleton import check_backend

    if cfg.adapter_name_or_path:  # a Hub ID is refused first, as in `ktcore train` (before any model is read)
        from ..adapters.locate import local_adapter_path

        local_adapter_path(cfg.adapter_name_or_path)
    path = resolve_model_path(cfg)
    if cfg.use_kt:
        check_backend(cfg, training=False)
    return path


def check_inputs(cfg: TrainConfig, path: Path):
    """Everything chat reads, checked from headers before a weight is read: a GGUF model's header and tensor
    extents (a partial file is one line), the adapter (``ktcore adapter verify`` against the model). Returns the
    GGUF file, opened (its header parsed once, for the tokenizer and the model too), or None for a model
    directory."""
    gguf = None
    if path.is_file():
        from ..weights.gguf_reader import GGUFFile

        gguf = GGUFFile(path)
    if cfg.adapter_name_or_path:
        from ..adapters import verify

        verify(cfg.adapter_name_or_path, base=path)
    return gguf


Stage = Callable[[str, str], None]  # (key: tokenizer, model, adapter or ready; what is being loaded)


def terminal_stages() -> Stage:
    """One line on stderr per loading stage when stderr is a terminal, so a model that takes a while to load is
    not a silent wait. Not into a pipe or a log: there stdout is the answer and bad input one line on stderr."""
    started = time.perf_counter()

    def stage(key: str, text: str) -> None:
        if sys.stderr.isatty():
            print(f"ktcore chat: {text} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)

    return stage


def load_for_chat(cfg: TrainConfig, stage: Optional[Stage] = None):
    """(model, tokenizer) for inference: ktcore experts when use_kt, the adapter when one is named. ``stage`` is
    told when each loading stage begins (default: ``terminal_stages``; ``ktcore bench load`` times them)."""
    stage = stage or terminal_stages()
    path = check_config(cfg)
    import torch

    from ..weights.gguf_reader import gguf_config
    from ..weights.loading import load_model

    gguf = check_inputs(cfg, path)  # bad input: one line, before any stage line
    with gguf or nullcontext():
        stage("tokenizer", f"loading the tokenizer of {path}")
        tokenizer = load_tokenizer(path, config=gguf_config(gguf) if gguf else None)
        stage("model", "loading the model" + (" (routed experts into the CPU backend)" if cfg.use_kt else ""))
        if cfg.use_kt:
            model = load_model(path, cfg.kt, need_backward=False, progress=False, gguf=gguf)
        else:
            model = load_plain_model(path).to("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.adapter_name_or_path:  # any installed adapter format, sniffed and validated
        from ..adapters import load_adapter_into

        stage("adapter", f"loading the adapter {cfg.adapter_name_or_path}")
        model = load_adapter_into(model, cfg.adapter_name_or_path, base=path)
    stage("ready", "ready")
    return model.eval(), tokenizer


def reply(model, tokenizer, messages: list[dict], cfg: TrainConfig, streamer=None) -> str:
    """Generate the assistant's answer to ``messages`` (greedy when temperature is 0)."""
    import torch

    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
    device = next(p for p in model.parameters() if not p.is_meta).device
    inputs = {k: v.to(device) for k, v in encoded.items()}
    sampling = cfg.temperature > 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                             temperature=cfg.temperature if sampling else None,
                             top_p=cfg.top_p if sampling else None, streamer=streamer,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def run_chat(cfg: TrainConfig, prompt: Optional[str] = None, read: Callable[[str], str] = input) -> list[dict]:
    """One answer to ``prompt``, or an interactive session (empty line or EOF ends it). Returns the turns."""
    model, tokenizer = load_for_chat(cfg)
    from transformers import TextStreamer  # after the checks: a config's mistake is found before this import

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    messages: list[dict] = []
    while True:
        text = prompt
        if text is None:
            try:
                text = read("you> ")
            except EOFError:
                break
            if not text.strip():
                break
        messages.append({"role": "user", "content": text})
        answer = reply(model, tokenizer, messages, cfg, streamer=streamer)
        messages.append({"role": "assistant", "content": answer})
        if prompt is not None:
            break
    return messages
