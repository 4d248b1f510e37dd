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

import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

DENSE_LINEARS = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts
GIB = 2**30


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
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
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
    target = ",".join(names + (["experts"] if experts else []))
    return lora_config_for(model, arch, TrainConfig(lora_rank=rank, lora_target=target))


def train_steps(model, tokens: int, warmup: int, steps: int, device: torch.device, timeline=None) -> dict:
    """Time ``steps`` SFT steps of one ``tokens``-long sequence (after ``warmup``): mean step seconds and, with a
    timeline, its mean spans per step."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(tokens)
    vocab = model.config.get_text_config().vocab_size
    times, spans = [], []
    for i in range(warmup + steps):
        ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
        _sync(device)
        if timeline is not None:
            timeline.reset()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            if timeline is not None:
                spans.append(timeline.resolve())
    del optimizer
    out = {"step_s": statistics.mean(times)}
    if spans:
        out["spans"] = {k: statistics.mean(s[k] for s in spans) for k in spans[0]}
    return out


def kernel_time(model, tokens: int, rank: int, seconds: float, dtype=torch.bfloat16) -> dict:
    """Forward + backward seconds of the model's CPU-backend expert layers at ``tokens`` tokens, called on the
    backend alone (random routing, random LoRA factors of rank r), summed over the layers; with and without
    expert LoRA (None for both when ``seconds`` is 0)."""
    from .bench import median_time
    from ..experts import ExpertLoRA

    layers = model.ktcore.layers
    if not layers or not seconds:
        return {"kernel_s": None, "kernel_no_lora_s": None}
    name, layer = next(iter(layers.items()))
    num, rows, hidden = model.get_submodule(name).gate_up_proj.shape
    inter, k = rows // 2, model.config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, num, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.rand(tokens, k, generator=g), dim=1)
    factors = [torch.randn(*s, generator=g) * 0.01 for s in ((num, rank, hidden), (num, rows, rank),
                                                               (num, rank, inter), (num, hidden, rank))]
    grad_y = torch.randn(tokens, hidden, generator=g).to(dtype)
    backend, packed = layer.backend, layer.packed

    def step(lora):  # through submit/wait, from another thread than the main one, as in training
        _, ctx = backend.wait(backend.submit_forward(packed, x, ids, w, lora, True))
        backend.wait(backend.submit_backward(packed, ctx, grad_y, lora))

    with_lora = median_time(lambda: step(ExpertLoRA(*factors, gate_up_scale=2.0, down_scale=2.0)), seconds)
    without = median_time(lambda: step(None), seconds)
    return {"kernel_s": with_lora * len(layers), "kernel_no_lora_s": without * len(layers)}


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
    placements: tuple = ("cpu",)  # kt_expert_placement of each ktcore run, side by side
    stream_ring: int = 2  # kt_stream_ring of the gpu_stream and hybrid runs
    hybrid_cpu_share: float = 0.5  # kt_hybrid_cpu_share of the hybrid runs
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
        "cpu_idle_s": step_s - spans["cpu_experts_s"],  # backend idle while the device works
        "gpu_idle_s": waiting,  # device idle while the CPU works
    }


def run_ktcore(settings: Settings, model_dir: Path, placement: str = "cpu") -> Iterator[dict]:
    """ktcore.load_model with ``placement`` + PEFT, per tokens: expert LoRA off (unless not asked) then on."""
    from peft import get_peft_model

    from .. import load_model
    from ..model.checkpointing import checkpoint_non_experts
    from ..experts.timeline import attach

    device = settings.device
    kt = {"kt_backend": settings.backend, "kt_num_threads": settings.threads, "kt_expert_placement": placement,
          "kt_stream_ring": settings.stream_ring, "kt_hybrid_cpu_share": settings.hybrid_cpu_share}
    base = load_model(model_dir, kt, device=device, dtype=settings.dtype, progress=False)
    stream = base.ktcore.stream
    if settings.gradient_checkpointing:
        checkpoint_non_experts(base)
    backends = {layer.backend for layer in base.ktcore.layers.values()}
    pools = [getattr(b, "num_threads", None) for b in backends]
    common = {"placement": placement, "backend": ",".join(sorted(b.name for b in backends)),
              "moe_layers": len(set(base.ktcore.layers) | set(base.ktcore.streamed)),
              "backend_threads": max((n for n in pools if n), default=None), "torch_threads": torch.get_num_threads()}
    variants = ([False] if settings.expert_lora_off else []) + [True]
    for tokens in settings.tokens:
        # the backend alone on whole layers: a figure of the cpu placement (a hybrid layer's backend has a share)
        kernels = kernel_time(base, tokens, settings.rank, settings.kernel_seconds if placement == "cpu" else 0,
                              settings.dtype)
        step_off = None
        for expert_lora in variants:
            run = ("ktcore" if placement == "cpu" else f"ktcore {placement}") + ("" if expert_lora else
                                                                                ", no expert LoRA")
            model = None
            try:
                torch.manual_seed(0)
                model = get_peft_model(base, lora_config(base, settings.rank, experts=expert_lora))
                model.train()
                _reset_peaks(device)
                copied = stream.copied_bytes if stream else 0
                with attach(base) as timeline:
                    timed = train_steps(model, tokens, settings.warmup, settings.steps, device, timeline)
                step_s = timed["step_s"]
                split = split_of(step_s, timed["spans"], device)
                # host-to-device expert bytes per step (gpu_stream), and the pinned-bandwidth bound they set
                split["h2d_gb"] = ((stream.copied_bytes - copied) / (settings.warmup + settings.steps) / 1e9
                                   if stream else 0.0)
                if not expert_lora:
                    step_off = step_s
                elif step_off is not None:
                    split["expert_lora_s"] = step_s - step_off
                denominator = (kernels["kernel_s"] or 0) + split["gpu_busy_s"]
                yield _row(settings, run, tokens, **common, expert_lora=expert_lora, step_s=step_s,
                           tok_s=tokens / step_s, split=split, **kernels,
                           overhead_ratio=step_s / denominator if kernels["kernel_s"] else None,
                           **_peaks(device), error=None)
            except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others still run
                yield _row(settings, run, tokens, **common, expert_lora=expert_lora, error=_error_line(exc))
            finally:
                if model is not None:
                    base = model.unload()
                del model
    del base
    _reset_peaks(device)


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
            model = get_peft_model(model, lora_config(model, settings.rank, experts=expert_lora))
            model.train()
            for tokens in settings.tokens:
                _reset_peaks(device)
                step_s = train_steps(model, tokens, settings.warmup, settings.steps, device)["step_s"]
                yield _row(settings, run, tokens, expert_lora=expert_lora, step_s=step_s, tok_s=tokens / step_s,
                           **_peaks(device), error=None)
            return
        except Exception as exc:  # noqa: BLE001 - reported as a user trying it would see it; then without
            yield _row(settings, run, settings.tokens[0], expert_lora=expert_lora, error=_error_line(exc))
        finally:
            del model
            _reset_peaks(device)


def run(settings: Settings, model_dir: Optional[Path] = None, workdir: Optional[Path] = None,
        keep: bool = False) -> Iterator[dict]:
    """Every run's row, as each finishes. Builds the model (unless ``model_dir``) and deletes it afterwards
    unless ``keep``."""
    built = None
    if model_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="ktcore-bench-", dir=workdir))
        built = write_random_model(make_config(settings.shape, settings.layers, settings.tiny), scratch / "model")
        model_dir = built
    try:
        for placement in settings.placements:
            yield from run_ktcore(settings, model_dir, placement)
        if settings.baseline:
            yield from run_transformers(settings, model_dir, offload=False)
            yield from run_transformers(settings, model_dir, offload=True)
    finally:
        if built is not None and not keep:
            shutil.rmtree(built.parent, ignore_errors=True)
        elif built is not None:
            print(f"ktcore: kept the model in {built} (--model {built} times it again)", file=sys.stderr)


COLUMNS = (("run", "run"), ("tokens", "tokens"), ("tok_s", "tok/s"), ("step_s", "step s"),
           ("gpu_busy_s", "gpu busy"), ("cpu_experts_s", "cpu experts"), ("expert_lora_s", "expert lora"),
           ("h2d_gb", "h2d GB"), ("copies_s", "copies"), ("lora_copies_s", "lora copies"), ("cpu_idle_s", "cpu idle"),
           ("gpu_idle_s", "gpu idle"), ("kernel_s", "kernels"), ("kernel_no_lora_s", "kernels no lora"),
           ("overhead_ratio", "step/(kernels+gpu)"), ("peak_gpu_gib", "peak gpu GiB"),
           ("peak_host_gib", "peak host GiB"), ("error", "error"))


def format_header(settings: Settings) -> str:
    where = "GPU" if settings.device.type == "cuda" else "no GPU: the CPU, at a tiny shape of the family"
    return (f"ktcore bench train: {settings.shape.name}, {settings.layers or 'all'} layers, LoRA r={settings.rank}, "
            f"{settings.warmup} warm-up + {settings.steps} timed steps, one sequence per step; {where}; "
            f"gradient checkpointing {'on' if settings.gradient_checkpointing else 'off'}\n"
            "| " + " | ".join(label for _, label in COLUMNS) + " |\n|" + "---|" * len(COLUMNS))


def format_row(row: dict) -> str:
    values = {**row, **(row.get("split") or {})}

    def cell(key):
        v = values.get(key)
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    return "| " + " | ".join(cell(key) for key, _ in COLUMNS) + " |"


def environment() -> dict:
    import transformers

    from ..plugins.threads import usable_cores

    return {"torch": torch.__version__, "transformers": transformers.__version__, "cores": usable_cores(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
