"""``ktcore bench train``: the LoRA training step as a user runs it, timed next to what a user would otherwise try.

A random-weight model of a real shape is written into a scratch directory: ``save_pretrained`` writes the config
and every tensor but the routed experts, which are streamed into their own shards one layer at a time under the
names ``save_pretrained`` gives them, so building never holds the model in memory. The model is then loaded
with ``ktcore.load_model`` and PEFT LoRA (rank r on the attention and dense linears, and on the routed experts in
PEFT's ``target_parameters`` layout), attention-only checkpointing is ``ktcore.model.checkpointing``'s (as
``ktcore train``), and each step is one sequence: forward with labels, backward, AdamW. Per run it reports
tokens/s, where the step's time went (``ktcore.experts.timeline``), peak GPU memory, peak host RSS, and the kernel-only time of the same
expert layers at the same tokens, so the overhead ratio comes from one run. Nothing here asserts a time.

Without a GPU everything runs on the CPU at a tiny shape of the same family (the CI smoke test).
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

DENSE_LINEARS = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts
GIB = 2**30
MAX_SETTLING_STEPS = 12  # auto placement's trials: at most 3 candidates x TRIAL_STEPS, and reading the last


@dataclass(frozen=True)
class ModelShape:
    name: str
    config_class: str  # a transformers config class
    config: dict  # the published model's config (what matters for speed)
    tiny: dict = field(default_factory=dict)  # overrides for the CPU-only run


SHAPES = {
    "deepseek-v2-lite": ModelShape(
        "deepseek-v2-lite", "DeepseekV2Config",
        dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
             n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1,
             topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=163840,
             rms_norm_eps=1e-6, tie_word_embeddings=False),
        dict(vocab_size=512, hidden_size=256, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b", "Qwen3MoeConfig",
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False),
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)),
    "mixtral-8x7b": ModelShape(
        "mixtral-8x7b", "MixtralConfig",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False),
        dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4)),
}


def make_config(shape: ModelShape, layers: Optional[int] = None, tiny: bool = False):
    import transformers

    values = {**shape.config, **(shape.tiny if tiny else {})}
    if layers:
        values["num_hidden_layers"] = layers
    return getattr(transformers, shape.config_class)(**values)


# ---- the model on disk -----------------------------------------------------------------------------------------


def _set(model, name: str, value: torch.Tensor, table: str) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    old = getattr(module, table)[leaf]
    getattr(module, table)[leaf] = (torch.nn.Parameter(value, requires_grad=old.requires_grad)
                                    if table == "_parameters" else value)


def write_random_model(config, out, seed: int = 0) -> Path:
    """A random-weight bf16 model for ``config`` in ``out``, loadable by ``from_pretrained`` and
    ``ktcore.load_model``; host memory: the non-expert weights plus one layer of experts."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ..model.wrap import expert_modules, find_arch

    out = Path(out)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    arch = find_arch(config)
    experts = expert_modules(model, arch)
    prefixes = tuple(name + "." for _, name, _ in experts)
    for table, named in (("_parameters", model.named_parameters), ("_buffers", model.named_buffers)):
        for name, tensor in list(named()):
            if not name.startswith(prefixes):
                _set(model, name, torch.empty_like(tensor, device="cpu"), table)
    for name, module in model.named_modules():
        if not (name + ".").startswith(prefixes):
            model._init_weights(module)  # transformers' own init: normal linears, unit norms, rotary buffers
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
    model.save_pretrained(out, state_dict=state)
    weight_map = _weight_map(out)

    # routed experts: windows of one random pool, one shard per layer, per-expert names as save_pretrained writes
    std = getattr(config, "initializer_range", 0.02)
    _, _, first = experts[0]
    num, rows, hidden = first.gate_up_proj.shape
    inter = rows // 2
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(inter * hidden + (1 << 22), generator=g) * std).to(torch.bfloat16)
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for layer, _, _ in experts:
        tensors = {}
        for expert in range(num):
            for part, shape in shapes.items():
                start = int(torch.randint(0, pool.numel() - inter * hidden + 1, (1,), generator=g))
                key = arch.expert_keys[part].format(layer=layer, expert=expert)
                tensors[key] = pool[start:start + inter * hidden].view(shape).clone()
        shard = f"model-experts-{layer:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
        del tensors
    index = {"metadata": {"total_size": sum(f.stat().st_size for f in out.glob("*.safetensors"))},
             "weight_map": dict(sorted(weight_map.items()))}
    staging = out / "model.safetensors.index.json.tmp"
    staging.write_text(json.dumps(index, indent=2))
    staging.rename(out / "model.safetensors.index.json")  # last: a build cut short leaves no loadable model
    return out


EXPERT_FORMATS = ("bf16", "q8_0", "q4_k")  # bf16: the safetensors model on --backend; the rest: GGUF on GGUF_BACKEND
GGUF_BACKEND = "llamafile"  # computes with the file's blocks as they are


def write_gguf_models(model_dir: Path, formats, out_dir: Path) -> dict:
    """format -> a GGUF file of the model in ``model_dir`` whose routed experts are ``format`` blocks: the model
    written as a BF16 GGUF (``ktcore.weights.gguf_writer``), then its experts re-quantised by GGUF_BACKEND's
    converter (what ``ktcore convert`` runs; Q4_K rows of a length that is no multiple of 256, as DeepSeek-V2-Lite's
    down projection, fall back to Q8_0). Both stream one tensor at a time; the BF16 GGUF is removed at the end."""
    from ..errors import PluginError
    from ..plugins import get_registry
    from ..specs import import_object
    from ..weights.gguf_writer import write_gguf

    if not formats:
        return {}
    spec = get_registry().specs("expert_backend").get(GGUF_BACKEND)
    if spec is None or not spec.converter:
        raise PluginError(f"--expert-format {','.join(formats)} needs the {GGUF_BACKEND} backend's converter; "
                          f"install backends/{GGUF_BACKEND} (bash scripts/setup.sh)")
    convert = import_object(spec.converter)
    bf16 = write_gguf(model_dir, out_dir / "model.gguf")
    try:
        return {fmt: Path(convert(bf16, out_dir, fmt)["output"]) for fmt in formats}
    finally:
        bf16.unlink()


def _weight_map(out: Path) -> dict:
    """save_pretrained's tensor -> file map; a single model.safetensors becomes a shard (transformers would read
    that file alone and never the index)."""
    index = out / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    shard = "model-non-experts.safetensors"
    (out / "model.safetensors").rename(out / shard)
    with safe_open(str(out / shard), "pt") as f:
        return {k: shard for k in f.keys()}


# ---- measuring ---------------------------------------------------------------------------------------------------


def _reset_peaks(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:  # Linux: resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peaks(device: torch.device) -> dict:
    import resource

    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/status") as f:
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {"peak_gpu_gib": gpu, "peak_host_gib": host / GIB}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lora_config(model, rank: int, experts: bool = True):
    """PEFT LoRA of rank r on the attention and dense linears (and the routed experts), through the same
    ``lora_config_for`` the frontends use."""
    from ..config import TrainConfig
    from ..model.peft_expert_lora import lora_config_for
    from ..model.wrap import find_arch

    arch = find_arch(model.config)
    present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = [t for t in (*arch.default_lora_targets, *DENSE_LINEARS) if t in present]
    # the dense and shared-expert MLP names PEFT would move onto the routed experts (DeepSeek, Qwen3-MoE) reach
    # their Linears as target_parameters (lora_targets)
    target = ",".join(names + (["experts"] if experts else []))
    config = lora_config_for(model, arch, TrainConfig(lora_rank=rank, lora_target=target))
    if not experts:  # `down_proj` names the routed experts' parameter too: keep only the Linears' weights
        config.target_parameters = [p for p in config.target_parameters or () if p.endswith(".weight")] or None
    return config


def train_steps(model, tokens: int, warmup: int, steps: int, device: torch.device, timeline=None,
                memory: bool = False, settled=None, counters=None, profile: int = 0) -> dict:
    """Time ``steps`` SFT steps of one ``tokens``-long sequence after ``warmup``, and after more while
    ``settled()`` is false (auto placement trying its candidates): mean step seconds and, with a
    timeline, its mean spans per step; with ``memory``, one more step measured by phase (``memory_of_step``);
    with ``profile``, one more step's ``profile`` most expensive ops (``profile_step``).
    ``counters()`` (cumulative counts, a tuple): how much each grew over the timed steps, as ``counted``."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(tokens)
    vocab = model.config.get_text_config().vocab_size

    def batch():
        return torch.randint(0, vocab, (1, tokens), generator=g).to(device)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step(batch())
    settling = 0
    while settled is not None and not settled() and settling < MAX_SETTLING_STEPS:
        step(batch())
        settling += 1
    times, spans = [], []
    counted = counters() if counters else ()
    for _ in range(steps):
        ids = batch()
        _sync(device)
        if timeline is not None:
            timeline.reset()
        start = time.perf_counter()
        step(ids)
        _sync(device)
        times.append(time.perf_counter() - start)
        if timeline is not None:
            spans.append(timeline.resolve())
    out = {"step_s": statistics.mean(times),
           "counted": tuple(b - a for a, b in zip(counted, counters() if counters else ())),
           **_peaks(device)}  # before the memory step resets the GPU's peak
    if spans:
        out["spans"] = {k: statistics.mean(s[k] for s in spans) for k in spans[0]}
    if profile:
        out["profile"] = profile_step(lambda: step(batch()), profile, device)
    if memory:
        out["memory"] = memory_of_step(model, optimizer, batch())
    del optimizer
    return out


def profile_step(step, rows: int, device: torch.device) -> list:
    """One ``step()`` under torch's profiler: its ``rows`` ops with the most time of their own on the model's device
    (the GPU's kernels; without one, the CPU's ops), as {"op", "ms", "calls"} per step, most first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        _sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:rows]
    return [{"op": e.key, "ms": getattr(e, key) / 1e3, "calls": e.count} for e in ops]


def pcie_share(h2d_gb: float, step_s: float, gbps: Optional[float]) -> Optional[float]:
    """How close a step comes to the PCIe bound its copies set: (bytes / pinned bandwidth) / step seconds (1: the
    step takes exactly as long as its copies alone would); None without copies or a measured bandwidth."""
    return h2d_gb / gbps / step_s if h2d_gb and gbps else None


@functools.lru_cache(maxsize=None)
def pinned_gbps(device: torch.device) -> Optional[float]:
    """Pinned host-to-device GB/s of ``device`` (a GPU), measured once per process; None on the CPU."""
    from ..experts.probe import measure_h2d_gbps

    return measure_h2d_gbps() if device.type == "cuda" else None


def copy_counts(stream, resident: list) -> tuple:
    """Cumulative (bytes copied host-to-device, resident-set refreshes, their host seconds) of a model's streamed
    layers (``stream``, or None) and resident experts (``kt_num_gpu_experts``)."""
    return ((stream.copied_bytes if stream else 0) + sum(r.copied_bytes for r in resident),
            sum(r.refreshes for r in resident), sum(r.refresh_s for r in resident))


def memory_of_step(model, optimizer, ids: torch.Tensor) -> dict:
    """One more training step, measured by phase (``ktcore.model.memory``): GiB resident before it (and of
    that: weights, trainable parameters, optimizer state), the peak through the decoder layers, the activations
    they saved, and the peaks of the loss, the backward and the optimizer step. Without a GPU the same step's
    CPU tensors are counted (``LiveTensors``), so the phases read as they would on the GPU."""
    from ..model.memory import StepMemory, memory_meter, resident_parts

    device = ids.device
    gc.collect()
    meter = memory_meter(device)
    phases = StepMemory(meter)
    hook = phases.watch(model)
    try:
        with meter.tracking():
            if hasattr(meter, "count"):
                meter.count([*model.parameters(), *model.buffers(),
                             *(v for s in optimizer.state.values() for v in s.values())])
            phases.step_starts()
            loss = model(input_ids=ids, labels=ids).loss
            phases.forward_done()
            loss.backward()
            del loss
            phases.backward_done()
            optimizer.step()
            phases.optimizer_done()
            optimizer.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    return {**resident_parts(model, optimizer, device), **phases.report()}


LOSS_RUN = "loss curve"
# AdamW. On the CPU, LoRA on a random DeepSeek-V2-Lite-width base (2 layers, 4,096-token vocabulary, 128 tokens a
# step) took the task without its coin (floor 0) from 8.6 to 0.2-0.3 by step 40-50; 10x this lr was unstable at the
# tiny shape, 3x still fell
LOSS_LR = 1e-3


def task_ids(vocab: int, tokens: int, step: int, alphabet: int = 64) -> torch.Tensor:
    """One sequence of a task whose loss falls to a floor above zero: a fixed random order of ``alphabet`` token
    ids, walked one or two places ahead at each token by a fair coin (so each token has two equally likely
    successors: the best loss is ln 2 = 0.69, and relative differences between runs stay meaningful at the end);
    step ``step``'s sequence is the same for every run."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))[:alphabet]
    strides = 1 + torch.randint(0, 2, (tokens,), generator=torch.Generator().manual_seed(step))
    return order[(step * 7 + torch.cumsum(strides, 0)) % alphabet].unsqueeze(0)


def loss_curve(model, tokens: int, steps: int, device: torch.device) -> list:
    """The training loss of each of ``steps`` SFT steps on ``task_ids`` (LOSS_LR)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LOSS_LR)
    vocab = model.config.get_text_config().vocab_size
    losses = []
    for step in range(steps):
        ids = task_ids(vocab, tokens, step).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _experts_shape(model, name: str) -> tuple:
    """(experts, 2 x intermediate, hidden) of the experts module ``name``, under PEFT's wrappers if any."""
    module = model.get_submodule(name)
    return tuple((module.get_base_layer() if hasattr(module, "get_base_layer") else module).gate_up_proj.shape)


def _layer_call(model, name: str, tokens: int, rank: int, dtype, ids=None, weights=None):
    """A forward + backward call of the CPU-backend expert layer ``name`` on random activations, through
    submit/wait from another thread than the main one, as in training: ``call(lora: bool)``. Routing: ``ids`` and
    ``weights`` ([tokens, k]) where given, else uniform random; LoRA: random factors of rank ``rank``."""
    from ..experts import ExpertLoRA

    layer = model.ktcore.layers[name]
    num, rows, hidden = _experts_shape(model, name)
    inter, k = rows // 2, model.config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    if ids is None:
        ids = torch.rand(tokens, num, generator=g).topk(k, dim=1).indices
        weights = torch.softmax(torch.rand(tokens, k, generator=g), dim=1)
    x = torch.randn(len(ids), hidden, generator=g).to(dtype)
    factors = [torch.randn(*s, generator=g) * 0.01 for s in ((num, rank, hidden), (num, rows, rank),
                                                               (num, rank, inter), (num, hidden, rank))]
    grad_y = torch.randn(len(ids), hidden, generator=g).to(dtype)
    backend, packed = layer.backend, layer.packed

    def call(lora: bool):
        factors_ = ExpertLoRA(*factors, gate_up_scale=2.0, down_scale=2.0) if lora else None
        _, ctx = backend.wait(backend.submit_forward(packed, x, ids, weights, factors_, True))
        backend.wait(backend.submit_backward(packed, ctx, grad_y, factors_))

    return call


def kernel_time(model, tokens: int, rank: int, seconds: float, dtype=torch.bfloat16) -> dict:
    """Forward + backward seconds of the model's CPU-backend expert layers at ``tokens`` tokens, called on the
    backend alone (uniform random routing, random LoRA factors of rank r), summed over the layers; with and
    without expert LoRA (None for both when ``seconds`` is 0)."""
    from ..experts.probe import median_time

    layers = model.ktcore.layers
    if not layers or not seconds:
        return {"kernel_s": None, "kernel_no_lora_s": None}
    call = _layer_call(model, next(iter(layers)), tokens, rank, dtype)
    with_lora = median_time(lambda: call(True), seconds)
    without = median_time(lambda: call(False), seconds)
    return {"kernel_s": with_lora * len(layers), "kernel_no_lora_s": without * len(layers)}


def kernel_time_routed(model, routing: dict, rank: int, seconds: float, lora: bool, dtype=torch.bfloat16) -> dict:
    """The same with each layer routed as it was in a training step (``routing``: ``Timeline.routing``), every
    layer timed (``seconds`` shared among them): ``kernel_step_routing_s``, summed over the layers; and how
    uneven that routing was, ``routing_max_over_mean`` (the busiest expert's rows over the mean, averaged over
    the layers; uniform random routing of 2,048 tokens to 6 of 64 experts gives about 1.2)."""
    from ..experts.probe import median_time

    total, uneven = 0.0, []
    for name, layer in model.ktcore.layers.items():
        if layer not in routing:
            continue
        ids, weights = routing[layer]
        experts = _experts_shape(model, name)[0]
        counts = torch.bincount(ids.flatten().long(), minlength=experts).float()
        uneven.append((counts.max() / counts.mean()).item())
        if seconds:
            call = _layer_call(model, name, len(ids), rank, dtype, ids, weights)
            total += median_time(lambda: call(lora), seconds / len(routing))
    return {"kernel_step_routing_s": total if seconds and uneven else None,
            "routing_max_over_mean": sum(uneven) / len(uneven) if uneven else None}


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


# ---- the runs ------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    shape: ModelShape
    layers: Optional[int]
    tokens: tuple
    backend: str = "auto"
    threads: Optional[int] = None
    rank: int = 8
    warmup: int = 2
    steps: int = 3
    gradient_checkpointing: bool = False
    expert_lora_off: bool = True
    baseline: bool = False
    kernel_seconds: float = 1.0
    expert_formats: tuple = ("bf16",)  # bf16 and/or GGUF block types of the same random model (EXPERT_FORMATS)
    loss_steps: int = 0  # the loss-curve run's steps (0: none)
    placements: tuple = ("cpu",)  # kt_expert_placement of each ktcore run, side by side
    expert_lora_devices: tuple = ("model",)  # kt_expert_lora_device of each ktcore run, side by side
    stream_ring: int = 2  # kt_stream_ring of the gpu_stream and hybrid runs
    stream_activation: str = "retain"  # kt_stream_activation of the gpu_stream, hybrid and auto runs
    hybrid_cpu_share: Optional[float] = 0.5  # kt_hybrid_cpu_share of the hybrid runs (None: re-balanced)
    num_gpu_experts: tuple = (0,)  # kt_num_gpu_experts of each cpu run, side by side
    gpu_experts_interval: int = 8  # kt_gpu_experts_interval of those runs
    rates: Optional[str] = None  # kt_rates of the auto and re-balanced hybrid runs (None: measured at load)
    profile: int = 0  # ops listed from one more step of each run under torch's profiler (0: none)
    device: torch.device = field(default_factory=lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    @property
    def tiny(self) -> bool:
        return self.device.type != "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32  # CPUs without bf16 math crawl


def _row(settings: Settings, run: str, tokens: int, **values) -> dict:
    return {"run": run, "shape": settings.shape.name + (" (tiny)" if settings.tiny else ""), "tokens": tokens,
            "device": settings.device.type, "gradient_checkpointing": settings.gradient_checkpointing, **values}


def split_of(step_s: float, spans: dict, device: torch.device) -> dict:
    """The step's time by where it went (seconds; see the README's ``ktcore bench train``)."""
    waiting = spans["gpu_wait_s"] if device.type == "cuda" else spans["host_wait_s"]
    return {
        "gpu_busy_s": step_s - waiting,  # the model's device (the CPU itself without a GPU) not waiting for experts
        "cpu_experts_s": spans["cpu_experts_s"],  # the backend's calls, expert LoRA included
        "expert_lora_s": None,  # step time with expert LoRA minus without (filled in by the run with it)
        "copies_s": spans["gpu_copy_s"] + spans["gpu_lora_copy_s"] + spans["cpu_pin_s"],
        "lora_copies_s": spans["gpu_lora_copy_s"],  # expert-LoRA factors to the host and their gradients back
        "pin_s": spans["cpu_pin_s"],  # the host copying results into pinned buffers: part of cpu_idle_s
        "cpu_idle_s": step_s - spans["cpu_experts_s"],  # backend idle while the device works
        "gpu_idle_s": waiting,  # device idle while the CPU works
    }


def run_ktcore(settings: Settings, model_dir: Path, expert_format: str = "bf16", backend: Optional[str] = None,
               placement: str = "cpu", lora_device: str = "model", gpu_experts: int = 0) -> Iterator[dict]:
    """ktcore.load_model with ``placement``, ``kt_expert_lora_device: lora_device`` and ``kt_num_gpu_experts:
    gpu_experts`` + PEFT, per tokens: expert LoRA off (unless not asked, or a run with the LoRA on the model's
    device times it) then on; then the loss curve (``settings.loss_steps``) at the first tokens."""
    from peft import get_peft_model

    from .. import load_model
    from ..model.checkpointing import checkpoint_non_experts
    from ..model.host_lora import host_factor_bytes
    from ..model.lm_loss import chunk_lm_loss
    from ..model.peft_expert_lora import peft_wrapping
    from ..experts.timeline import attach

    device = settings.device
    kt = {"kt_backend": backend or settings.backend, "kt_num_threads": settings.threads,
          "kt_expert_placement": placement, "kt_stream_ring": settings.stream_ring,
          "kt_stream_activation": settings.stream_activation,
          "kt_hybrid_cpu_share": settings.hybrid_cpu_share, "kt_rates": settings.rates,
          "kt_expert_lora_device": lora_device, "kt_num_gpu_experts": gpu_experts,
          "kt_gpu_experts_interval": settings.gpu_experts_interval}
    base = load_model(model_dir, kt, device=device, dtype=settings.dtype, progress=False)
    chunk_lm_loss(base)  # as ktcore train
    stream = base.ktcore.stream
    if settings.gradient_checkpointing:
        checkpoint_non_experts(base)
    resident = list((base.ktcore.resident or {}).values())
    backends = {layer.backend for layer in base.ktcore.layers.values()}
    pools = [getattr(b, "num_threads", None) for b in backends]
    common = {"expert_format": computed_format(expert_format, base.ktcore.config), "placement": placement,
              "expert_lora_device": lora_device,
              "backend": ",".join(sorted(b.name for b in backends)),
              "moe_layers": len(set(base.ktcore.layers) | set(base.ktcore.streamed)),
              "backend_threads": max((n for n in pools if n), default=None),
              "torch_threads": torch.get_num_threads(),
              # host memory of the packed routed experts (for a GGUF: the file's blocks, mapped)
              "expert_gib": base.ktcore.packed_bytes / GIB,
              # kt_num_gpu_experts: per layer; their device buffers
              "gpu_experts": gpu_experts, "gpu_experts_gib": sum(r.device_bytes for r in resident) / GIB}
    # without expert LoRA its device makes no difference: timed once, by the model-device run when there is one
    lora_off = settings.expert_lora_off and (lora_device == "model" or "model" not in settings.expert_lora_devices) \
        and gpu_experts == min(settings.num_gpu_experts)
    variants = ([False] if lora_off else []) + [True]
    for tokens in settings.tokens:
        # the backend alone on whole layers: a figure of the cpu placement (a hybrid layer's backend has a share)
        kernels = kernel_time(base, tokens, settings.rank, settings.kernel_seconds if placement == "cpu" else 0,
                              settings.dtype)
        step_off = None
        for expert_lora in variants:
            run = (("ktcore" if placement == "cpu" else f"ktcore {placement}")
                   + (f", {gpu_experts} experts resident" if gpu_experts else "")
                   + ("" if expert_lora else ", no expert LoRA")
                   + (", expert LoRA on host" if expert_lora and lora_device == "host" else ""))
            model = None
            try:
                torch.manual_seed(0)
                with peft_wrapping(base):  # as the frontends make it (kt_expert_lora_device: host moves it)
                    model = get_peft_model(base, lora_config(base, settings.rank, experts=expert_lora))
                model.train()
                _reset_peaks(device)
                auto = base.ktcore.auto
                if auto:
                    auto.try_again()  # expert LoRA on or off changes the step: each run keeps its own choice
                with attach(base) as timeline:
                    timed = train_steps(model, tokens, settings.warmup, settings.steps, device, timeline, memory=True,
                                        settled=auto and (lambda: auto.settled(tokens)),
                                        counters=lambda: copy_counts(stream, resident), profile=settings.profile)
                step_s = timed["step_s"]
                split = split_of(step_s, timed["spans"], device)
                # over the timed steps: host-to-device expert bytes per step (gpu_stream: the pinned-bandwidth bound
                # they set; kt_num_gpu_experts: the resident experts' refresh copies), and the refreshes
                copied, refreshes, refresh_s = timed["counted"]
                split["h2d_gb"] = copied / settings.steps / 1e9
                split["h2d_gbps"] = pinned_gbps(device) if copied else None
                split["pcie_share"] = pcie_share(split["h2d_gb"], step_s, split["h2d_gbps"])
                if resident:
                    split["gpu_experts_refreshes"] = refreshes
                    split["gpu_experts_refresh_s"] = refresh_s / settings.steps
                if not expert_lora:
                    step_off = step_s
                elif step_off is not None:
                    split["expert_lora_s"] = step_s - step_off
                # the same layers at the routing the step had, LoRA on or off as in the step: the ratio's kernels
                routed = kernel_time_routed(base, timeline.routing if placement == "cpu" else {}, settings.rank,
                                            settings.kernel_seconds, expert_lora, settings.dtype)
                kernel_s = routed["kernel_step_routing_s"]
                yield _row(settings, run, tokens, **common, expert_lora=expert_lora, step_s=step_s,
                           tok_s=tokens / step_s, split=split, **kernels, **routed,
                           overhead_ratio=step_s / (kernel_s + split["gpu_busy_s"]) if kernel_s else None,
                           peak_gpu_gib=timed["peak_gpu_gib"], peak_host_gib=timed["peak_host_gib"],
                           host_lora_gib=host_factor_bytes(base) / GIB, memory=timed["memory"],
                           auto_choice=auto and auto_choices(auto, tokens), profile=timed.get("profile"), error=None)
            except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others still run
                yield _row(settings, run, tokens, **common, expert_lora=expert_lora, error=_error_line(exc))
            finally:
                if model is not None:
                    base = model.unload()
                del model
    if settings.loss_steps:
        yield from _loss_run(settings, base, common)
    del base
    _reset_peaks(device)


def computed_format(source_format: str, kt) -> str:
    """The format the experts are computed in (streamed ones too): the source's, or for a bf16 model whose experts
    are quantised as it loads (kt_expert_weight_format int8, or kt_backend amx_int8), that format."""
    from ..plugins.select import experts_format

    quantised = experts_format(kt)
    return quantised if source_format == "bf16" and quantised not in ("auto", "bf16") else source_format


def auto_choices(auto, tokens: int) -> str:
    """What auto placement's layers took at the last call of ``tokens``, e.g. ``hybrid 4/64 x5``, and what its
    measured steps decided."""
    counts = Counter(auto.chosen.get(tokens, {}).values())
    verdict = auto.trials.verdict(tokens)
    return (", ".join(f"{choice} x{count}" for choice, count in sorted(counts.items()))
            + (f" (measured steps: {verdict})" if verdict else ""))


def _loss_run(settings: Settings, base, common: dict) -> Iterator[dict]:
    from peft import get_peft_model

    from ..model.peft_expert_lora import peft_wrapping

    tokens, model = settings.tokens[0], None
    try:
        torch.manual_seed(0)
        with peft_wrapping(base):
            model = get_peft_model(base, lora_config(base, settings.rank))
        model.train()
        _reset_peaks(settings.device)
        losses = loss_curve(model, tokens, settings.loss_steps, settings.device)
        yield _row(settings, LOSS_RUN, tokens, **common, expert_lora=True, steps=settings.loss_steps,
                   losses=losses, loss_first=losses[0], loss_last=losses[-1], loss_vs_bf16=None,
                   **_peaks(settings.device), error=None)
    except Exception as exc:  # noqa: BLE001 - reported like the timed runs
        yield _row(settings, LOSS_RUN, tokens, **common, expert_lora=True, error=_error_line(exc))
    finally:
        if model is not None:
            model.unload()


def offload_map(model, arch) -> dict:
    """An accelerate device_map: routed experts in host memory, every other module and tensor on GPU 0."""
    from ..model.wrap import expert_modules

    experts = {name for _, name, _ in expert_modules(model, arch)}
    device_map = {}

    def place(prefix: str, module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full in experts:
                device_map[full] = "cpu"
            elif any(e.startswith(full + ".") for e in experts):
                place(full + ".", child)
            else:
                device_map[full] = 0
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            device_map[f"{prefix}{name}"] = 0

    place("", model)
    return device_map


def run_transformers(settings: Settings, model_dir: Path, offload: bool) -> Iterator[dict]:
    """Plain transformers + PEFT: the whole model on the device, or (offload) the routed experts in host memory
    through accelerate's device_map. Expert LoRA first; if that cannot run, without it."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from ..model.peft_expert_lora import peft_wrapping
    from ..model.wrap import find_arch

    device = settings.device
    run = ("transformers + accelerate, routed experts offloaded to host memory" if offload else
           f"transformers + PEFT, whole model on {device.type}")
    if offload and device.type != "cuda":
        yield _row(settings, run, settings.tokens[0], error="needs a GPU")
        return
    if offload:
        from transformers import AutoConfig

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        device_map = offload_map(skeleton, find_arch(skeleton.config))
        del skeleton
    else:
        device_map = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
        if device.type == "cuda":
            weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
            free = torch.cuda.mem_get_info(device)[0]
            if weights > free:
                yield _row(settings, run, settings.tokens[0], error=f"does not fit: {weights / GIB:.1f} GiB of "
                                                                    f"weights, {free / GIB:.1f} GiB free on the GPU")
                return
    for expert_lora in (True, False):
        model = None
        try:
            _reset_peaks(device)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=settings.dtype, device_map=device_map)
            if settings.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            torch.manual_seed(0)
            with peft_wrapping():
                model = get_peft_model(model, lora_config(model, settings.rank, experts=expert_lora))
            model.train()
            for tokens in settings.tokens:
                _reset_peaks(device)
                timed = train_steps(model, tokens, settings.warmup, settings.steps, device)
                step_s = timed.pop("step_s")
                yield _row(settings, run, tokens, expert_lora=expert_lora, step_s=step_s, tok_s=tokens / step_s,
                           **timed, error=None)
            return
        except Exception as exc:  # noqa: BLE001 - reported as a user trying it would see it; then without
            yield _row(settings, run, settings.tokens[0], expert_lora=expert_lora, error=_error_line(exc))
        finally:
            del model
            _reset_peaks(device)


def run(settings: Settings, model_dir: Optional[Path] = None, workdir: Optional[Path] = None,
        keep: bool = False) -> Iterator[dict]:
    """Every run's row, as each finishes: per expert format (bf16 first), then the transformers baselines. Builds
    the model (unless ``model_dir``) and its GGUF files (for formats other than bf16) in a scratch directory,
    deleted afterwards unless ``keep``. A ``model_dir`` that is a .gguf file is timed as it is."""
    scratch = None
    quantised = [f for f in settings.expert_formats if f != "bf16"]
    if model_dir is None or quantised:
        scratch = Path(tempfile.mkdtemp(prefix="ktcore-bench-", dir=workdir))
    try:
        config = make_config(settings.shape, settings.layers, settings.tiny) if model_dir is None else None
        if quantised:  # refused before anything is built
            from transformers import AutoConfig

            from ..weights.gguf_writer import writable_arch

            writable_arch(config or AutoConfig.from_pretrained(model_dir), f"--expert-format {','.join(quantised)}")
        if model_dir is None:
            model_dir = write_random_model(config, scratch / "model")
        if model_dir.is_file():
            yield from run_ktcore(settings, model_dir, expert_format="gguf file")
            return
        models = {"bf16": model_dir, **write_gguf_models(model_dir, quantised, scratch)}
        bf16_loss = None
        for fmt in settings.expert_formats:
            # kt_num_gpu_experts goes with the cpu placement only (the others refuse it)
            for row in (r for placement in settings.placements for lora_device in settings.expert_lora_devices
                        for n in settings.num_gpu_experts if n == 0 or placement == "cpu"
                        for r in run_ktcore(settings, models[fmt], fmt, None if fmt == "bf16" else GGUF_BACKEND,
                                            placement, lora_device, n)):
                if row["run"] == LOSS_RUN and row["error"] is None:
                    if fmt == "bf16":
                        bf16_loss = row["loss_last"]
                    elif bf16_loss is not None:
                        row["loss_vs_bf16"] = (row["loss_last"] - bf16_loss) / bf16_loss
                yield row
        if settings.baseline:
            yield from run_transformers(settings, model_dir, offload=False)
            yield from run_transformers(settings, model_dir, offload=True)
    finally:
        if scratch is not None and not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        elif scratch is not None:
            print(f"ktcore: kept the models in {scratch} (--model PATH times one again)", file=sys.stderr)


COLUMNS = (("run", "run"), ("expert_format", "experts"), ("tokens", "tokens"), ("tok_s", "tok/s"), ("step_s", "step s"),
           ("gpu_busy_s", "gpu busy"), ("cpu_experts_s", "cpu experts"), ("expert_lora_s", "expert lora"),
           ("h2d_gb", "h2d GB"), ("pcie_share", "PCIe share"), ("copies_s", "copies"),
           ("lora_copies_s", "lora copies"), ("pin_s", "pin"), ("cpu_idle_s", "cpu idle"),
           ("gpu_idle_s", "gpu idle"), ("kernel_s", "kernels"), ("kernel_no_lora_s", "kernels no lora"),
           ("kernel_step_routing_s", "kernels, step routing"), ("routing_max_over_mean", "routing max/mean"),
           ("overhead_ratio", "step/(kernels+gpu)"), ("peak_gpu_gib", "peak gpu GiB"),
           ("peak_host_gib", "peak host GiB"), ("expert_gib", "expert GiB"), ("host_lora_gib", "host LoRA GiB"),
           ("gpu_experts_gib", "gpu experts GiB"), ("gpu_experts_refreshes", "refreshes"),
           ("gpu_experts_refresh_s", "refresh s/step"),
           ("resident_gib", "resident GiB"),
           ("activations_gib", "activations GiB"), ("layers_peak_gib", "layers peak"), ("loss_peak_gib", "loss peak"),
           ("backward_peak_gib", "backward peak"), ("peak_phase", "peak in"), ("loss_first", "loss first"),
           ("loss_last", "loss last"), ("loss_vs_bf16", "loss vs bf16"), ("auto_choice", "auto took"),
           ("error", "error"))


def format_header(settings: Settings) -> str:
    where = "GPU" if settings.device.type == "cuda" else "no GPU: the CPU, at a tiny shape of the family"
    return (f"ktcore bench train: {settings.shape.name}, {settings.layers or 'all'} layers, LoRA r={settings.rank}, "
            f"{settings.warmup} warm-up + {settings.steps} timed steps, one sequence per step; {where}; "
            f"gradient checkpointing {'on' if settings.gradient_checkpointing else 'off'}\n"
            "| " + " | ".join(label for _, label in COLUMNS) + " |\n|" + "---|" * len(COLUMNS))


def format_row(row: dict) -> str:
    values = {**row, **(row.get("split") or {}), **(row.get("memory") or {})}

    def cell(key):
        v = values.get(key)
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    return "| " + " | ".join(cell(key) for key, _ in COLUMNS) + " |"


def format_profile(row: dict) -> str:
    """The run's profiled step (``--profile``) under its row: one line per op."""
    ops = row.get("profile") or []
    head = f"  profile of one step, {row['run']} at {row['tokens']} tokens (ms of its own, calls):"
    return "\n".join([head] + [f"    {op['ms']:9.2f}  {op['calls']:6d}  {op['op']}" for op in ops]) if ops else ""


def environment() -> dict:
    import transformers

    from ..plugins.threads import usable_cores

    return {"torch": torch.__version__, "transformers": transformers.__version__, "cores": usable_cores(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
