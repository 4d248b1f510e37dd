"""``kt_num_gpu_experts`` (``ktcore/model/resident.py``): a cpu layer's most used experts resident on the model's
device. On the CPU the model's device is the CPU, so the same code runs without pinned copies or events: the
counts, the choice, the id remap of both shares, the gathered LoRA factors and the saved-tensor hooks. Routing is
skewed by a hook on the experts modules (the same in both models), so the test knows which experts must become
resident."""

import copy
import types

import pytest
import torch
from archs import MOE_LAYERS, tiny_model
from ktcore_tiny import backend_unusable, tiny_qwen3_moe
from peft import get_peft_model
from test_equivalence import (assert_as_close_as_plain_bf16, assert_same_training_signal, batch, lora_config,
                              lora_grads, peft_pair, tiny_model_of)

import ktcore
from ktcore.errors import ConfigError
from ktcore.experts import ExpertWeights
from ktcore.model import resident as resident_module
from ktcore.model.checkpointing import checkpoint_non_experts
from ktcore.model.placeholder import is_placeholder
from ktcore.model.resident import DECAY, ResidentExperts, top_experts
from ktcore.testing import relative_error


def with_resident(model, n=2, interval=1, **kt):
    return ktcore.wrap_model(model, {"kt_config": {"kt_backend": "torch", "kt_num_gpu_experts": n,
                                                   "kt_gpu_experts_interval": interval, **kt}})


def skew(model, hot: list, family="qwen3_moe") -> None:
    """Every token's first expert becomes ``hot[0]`` and its second one of the others by its position, in every
    MoE layer. Both are fixed, not the router's: in bf16 a router's second choice flips on rounding (measured on
    CUDA: plain bf16 0.03 from the fp32 logits, ours 0.13, from one flip in one of them), which would hide the
    arithmetic the bf16 test compares."""
    def pre(module, args):
        hidden, idx, weights = args
        first = torch.full_like(idx[:, 0], hot[0])
        position = torch.arange(len(idx), device=idx.device)
        second = (hot[0] + 1 + position % (module.num_experts - 1)) % module.num_experts
        return hidden, torch.stack([first, second], dim=1), weights

    for i in MOE_LAYERS[family]:
        model.model.layers[i].mlp.experts.register_forward_pre_hook(pre)


def pair(n=2, interval=1, checkpointing=False):
    """(cpu placement, kt_num_gpu_experts=n) PEFT models of the same weights and adapter, routing skewed by
    the returned list's expert."""
    plain = tiny_qwen3_moe()
    hot = [5]
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    ours = with_resident(copy.deepcopy(plain), n, interval)
    for model in (on_cpu, ours):
        skew(model, hot)
        if checkpointing:
            checkpoint_non_experts(model)
            model.train()  # the checkpointed layers checkpoint only in training
    a, b = peft_pair(on_cpu, ours)
    return a, b, ours, hot


def torch_layer(host):
    """A layer of the torch backend packing the experts ``host`` holds (``stream.host_layout``'s (gate_up, down))."""
    backend = ktcore.get_backend("torch", {"kt_backend": "torch"})
    packed = backend.pack(ExpertWeights.from_fused(host[0][0], host[1][0]))
    return types.SimpleNamespace(backend=backend, packed=packed)


def sets(model):
    return [r.current.ids for r in model.ktcore.resident.values()]


def test_matches_cpu_placement_across_refreshes():
    """Loss, logits and every LoRA gradient equal cpu placement's at every step while the resident set moves:
    first experts 0, 1; after a call routed mostly to expert 5, 5 is resident; after one routed to 3, 3 is.
    A remap that computed a resident expert's slot on both sides (or neither), stale rows after a refresh, or
    LoRA factors gathered without gradient would each fail."""
    a, b, ours, hot = pair()
    assert sets(ours) == [(0, 1), (0, 1)]
    for step, (expert, seed) in enumerate([(5, 1), (5, 2), (3, 3), (3, 4)]):
        hot[0] = expert
        assert_same_training_signal(a, b, *batch(seed))
        if step == 1:
            assert all(5 in s for s in sets(ours)), sets(ours)  # chosen from step 0's counts
        if step == 3:
            assert all(3 in s for s in sets(ours)), sets(ours)
    assert all(r.refreshes >= 2 for r in ours.ktcore.resident.values())


def test_checkpointed_recompute_takes_its_forwards_set(monkeypatch):
    """Gradient checkpointing with a choice pending at every call: backward recomputes each layer with the set its
    forward used (kept on the tape). A recompute that took the pending set would add the device's share of other
    experts to the CPU share replayed from the forward, and the gradients would differ."""
    a, b, ours, hot = pair(checkpointing=True)
    recomputed, kept = [], resident_module.replay.kept
    monkeypatch.setattr(resident_module.replay, "kept", lambda: recomputed.append(1) or kept())
    for expert, seed in [(5, 1), (3, 2), (5, 3)]:
        hot[0] = expert
        before = sets(ours)
        assert_same_training_signal(a, b, *batch(seed))
        assert all(r.pending is not None for r in ours.ktcore.resident.values())  # a new set was due
    assert before != [(0, 1), (0, 1)]
    assert len(recomputed) == 3 * 2  # the layers were recomputed: 3 steps x 2 MoE layers


def test_two_forwards_before_one_backward():
    """Gradient accumulation's shape: a second forward (which takes a new set) before the first one's backward.
    Backward must rebuild each call's weights from its own set, not from the layer's current one."""
    a, b, ours, hot = pair()
    grads = {}
    for name, model in (("cpu", a), ("resident", b)):
        hot[0] = 5
        model.zero_grad()
        ids = batch(1)[0]
        first = model(ids, labels=ids).loss
        hot[0] = 3
        ids = batch(2)[0]
        second = model(ids, labels=ids).loss
        (first + second).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert sets(ours) != [(0, 1), (0, 1)]
    for name, ref in grads["cpu"].items():
        assert relative_error(grads["resident"][name], ref) <= 1e-4, name


def test_top_experts_moves_a_resident_expert_only_for_significantly_more_slots():
    assert top_experts([1, 9, 3, 9, 0], 2) == (1, 3)  # the first choice: the most slots, ties to the lower id
    assert top_experts([5, 5, 5, 5], 2) == (0, 1)
    assert top_experts([0, 0, 0, 7], 3) == (0, 1, 3)
    assert top_experts([5, 5, 5, 5], 2, current=(2, 3)) == (2, 3)  # a tie does not move an expert for nothing
    assert top_experts([5, 5, 6, 5], 2, current=(1, 3)) == (1, 3)  # nor does noise: 1 slot is < 2 sigma
    # a decode-like interval (a few slots each): no expert leads by 2 sigma, nothing is copied
    assert top_experts([3, 0, 1, 5, 2, 2, 4, 0], 2, current=(0, 5)) == (0, 5)
    # a real shift: 60 against 5 slots; of two tied residents the higher id goes
    assert top_experts([5, 5, 60, 5], 2, current=(1, 3)) == (1, 2)
    # each displacement is judged against the weakest resident left: 90 and 50 displace 0 and 10, 30 does not 20
    assert top_experts([0, 10, 20, 90, 50, 30], 3, current=(0, 1, 2)) == (2, 3, 4)


def test_counts_persist_across_calls_and_decay_at_each_choice():
    """Counts add up over the interval's calls (not just the last call's), are halved when a choice is taken,
    and the set changes only at the call after the interval ends."""
    host = ((torch.randn(4, 6, 3),), (torch.randn(4, 3, 3),))  # gate_up, down: (weight,) each
    r = ResidentExperts("layer", torch_layer(host), 4, 1, 3, "cpu", torch.float32)
    # 20 tokens a call: a shift of the routing beyond top_experts' noise margin
    calls = [torch.tensor([[2, 1]] * 20), torch.tensor([[2, 3], [3, 1]] * 20), torch.tensor([[3, 0]] * 20)]
    for i, ids in enumerate(calls):
        assert r.choose().ids == (0,)
        r.count(ids)
        assert (r.pending is None) == (i < 2)
    expected = torch.tensor([20.0, 40, 40, 60])
    assert torch.equal(r.pending[0], expected)
    assert torch.equal(r.counts, expected * DECAY)
    assert r.choose().ids == (3,) and r.refreshes == 1
    assert torch.equal(r.current.weights[0], host[0][0][3:4]) and torch.equal(r.current.weights[1], host[1][0][3:4])
    assert r.current.slot_of.tolist() == [1, 1, 1, 0]  # expert 3 in row 0, the others on the CPU (row N)
    for ids in calls:  # the next interval: expert 2 overtakes 3 only with the history halved (50 against 30
        r.count(torch.tensor([[2, 0]] * 10))  # slots; 70 against 60 would be within the noise margin)
    assert r.choose().ids == (2,)


def test_a_refresh_unpacks_only_the_experts_that_join():
    """A refresh that keeps some experts copies their rows from the old device buffer and unpacks only the joining
    ones from the backend; the new buffer equals the chosen experts' weights row for row, and the old one is left
    as it was (a backward may still read it). Rows taken from the wrong old row, or the joining experts put in the
    wrong rows, would differ from the host's experts."""
    host = ((torch.randn(6, 8, 3),), (torch.randn(6, 3, 4),))
    layer = torch_layer(host)
    unpacked, real = [], layer.backend.unpack
    layer.backend.unpack = lambda packed, ids: unpacked.append(ids.tolist()) or real(packed, ids)
    r = ResidentExperts("layer", layer, 6, 3, 1, "cpu", torch.float32)
    first = r.current
    assert unpacked == [[0, 1, 2]]
    r.count(torch.tensor([[5, 2], [4, 2]] * 30))  # 5 and 4 displace 1 and 0; 2 stays
    assert r.choose().ids == (2, 4, 5) and unpacked[1:] == [[4, 5]]
    for got, full in zip(r.current.weights, host):
        assert torch.equal(got, full[0][[2, 4, 5]])
    for got, full in zip(first.weights, host):
        assert torch.equal(got, full[0][:3])
    assert r.current.slot_of.tolist() == [3, 3, 0, 3, 1, 2]


def test_load_model_keeps_experts_resident(tmp_path):
    """The loading path (experts read from the safetensors into the backend and the resident buffer) against
    transformers + PEFT."""
    plain = tiny_model_of("qwen3_moe")
    plain.save_pretrained(tmp_path / "model")
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "torch", "kt_num_gpu_experts": 3,
                                                                "kt_gpu_experts_interval": 1}},
                             device="cpu", progress=False)
    assert len(ours.ktcore.resident) == 2 and all(r.n == 3 for r in ours.ktcore.resident.values())
    a, b = peft_pair(plain, ours)
    for seed in (11, 12):
        assert_same_training_signal(a, b, *batch(seed))


def test_placement_rule_sets_one_layer():
    """A rule's num_gpu_experts for one layer; the other layer follows kt_num_gpu_experts (0 here); DeepSeek-V2's
    shared experts run after the routed ones."""
    plain = tiny_model("deepseek_v2", seed=6)
    first, second = MOE_LAYERS["deepseek_v2"][:2]
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    ours = ktcore.wrap_model(copy.deepcopy(plain), {"kt_config": {"kt_backend": "torch", "kt_gpu_experts_interval": 1,
                                                                  "kt_placement": [{"match": rf"layers\.{first}\.",
                                                                                    "num_gpu_experts": 2}]}})
    assert list(ours.ktcore.resident) == [f"model.layers.{first}.mlp.experts"]
    assert ours.ktcore.layers[f"model.layers.{second}.mlp.experts"].overlap is not None  # shared-experts overlap
    a, b = peft_pair(on_cpu, ours)
    for seed in (13, 14):
        assert_same_training_signal(a, b, *batch(seed))


@pytest.mark.parametrize("kt, expected", [
    ({"kt_num_gpu_experts": -1}, "kt_num_gpu_experts must be an integer >= 0"),
    ({"kt_num_gpu_experts": 6}, "kt_num_gpu_experts 6 needs fewer than the layer's 6 experts"),
    ({"kt_gpu_experts_interval": 0, "kt_num_gpu_experts": 1}, "kt_gpu_experts_interval must be an integer >= 1"),
    ({"kt_num_gpu_experts": 2, "kt_expert_placement": "gpu_stream"}, "works with kt_expert_placement: cpu, not"),
    ({"kt_num_gpu_experts": 2, "kt_placement": [{"match": "layers", "device": "hybrid"}]},
     "add num_gpu_experts: 0 to this rule"),
    ({"kt_placement": [{"match": "layers", "num_gpu_experts": -2}]}, "num_gpu_experts must be an integer >= 0"),
    ({"kt_placement": [{"match": "layers", "device": "auto", "num_gpu_experts": 1}]}, "works with device: cpu"),
])
def test_bad_values_are_one_line_before_any_weight(qwen3_pair, kt, expected):
    _, ours = qwen3_pair
    with pytest.raises(ConfigError, match=expected) as info:
        ktcore.wrap_model(ours, {"kt_config": {"kt_backend": "torch", **kt}})
    assert "\n" not in str(info.value)
    assert not is_placeholder(ours.model.layers[0].mlp.experts.gate_up_proj)


def test_a_stream_rule_may_opt_out():
    """kt_num_gpu_experts for the cpu layers, a gpu_stream rule with num_gpu_experts: 0 for the other."""
    plain = tiny_qwen3_moe()
    first, second = MOE_LAYERS["qwen3_moe"][:2]
    ours = with_resident(copy.deepcopy(plain), 2, kt_placement=[
        {"match": rf"layers\.{first}\.", "device": "gpu_stream", "num_gpu_experts": 0}])
    assert list(ours.ktcore.resident) == [f"model.layers.{second}.mlp.experts"]
    assert ours.ktcore.streamed == (f"model.layers.{first}.mlp.experts",)
    assert_same_training_signal(*peft_pair(plain, ours), *batch(15))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("backend", ["torch", "amx_bf16"])
def test_resident_on_cuda_bf16(tmp_path, family, backend):
    """Resident experts on CUDA in bf16 (pinned gathers, counts on the device, the CPU share running at the same
    time), re-chosen at every call: as close to the fp32 truth as plain transformers in bf16 (loss and every LoRA
    gradient) at each of three steps while routing skewed to expert 5, then 3, moves the sets there (the counts'
    copy to the host is read once its event has completed: a whole step later, so the choice is not skipped).
    amx_bf16: the resident experts unpacked from its tiles."""
    why = backend_unusable(backend)
    if why:
        pytest.skip(why)
    plain = tiny_model_of(family)
    plain.save_pretrained(tmp_path / "model")
    truth = copy.deepcopy(plain).to("cuda")
    plain_bf16 = copy.deepcopy(plain).to("cuda", torch.bfloat16)
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": backend, "kt_num_gpu_experts": 2,
                                                                "kt_gpu_experts_interval": 1}},
                             device="cuda", dtype=torch.bfloat16, progress=False)
    resident = list(ours.ktcore.resident.values())
    assert resident and all(r.current.weights[0].is_cuda and r.counts.is_cuda for r in resident)
    hot = [5]
    for model in (truth, plain_bf16, ours):
        skew(model, hot, family)
    truth, plain_bf16 = peft_pair(truth, plain_bf16)
    torch.manual_seed(7)
    ours = get_peft_model(ours, lora_config())
    for expert, seed in [(5, 8), (3, 9), (3, 10)]:
        hot[0] = expert
        ids, mask = (t.cuda() for t in batch(seed))
        assert_as_close_as_plain_bf16(truth, plain_bf16, ours, ids, mask)
        torch.cuda.synchronize()
        if seed == 9:
            assert all(5 in r.current.ids for r in resident)
    assert all(3 in r.current.ids for r in resident)


def test_disabled_adapter_and_host_lora_elsewhere():
    """``disable_adapter()`` switches the resident experts' LoRA off too (the base logits), and with
    ``kt_expert_lora_device: host`` a layer with resident experts keeps its factors with the model (the GPU
    reads them) while the signal stays cpu placement's."""
    plain = tiny_qwen3_moe()
    base = plain(batch()[0]).logits
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    ours = with_resident(copy.deepcopy(plain), 2, kt_expert_lora_device="host")
    a, b = peft_pair(on_cpu, ours)
    with torch.no_grad(), b.disable_adapter():
        assert relative_error(b(batch()[0]).logits, base) <= 1e-5
    for seed in (16, 17):
        assert_same_training_signal(a, b, *batch(seed))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_counting_and_choosing_never_synchronise_on_cuda():
    """The counts stay on the device and reach the host by a copy nobody waits for; a choice copies the new set
    from pinned memory: torch's sync debug mode raises on any synchronising call among them."""
    host = ((torch.randn(8, 6, 4, dtype=torch.bfloat16),), (torch.randn(8, 4, 3, dtype=torch.bfloat16),))
    r = ResidentExperts("layer", torch_layer(host), 8, 2, 1, "cuda", torch.bfloat16)
    calls = [torch.tensor([[7, 6]] * 64, device="cuda"), torch.tensor([[5, 4]] * 64, device="cuda")]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in calls * 2:
            r.choose()
            r.count(ids)
            torch.cuda._sleep(1000)  # device work queued behind: a synchronising copy would have to wait for it
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    r.choose()
    assert r.refreshes >= 1 and r.current.ids in ((6, 7), (4, 5))
    assert torch.equal(r.current.weights[0].cpu(), host[0][0][list(r.current.ids)])


def test_gguf_blocks_on_llamafile_with_resident_experts(tmp_path):
    """A GGUF whose Q8_0 expert blocks the llamafile backend packs as they are (``pack_source``): the resident
    experts are those blocks dequantised (llamafile's ``unpack``); the model stays as close to the fp32 truth on
    those dequantised weights as the cpu placement on llamafile is (its activations are quantised to 16 bits, the
    resident share's are not) while the sets move."""
    from peft import get_peft_model as peft_of
    from test_gguf_train import skip_unless_ready, tiny_gguf

    skip_unless_ready()
    truth, path = tiny_gguf(tmp_path / "mixtral.gguf")
    kt = {"kt_backend": "llamafile"}
    on_cpu = ktcore.load_model(path, {"kt_config": kt}, device="cpu", progress=False)
    ours = ktcore.load_model(path, {"kt_config": {**kt, "kt_num_gpu_experts": 2, "kt_gpu_experts_interval": 1}},
                             device="cpu", progress=False)
    resident = list(ours.ktcore.resident.values())
    assert len(resident) == 2
    torch.manual_seed(7)
    truth = peft_of(truth, lora_config())
    on_cpu, ours = peft_pair(on_cpu, ours)
    for seed in (1, 2, 3):
        ids, mask = batch(seed, vocab=truth.config.vocab_size)
        (ref, ref_grads), (cpu, cpu_grads), (got, got_grads) = (lora_grads(m, ids, mask) for m in (truth, on_cpu, ours))
        bound = max(2 * relative_error(cpu.logits, ref.logits), 1e-4)
        assert relative_error(got.logits, ref.logits) <= bound
        bound = max(2 * max(relative_error(cpu_grads[n], ref_grads[n]) for n in ref_grads), 1e-4)
        assert max(relative_error(got_grads[n], ref_grads[n]) for n in ref_grads) <= bound
    assert all(r.refreshes >= 1 for r in resident)


def test_host_expert_lora_leaves_resident_layers_with_the_model():
    """The frontends' PEFT wrapping (``peft_wrapping``: ``keep_on_host``) moves the expert LoRA of the layers a CPU
    backend computes whole to the host, and none of a layer with resident experts: its GPU share gathers them on the
    model's device (a host factor there fails on a GPU, and here would pass unseen)."""
    from peft.tuners.lora.layer import ParamWrapper

    from ktcore.model.host_lora import HostLoRALinear
    from ktcore.model.peft_expert_lora import peft_wrapping

    family = "deepseek_v2"
    model = ktcore.wrap_model(tiny_model(family), {"kt_config": {
        "kt_backend": "torch", "kt_expert_lora_device": "host", "kt_num_gpu_experts": 2,
        "kt_placement": [{"match": rf"layers\.{MOE_LAYERS[family][0]}\.", "num_gpu_experts": 0}]}})
    with peft_wrapping(model):
        peft = get_peft_model(model, lora_config())
    on_host = {}
    for name, wrapper in peft.named_modules():
        if isinstance(wrapper, ParamWrapper):
            layer = name.split(".mlp.")[0].rsplit(".", 1)[-1]
            on_host.setdefault(int(layer), set()).update(
                isinstance(f, HostLoRALinear) for f in (*wrapper.lora_A.values(), *wrapper.lora_B.values()))
    first, *others = MOE_LAYERS[family]
    assert on_host[first] == {True} and others and all(on_host[i] == {False} for i in others)


def test_int8_experts_are_resident_as_their_codes(monkeypatch):
    """With int8 experts (amx_int8) a refresh unpacks the chosen experts' int8 codes and scales from the backend's
    own packed experts (no copy of the layer's experts is kept beside them), and the resident experts are exactly
    the weights those codes stand for (what the backend computes with), not the checkpoint's."""
    from test_stream import int8_usable_or_skip, with_int8_experts

    int8_usable_or_skip()
    plain = tiny_qwen3_moe()
    ours = with_resident(copy.deepcopy(plain), kt_backend="amx_int8")
    truth = with_int8_experts(plain)
    unpacked = []
    backend = next(iter(ours.ktcore.layers.values())).backend
    real = type(backend).unpack
    monkeypatch.setattr(type(backend), "unpack", lambda self, *a: unpacked.append(real(self, *a)) or unpacked[-1])
    skew(ours, [5])
    ours(batch()[0])  # counts expert 5's slots; the next call takes it
    ours(batch()[0])
    residents = list(ours.ktcore.resident.values())
    assert unpacked and all(codes.dtype == torch.int8 and scales.dtype == torch.float32
                            for experts in unpacked for codes, scales in (experts.gate, experts.up, experts.down))
    for i, r in zip(MOE_LAYERS["qwen3_moe"], residents):
        ids = list(r.current.ids)
        assert 5 in ids and r.refreshes >= 1
        want = truth.model.layers[i].mlp.experts
        assert torch.equal(r.current.weights[0], want.gate_up_proj.detach()[ids])
        assert torch.equal(r.current.weights[1], want.down_proj.detach()[ids])

