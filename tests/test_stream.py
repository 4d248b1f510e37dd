"""``gpu_stream`` placement (``ktcore/model/stream.py``) against unmodified transformers + PEFT and against the
``cpu`` placement: logits, loss and every LoRA gradient. On the CPU the model's device is the CPU, so the
same code runs without side streams: fetch, LoRA added as PEFT adds it, transformers' grouped kernel, and the
saved-tensor hooks that make backward fetch the weights again instead of keeping them."""

import copy

import pytest
import torch
from archs import MOE_LAYERS, tiny_model
from peft import get_peft_model
from test_equivalence import (assert_as_close_as_plain_bf16, assert_same_training_signal, batch, lora_config,
                              lora_grads, peft_pair, tiny_model_of)

import ktcore
from ktcore.errors import ConfigError
from ktcore.model.checkpointing import checkpoint_non_experts
from ktcore.model.placeholder import is_placeholder
from ktcore.testing import relative_error


def streamed(model, ring=2, **kt):
    return ktcore.wrap_model(model, {"kt_config": {"kt_backend": "torch", "kt_expert_placement": "gpu_stream",
                                                   "kt_stream_ring": ring, **kt}})


@pytest.mark.parametrize("ring", [1, 2], ids=["ring-1-refetch", "ring-holds-all"])
def test_gpu_stream_matches_transformers_and_peft(qwen3_pair, ring):
    """ring 1: every backward fetches its layer again through the saved-tensor hooks (the tiny model has 2 MoE
    layers); ring 2: both layers stay, autograd keeps the weights."""
    plain, ours = qwen3_pair
    streamed(ours, ring)
    experts = ours.model.layers[0].mlp.experts
    assert is_placeholder(experts.gate_up_proj) and not ours.ktcore.layers  # no CPU-backend layer
    assert len(ours.ktcore.stream.host) == 2
    assert_same_training_signal(*peft_pair(plain, ours), *batch(3))


def test_refetch_happens_and_weights_are_not_kept(qwen3_pair):
    """With ring 1 the saved-tensor hooks must replace the layer's weights: count what backward fetches."""
    plain, ours = qwen3_pair
    streamed(ours, ring=1)
    stream = ours.ktcore.stream
    calls = []
    fetch = stream.fetch
    stream.fetch = lambda index, direction, *first: calls.append((index, direction)) or fetch(index, direction, *first)
    _, model = peft_pair(plain, ours)
    ids, mask = batch(4)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    forward = [c for c in calls if c[1] == +1]
    backward = [c for c in calls if c[1] == -1]
    assert [i for i, _ in forward] == [0, 1]
    assert backward and {i for i, _ in backward} == {0, 1}  # each layer fetched again in backward, last first
    assert backward[0][0] == 1


@pytest.mark.parametrize("experts", ["dense", "int8"])
def test_no_device_weights_live_from_forward_to_backward(qwen3_pair, monkeypatch, experts):
    """Ring 1: between a step's forward and its backward no weights a layer computed with are alive but the
    host's own (on the CPU the ring's copy is the host tensor): the saved-tensor hooks once kept LoRA-added weights
    alive through their closure, one copy of every streamed layer (5.2 GiB of DeepSeek-V2-Lite's 6 layers on the
    H200 machine); int8 experts are dequantised into a tensor of their own, which must not be kept either."""
    import gc
    import weakref

    from ktcore.model import stream as stream_module

    if experts == "int8":
        int8_usable_or_skip()
    plain, ours = qwen3_pair
    streamed(ours, ring=1, **({"kt_backend": "amx_int8"} if experts == "int8" else {}))
    host = {t.untyped_storage().data_ptr() for layer in ours.ktcore.stream.host for part in layer for t in part}
    made = []
    real = stream_module.weight_of

    def recorded(*args):
        out = real(*args)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(stream_module, "weight_of", recorded)
    _, model = peft_pair(plain, ours)
    ids, mask = batch(4)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    gc.collect()
    alive = [ref() for ref in made if ref() is not None]
    assert len(made) == 4 and all(t.untyped_storage().data_ptr() in host for t in alive)  # 2 layers x 2 parts
    assert experts == "dense" or not alive
    loss.backward()


def test_gpu_stream_matches_cpu_placement(qwen3_pair):
    """The two placements of the same weights and adapter give the same training signal."""
    plain, ours = qwen3_pair
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    streamed(ours, ring=1)
    a, b = peft_pair(on_cpu, ours)
    assert_same_training_signal(a, b, *batch(5))


@pytest.mark.parametrize("placement", ["gpu_stream", "hybrid", "checkpointed"])
def test_recomputed_stream_matches_cpu_placement(qwen3_pair, placement):
    """kt_stream_activation: recompute, streamed and hybrid (ring 1), and inside checkpointed decoder layers: the
    same training signal as the cpu placement; backward fetches each layer again for its recomputation."""
    plain, ours = qwen3_pair
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    place = hybrid if placement == "hybrid" else streamed
    place(ours, ring=1, kt_stream_activation="recompute")
    stream = ours.ktcore.stream
    assert stream.recompute
    calls = []
    fetch = stream.fetch
    stream.fetch = lambda index, direction, *first: calls.append(direction) or fetch(index, direction, *first)
    if placement == "checkpointed":
        for model in (on_cpu, ours):
            checkpoint_non_experts(model)
            model.train()
    a, b = peft_pair(on_cpu, ours)
    assert_same_training_signal(a, b, *batch(5))
    assert calls.count(+1) == calls.count(-1) > 0  # each forward's layer fetched once more in its backward


def test_recomputed_stream_keeps_no_token_slot_activations(qwen3_pair):
    """Between forward and backward, a recomputing streamed model holds less than a retaining one by about the
    grouped kernel's per-token-slot activations ((2 H + 4 I) values a slot, the cost model's figure)."""
    from ktcore.model.memory import LiveTensors

    plain, _ = qwen3_pair
    ids, mask = batch(7)
    held = {}
    for activation in ("retain", "recompute"):
        model = streamed(copy.deepcopy(plain), ring=1, kt_stream_activation=activation)
        _, model = peft_pair(copy.deepcopy(plain), model)
        meter = LiveTensors()
        with meter.tracking():
            meter.count(list(model.parameters()))
            before = meter.current()
            loss = model(ids, attention_mask=mask, labels=ids).loss
            held[activation] = meter.current() - before
            loss.backward()
    config = plain.config
    slots = ids.numel() * config.num_experts_per_tok * 2  # 2 MoE layers
    per_slot = (2 * config.hidden_size + 4 * config.moe_intermediate_size) * 4  # fp32 here
    assert held["retain"] - held["recompute"] >= 0.8 * slots * per_slot, held  # measured 1.03x it


def test_placement_rule_streams_one_layer():
    """kt_placement {device: gpu_stream} for one layer, the CPU backend for the other; against transformers."""
    plain = tiny_model("deepseek_v2", seed=6)
    first = MOE_LAYERS["deepseek_v2"][0]
    ours = ktcore.wrap_model(copy.deepcopy(plain), {"kt_config": {"kt_backend": "torch", "kt_placement": [
        {"match": rf"layers\.{first}\.", "device": "gpu_stream"}]}})
    assert len(ours.ktcore.stream.host) == 1 and len(ours.ktcore.layers) == 1
    a, b = peft_pair(plain, ours)
    assert_same_training_signal(a, b, *batch(6))  # measured 1e-7 (logits), 4e-7 (gradients)


def test_disabled_adapter_streams_the_base_weights(qwen3_pair):
    plain, ours = qwen3_pair
    base = plain(batch()[0]).logits
    streamed(ours, ring=1)
    _, model = peft_pair(copy.deepcopy(plain), ours)
    with torch.no_grad(), model.disable_adapter():
        assert relative_error(model(batch()[0]).logits, base) <= 1e-5


def hybrid(model, share=0.5, ring=1, **kt):
    return ktcore.wrap_model(model, {"kt_config": {"kt_backend": "torch", "kt_expert_placement": "hybrid",
                                                   "kt_hybrid_cpu_share": share, "kt_stream_ring": ring, **kt}})


@pytest.mark.parametrize("share", [0.25, 0.75])
def test_hybrid_matches_transformers_and_peft(qwen3_pair, share):
    """The first experts on the torch backend, the others streamed (ring 1: backward fetches again); the tiny
    model's routing reaches experts on both sides, so both halves of every LoRA factor get gradients."""
    plain, ours = qwen3_pair
    hybrid(ours, share)
    experts = ours.model.layers[0].mlp.experts
    n = round(share * experts.num_experts)
    assert len(ours.ktcore.layers) == 2 and len(ours.ktcore.stream.host) == 2
    assert ours.ktcore.stream.experts(0) == experts.num_experts - n
    a, b = peft_pair(plain, ours)
    ids, mask = batch(9)
    routed = a(ids, attention_mask=mask, output_router_logits=True).router_logits[0].topk(2, dim=-1).indices
    assert (routed < n).any() and (routed >= n).any()  # both sides have work
    assert_same_training_signal(a, b, ids, mask)


def test_hybrid_matches_cpu_placement_on_deepseek():
    """DeepSeek-V2 (shared experts after the routed ones: the CPU layers there overlap them) with one layer
    hybrid by a rule and the other on the CPU backend, against the whole model on the CPU backend."""
    plain = tiny_model("deepseek_v2", seed=6)
    first = MOE_LAYERS["deepseek_v2"][0]
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    ours = ktcore.wrap_model(copy.deepcopy(plain), {"kt_config": {
        "kt_backend": "torch", "kt_hybrid_cpu_share": 0.5,
        "kt_placement": [{"match": rf"layers\.{first}\.", "device": "hybrid"}]}})
    assert len(ours.ktcore.stream.host) == 1 and len(ours.ktcore.layers) == 2
    a, b = peft_pair(on_cpu, ours)
    assert_same_training_signal(a, b, *batch(10))  # measured 1e-7 (logits), 5e-7 (gradients)


def test_hybrid_share_must_leave_each_side_an_expert(qwen3_pair):
    _, ours = qwen3_pair
    with pytest.raises(ValueError, match="needs 1 to"):
        hybrid(ours, share=0.01)


def test_bad_rates_file_is_one_line_before_any_weight(qwen3_pair, tmp_path):
    _, ours = qwen3_pair
    with pytest.raises(ConfigError, match="missing.json: not a readable JSON rates file"):
        ktcore.wrap_model(ours, {"kt_config": {"kt_expert_placement": "auto",
                                               "kt_rates": str(tmp_path / "missing.json")}})
    assert not is_placeholder(ours.model.layers[0].mlp.experts.gate_up_proj)


def test_stream_ring_must_hold_a_layer(qwen3_pair):
    _, ours = qwen3_pair
    with pytest.raises(ValueError, match="kt_stream_ring must be >= 1"):
        streamed(ours, ring=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("ring", [1, 3])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("placement", ["gpu_stream", "hybrid"])
@pytest.mark.parametrize("activation", ["retain", "recompute"])
def test_gpu_stream_on_cuda_bf16(tmp_path, family, ring, placement, activation):
    """Experts pinned in host memory, copied on the side stream with the next layer prefetched, computed by
    transformers' grouped kernel on CUDA in bf16 (hybrid: half of them, the CPU backend the other half at the
    same time; recompute: the grouped forward again in backward): as close to the fp32 truth as plain transformers
    in bf16 (loss and every LoRA gradient), and the bytes copied are the layers' (and again in backward with ring
    1)."""
    plain = tiny_model_of(family)
    plain.save_pretrained(tmp_path / "model")
    truth = copy.deepcopy(plain).to("cuda")
    plain_bf16 = copy.deepcopy(plain).to("cuda", torch.bfloat16)
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "torch", "kt_expert_placement":
                                                                placement, "kt_stream_ring": ring,
                                                                "kt_hybrid_cpu_share": 0.5,
                                                                "kt_stream_activation": activation}},
                             device="cuda", dtype=torch.bfloat16, progress=False)
    assert_streamed_on_cuda(ours, truth, plain_bf16, ring)


def assert_streamed_on_cuda(ours, truth, plain_bf16, ring: int) -> list:
    """A streamed model on CUDA in bf16: its host experts pinned, as close to the fp32 ``truth`` as plain
    transformers in bf16, and the bytes copied the layers' (forward copies every layer once, backward again each
    layer the ring no longer holds: with ring 1 the first); returns each layer's host bytes."""
    stream = ours.ktcore.stream
    assert all(t.is_pinned() for layer in stream.host for part in layer for t in part)
    truth, plain_bf16 = peft_pair(truth, plain_bf16)
    torch.manual_seed(7)
    ours = get_peft_model(ours, lora_config())
    ids, mask = (t.cuda() for t in batch(8))
    assert_as_close_as_plain_bf16(truth, plain_bf16, ours, ids, mask)
    sizes = [sum(t.numel() * t.element_size() for part in layer for t in part) for layer in stream.host]
    assert stream.copied_bytes == sum(sizes) + (sizes[0] if ring == 1 else 0)
    return sizes


@pytest.mark.parametrize("placement", ["gpu_stream", "hybrid"])
def test_load_model_streams_from_the_checkpoint(tmp_path, placement):
    """The loading path (experts read from the safetensors into the stream and the backend) gives what
    transformers + PEFT give on the same checkpoint."""
    plain = tiny_model_of("qwen3_moe")
    plain.save_pretrained(tmp_path / "model")
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "torch", "kt_expert_placement": placement,
                                                                "kt_stream_ring": 1, "kt_hybrid_cpu_share": 0.5}},
                             device="cpu", progress=False)
    assert len(ours.ktcore.streamed) == 2 and len(ours.ktcore.layers) == (2 if placement == "hybrid" else 0)
    assert_same_training_signal(*peft_pair(plain, ours), *batch(11))


# ---- int8 experts: the stream keeps and copies their codes ------------------------------------------------------


def int8_usable_or_skip():
    from ktcore_tiny import backend_unusable

    why = backend_unusable("amx_int8", "int8")
    if why:  # neither AMX nor AVX-512 VNNI here
        pytest.skip(f"amx_int8 is not usable here: {why}")


def with_int8_experts(model):
    """A copy of ``model`` whose routed experts are what their int8 codes stand for (``int8-sym-channel-v1``: one
    scale per output channel, so gate_up's rows quantise as gate's and up's do): the truth of an int8 stream."""
    from ktcore.model.arch import expert_modules, find_arch
    from ktcore.experts.int8 import dequantize, quantize

    truth = copy.deepcopy(model)
    with torch.no_grad():
        for _, _, module in expert_modules(truth, find_arch(truth.config)):
            for weight in (module.gate_up_proj, module.down_proj):
                weight.copy_(dequantize(*quantize(weight), weight.dtype))
    return truth


@pytest.mark.parametrize("keys", [{"kt_backend": "amx_int8"}, {"kt_backend": "auto", "kt_expert_weight_format": "int8"}],
                         ids=["backend-amx_int8", "format-int8"])
def test_int8_experts_stream_their_codes(qwen3_pair, keys):
    """With int8 experts the host keeps int8 codes and float32 scales (a quarter of fp32's bytes here, half of
    bf16's), and the streamed model is transformers + PEFT on the weights those codes stand for, to fp32 rounding:
    a stream that kept the original weights would be 1e-3 off in the logits, one that mixed up rows or scales far
    more."""
    int8_usable_or_skip()
    plain, ours = qwen3_pair
    streamed(ours, ring=1, **keys)
    stream = ours.ktcore.stream
    for layer in stream.host:
        for codes, scales in layer:
            assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == codes.shape[:-1]
    experts = ours.model.layers[0].mlp.experts
    held = sum(t.numel() * t.element_size() for layer in stream.host for part in layer for t in part)
    dense = 2 * (experts.gate_up_proj.numel() + experts.down_proj.numel()) * 4
    assert held < 0.3 * dense
    truth = with_int8_experts(plain)
    assert relative_error(truth(batch()[0]).logits, plain(batch()[0]).logits) > 1e-4  # int8 is not a no-op here
    assert_same_training_signal(*peft_pair(truth, ours), *batch(12))


def test_int8_hybrid_streams_the_codes_its_cpu_share_computes(qwen3_pair):
    """A hybrid layer with int8 experts: amx_int8 packs experts ..n, the stream keeps exactly the int8 codes and
    scales of experts n.. (the scheme the backend quantises with), and the layer trains as transformers on the int8
    weights does, within amx_int8's own rounding of its activations (measured 1.0e-2 in the logits and 5.0e-2 in
    the gradients; keeping the original weights in the stream measured 1.7e-2 / 6.2e-2, so the bounds catch what
    the codes check cannot: scales applied to the wrong rows or experts)."""
    from ktcore.experts.int8 import quantize

    int8_usable_or_skip()
    plain, ours = qwen3_pair
    hybrid(ours, 0.5, kt_backend="amx_int8")
    experts = plain.model.layers[0].mlp.experts
    n = experts.num_experts // 2
    (codes, scales), (down_codes, down_scales) = ours.ktcore.stream.host[0]
    for (c, s), weight in (((codes, scales), experts.gate_up_proj), ((down_codes, down_scales), experts.down_proj)):
        want_c, want_s = quantize(weight.detach()[n:])
        assert torch.equal(c, want_c) and torch.equal(s, want_s)
    truth, model = peft_pair(with_int8_experts(plain), ours)
    ids, mask = batch(13)
    ref, ref_grads = lora_grads(truth, ids, mask)
    got, got_grads = lora_grads(model, ids, mask)
    assert relative_error(got.logits, ref.logits) <= 5e-2
    for name in ref_grads:
        assert relative_error(got_grads[name], ref_grads[name]) <= 0.25, name


def test_int8_store_streams_its_own_codes(tmp_path):
    """kt_weight_path with an int8 store and gpu_stream: the stream holds the store's codes and scales bit for bit
    (not dequantised and quantised again) and gives the model of those codes dequantised."""
    from ktcore.model.arch import expert_modules, find_arch
    from ktcore.weights.convert import convert_model
    from ktcore.weights.store import model_fingerprint, open_store
    from ktcore.weights.store_sources import Int8StoreExpertSource

    int8_usable_or_skip()
    plain = tiny_model_of("qwen3_moe")
    plain.save_pretrained(tmp_path / "model")
    convert_model(tmp_path / "model", tmp_path / "int8", "int8", 1, progress=False)
    ours = ktcore.load_model(tmp_path / "model", {"kt_weight_path": str(tmp_path / "int8"), "kt_config": {
        "kt_expert_placement": "gpu_stream", "kt_stream_ring": 1, "kt_expert_weight_format": "int8"}},
        device="cpu", progress=False)
    store = open_store(tmp_path / "int8", "experts", model_fingerprint(tmp_path / "model"), "kt_weight_path")
    for (_, name, module), layer in zip(expert_modules(plain, find_arch(plain.config)), ours.ktcore.stream.host):
        stored = Int8StoreExpertSource(store, name, find_arch(plain.config), module).read_int8()
        (gate_up, gate_up_scales), (down, down_scales) = layer
        assert torch.equal(gate_up, torch.cat([stored.gate[0], stored.up[0]], 1))
        assert torch.equal(gate_up_scales, torch.cat([stored.gate[1], stored.up[1]], 1))
        assert torch.equal(down, stored.down[0]) and torch.equal(down_scales, stored.down[1])
    assert_same_training_signal(*peft_pair(with_int8_experts(plain), ours), *batch(14))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("ring", [1, 3])
def test_int8_stream_on_cuda_bf16(tmp_path, ring):
    """int8 experts streamed on CUDA in bf16: codes and scales pinned and copied on the side stream, dequantised
    there: as close to the fp32 model of the int8 weights as plain transformers in bf16 on those weights, and the
    bytes copied are the codes' and scales' (half of bf16's and a little)."""
    int8_usable_or_skip()
    plain = tiny_model_of("qwen3_moe")
    plain.save_pretrained(tmp_path / "model")
    truth = with_int8_experts(plain).to("cuda")
    plain_bf16 = copy.deepcopy(truth).to(torch.bfloat16)
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "amx_int8", "kt_expert_placement":
                                                                "gpu_stream", "kt_stream_ring": ring}},
                             device="cuda", dtype=torch.bfloat16, progress=False)
    sizes = assert_streamed_on_cuda(ours, truth, plain_bf16, ring)
    experts = plain.model.layers[0].mlp.experts
    assert sizes[0] < 0.6 * (experts.gate_up_proj.numel() + experts.down_proj.numel()) * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_pinned_host_memory_is_its_own_size():
    """``pinned`` locks a tensor's own bytes (torch's pin_memory takes a power-of-two block: 128 MiB for this one
    of 65 MiB), the copy reads back equal, and the pages are unregistered once their owner is collected."""
    import gc

    from ktcore.model.pinned import pinned

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    nbytes = (1 << 26) + (1 << 20)
    t = torch.randint(-100, 100, (nbytes,), dtype=torch.int8)
    owner = type("Owner", (), {})()
    before = rss()
    locked = pinned(t, owner)
    grown = rss() - before
    assert locked.is_pinned() and torch.equal(locked, t) and locked.data_ptr() != t.data_ptr()
    assert 0.9 * nbytes <= grown <= 1.1 * nbytes, grown / nbytes
    assert torch.equal(locked.to("cuda", non_blocking=True).cpu(), t)
    del owner
    gc.collect()
    assert not locked.is_pinned()  # unregistered; the memory itself lives while a tensor uses it
