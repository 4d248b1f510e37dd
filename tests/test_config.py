"""The one YAML: typed validation, nearest-choice errors, kt_config, overrides and legacy KT translation."""

from __future__ import annotations

import textwrap
import typing
from dataclasses import fields

import pytest

from ktcore.config import (
    LEGACY_SECTIONS,
    KT_SECTION_KEYS,
    KT_TOP_KEYS,
    ConfigError,
    KTConfig,
    TrainConfig,
    as_kt_config,
    config_from_dict,
    load_config,
    parse_overrides,
)

TRAIN_FIELDS = [f for f in fields(TrainConfig) if not f.metadata.get("internal") and f.name != "kt_config"]
KT_FIELDS = [f for f in fields(KTConfig) if f.name in KT_SECTION_KEYS]
# a mapping under a legacy KT section's name (dataset:) is that section, translated (see the legacy tests)
MAPPING_REFUSED = [f for f in TRAIN_FIELDS + KT_FIELDS if f.name not in LEGACY_SECTIONS]
CHOICE_FIELDS = [f for f in TRAIN_FIELDS + KT_FIELDS if f.metadata.get("choices")]


def write(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error(data, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, "cfg.yaml", **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, "errors are one line"
    assert msg.startswith("cfg.yaml: ")
    return msg


def nest(f, value) -> dict:
    return {"kt_config": {f.name: value}} if f in KT_FIELDS else {f.name: value}


def label(f) -> str:
    return f"kt_config.{f.name}" if f in KT_FIELDS else f.name


def wrong_type_for(annotation) -> object:
    """A value of a plausible but wrong type for the annotation."""
    names = str(annotation)
    if "bool" in names and "str" not in names:
        return "maybe"
    if "int" in names and "str" not in names:
        return 1.5 if "float" not in names else "fast"
    if "float" in names:
        return "fast"
    return 12 if "list" not in names and "bool" not in names else 3.5


# ---- every key, every type ------------------------------------------------------------------------------


def test_defaults_round_trip():
    cfg = config_from_dict({}, quiet=True)
    assert cfg == TrainConfig(source="<config>")
    again = config_from_dict(cfg.to_dict(), quiet=True)
    assert again == cfg
    assert cfg.kt == KTConfig() and cfg.effective_lora_alpha == 16


def test_only_legacy_section_names_take_a_mapping():
    """The filters below drop what they should and nothing else: only ``dataset`` is also a legacy section."""
    assert {f.name for f in TRAIN_FIELDS + KT_FIELDS if f not in MAPPING_REFUSED} == {"dataset"}
    assert CHOICE_FIELDS


@pytest.mark.parametrize("f", MAPPING_REFUSED, ids=label)
def test_every_key_rejects_a_mapping(f):
    msg = error(nest(f, {"oops": 1}))
    assert f"{label(f)} must be " in msg and "got {'oops': 1} (dict)" in msg


@pytest.mark.parametrize("f", [f for f in TRAIN_FIELDS + KT_FIELDS if f not in CHOICE_FIELDS], ids=label)
def test_every_key_rejects_a_wrong_scalar_type(f):
    """(A choice key's wrong values are checked against its choices below.)"""
    bad = wrong_type_for(f.type)
    msg = error(nest(f, bad))
    assert f"{label(f)} must be " in msg and repr(bad) in msg, msg


@pytest.mark.parametrize("f", CHOICE_FIELDS, ids=label)
def test_choices_suggest_the_nearest(f):
    choice = f.metadata["choices"][0]
    msg = error(nest(f, choice + "x"))
    assert f"{label(f)}: {choice + 'x'!r} is not one of {', '.join(f.metadata['choices'])}" in msg
    assert msg.endswith(f"did you mean {choice!r}?")
    assert getattr(config_from_dict(nest(f, choice), quiet=True).kt_config if f in KT_FIELDS else
                   config_from_dict(nest(f, choice), quiet=True), f.name) == choice


def test_far_off_choice_lists_choices():
    assert error({"stage": "pretraining-with-rlhf"}).endswith("choices: dpo, sft")


@pytest.mark.parametrize("data, expected", [
    ({"learning_rate": "1e-4"}, ("learning_rate", 1e-4)),  # PyYAML reads 1e-4 as a string
    ({"learning_rate": 1}, ("learning_rate", 1.0)),
    ({"num_train_epochs": 2}, ("num_train_epochs", 2.0)),
    ({"lora_rank": "16"}, ("lora_rank", 16)),
    ({"bf16": "true"}, ("bf16", True)),
    ({"resume_from_checkpoint": True}, ("resume_from_checkpoint", True)),
    ({"resume_from_checkpoint": "out/checkpoint-5"}, ("resume_from_checkpoint", "out/checkpoint-5")),
    ({"report_to": ["tensorboard"]}, ("report_to", ["tensorboard"])),
    ({"lora_alpha": None}, ("lora_alpha", None)),
])
def test_harmless_spellings_are_accepted(data, expected):
    cfg = config_from_dict(data, quiet=True)
    key, value = expected
    assert getattr(cfg, key) == value and type(getattr(cfg, key)) is type(value)


def test_bool_is_not_an_int():
    assert "lora_rank must be int, got True (bool)" in error({"lora_rank": True})


@pytest.mark.parametrize("data, fragment", [
    ({"lora_rank": 0}, "lora_rank must be > 0, got 0"),
    ({"cutoff_len": -1}, "cutoff_len must be > 0"),
    ({"lora_dropout": 1.0}, "lora_dropout must be in [0, 1), got 1.0"),
    ({"pref_beta": -0.1}, "pref_beta must be > 0, got -0.1"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16 are both true; choose one"),
    ({"kt_config": {"kt_num_threads": 0}}, "kt_config.kt_num_threads must be > 0, got 0"),
    ({"kt_config": {"kt_threadpool_count": 0}}, "kt_config.kt_threadpool_count must be > 0"),
])
def test_value_ranges(data, fragment):
    assert fragment in error(data)


# ---- unknown keys -----------------------------------------------------------------------------------------


def test_unknown_key_names_the_nearest():
    assert error({"lora_rnak": 8}) == "cfg.yaml: unknown key 'lora_rnak'; did you mean 'lora_rank'?"


def test_unknown_kt_config_key_names_the_section():
    msg = error({"kt_config": {"kt_backnd": "torch"}})
    assert msg == "cfg.yaml: unknown key 'kt_config.kt_backnd'; did you mean 'kt_backend'?"


def test_unknown_key_far_from_anything_lists_valid_keys():
    msg = error({"zzzzzz": 1})
    assert "unknown key 'zzzzzz'; valid keys: " in msg and "lora_rank" in msg


def test_top_level_must_be_a_mapping():
    assert "the top level must be a mapping of keys, got list" in error([1, 2])


# ---- kt_config ------------------------------------------------------------------------------------------


def test_kt_config_section():
    cfg = config_from_dict({"use_kt": True, "kt_cpu_activation": "recompute",
                            "kt_config": {"kt_backend": "torch", "kt_expert_weight_format": "bf16",
                                          "kt_num_threads": 4, "kt_tp_enabled": True, "kt_threadpool_count": 2,
                                          "kt_max_cache_depth": 3, "kt_weight_lifecycle": "persistent"}})
    kt = cfg.kt
    assert (kt.kt_backend, kt.kt_expert_weight_format, kt.kt_num_threads, kt.kt_tp_enabled) == ("torch", "bf16", 4, True)
    assert (kt.kt_threadpool_count, kt.kt_max_cache_depth, kt.kt_weight_lifecycle) == (2, 3, "persistent")
    assert kt.kt_cpu_activation == "recompute"  # top-level kt keys are folded in
    assert cfg.to_dict()["kt_config"]["kt_backend"] == "torch"


def test_empty_kt_config_section():
    assert config_from_dict({"kt_config": None}, quiet=True).kt == KTConfig()


def test_kt_config_must_be_a_mapping():
    assert "kt_config must be a mapping of kt_* keys, got 'torch'" in error({"kt_config": "torch"})


@pytest.mark.parametrize("key", KT_TOP_KEYS)
def test_top_level_kt_keys_do_not_belong_in_kt_config(key):
    value = "retain" if key == "kt_cpu_activation" else "/somewhere"
    assert f"kt_config.{key} belongs at the top level" in error({"kt_config": {key: value}})


def test_backend_name_is_open_for_plugins():
    assert config_from_dict({"kt_config": {"kt_backend": "my_vendor_backend"}}).kt.kt_backend == "my_vendor_backend"


@pytest.mark.parametrize("given", [None, KTConfig(kt_backend="torch"), {"kt_backend": "torch"},
                                   {"kt_config": {"kt_backend": "torch"}, "lora_rank": 4}])
def test_as_kt_config(given):
    expected = KTConfig() if given is None else KTConfig(kt_backend="torch")
    assert as_kt_config(given) == expected


def test_as_kt_config_from_yaml_and_train_config(tmp_path):
    path = write(tmp_path, "kt_config:\n  kt_backend: torch\nkt_cpu_activation: recompute\n")
    assert as_kt_config(str(path)) == KTConfig(kt_backend="torch", kt_cpu_activation="recompute")
    assert as_kt_config(load_config(path)).kt_cpu_activation == "recompute"
    with pytest.raises(TypeError):
        as_kt_config(42)


# ---- files and overrides ---------------------------------------------------------------------------------


def test_load_config_file_with_overrides(tmp_path):
    path = write(tmp_path, """
        model_name_or_path: m
        lora_rank: 8
        kt_config:
          kt_backend: auto
          kt_num_threads: 2
    """)
    cfg = load_config(path, ["lora_rank=16", "kt_config.kt_backend=torch", "learning_rate=2e-5",
                             "report_to=[tensorboard]", "lora_alpha="])
    assert cfg.lora_rank == 16 and cfg.learning_rate == 2e-5 and cfg.report_to == ["tensorboard"]
    assert cfg.kt.kt_backend == "torch" and cfg.kt.kt_num_threads == 2  # the rest of the section survives
    assert cfg.lora_alpha is None and cfg.source == str(path)


def test_override_errors(tmp_path):
    path = write(tmp_path, "lora_rank: 8\n")
    with pytest.raises(ConfigError, match="override 'lora_rank' must look like key=value"):
        load_config(path, ["lora_rank"])
    # a mistake of the command line is blamed on the command line, not on the file
    with pytest.raises(ConfigError, match="^command line: unknown key 'kt_config.kt_backed'; did you mean"):
        load_config(path, ["kt_config.kt_backed=torch"])
    with pytest.raises(ConfigError, match="^command line: lora_rank must be int, got 'big'"):
        load_config(path, ["lora_rank=big"])
    bad_file = write(tmp_path, "lora_rnak: 8\n", "typo.yaml")
    with pytest.raises(ConfigError, match=f"^{bad_file}: unknown key 'lora_rnak'"):
        load_config(bad_file, ["lora_rank=4"])


def test_parse_overrides_nests_dotted_keys():
    assert parse_overrides(["a=1", "kt_config.kt_backend=torch", "kt_config.kt_num_threads=4", "s=x=y"]) == {
        "a": 1, "kt_config": {"kt_backend": "torch", "kt_num_threads": 4}, "s": "x=y"}


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: no such config file"):
        load_config(tmp_path / "nope.yaml")
    bad = write(tmp_path, "lora_rank: 8\n  oops: [\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml: not valid YAML at line \d+, column \d+") as info:
        load_config(bad)
    assert "\n" not in str(info.value)


def test_empty_file_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "")).lora_rank == 8


# ---- legacy KT configs ------------------------------------------------------------------------------------

RULE_TEMPLATE = """
- match:
    name: "^model\\\\.embed_tokens"
  replace:
    class: "default"
    kwargs:
      generate_device: "cpu"
- match:
    name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs:
      prefill_device: "cuda"
      prefill_op: "KExpertsTorch"
      generate_device: "cpu"
      generate_op: "KExpertsCPU"
      out_device: "cuda"
      backend: "{backend}"
  recursive: False
"""


def legacy_yaml(rule: str) -> str:
    return f"""
        model:
          model_name_or_path: deepseek-ai/DeepSeek-V2-Lite
          trust_remote_code: true
        method:
          stage: sft
          finetuning_type: lora
          lora_target: all
          lora_rank: 16
        dataset:
          dataset: identity
          template: deepseek
          cutoff_len: 1024
        output:
          output_dir: saves/legacy
        train:
          learning_rate: 1.0e-4
          max_steps: 5
        ktransformers:
          use_kt: true
          kt_optimize_rule: {rule}
          cpu_infer: 32
          chunk_size: 8192
    """


@pytest.mark.parametrize("backend, expected", [("AMXInt8", ("amx_int8", "int8")), ("AMXBF16", ("amx_bf16", "bf16")),
                                               ("llamafile", ("llamafile", "gguf"))])
def test_legacy_kt_config_is_translated_with_a_note(tmp_path, capsys, backend, expected):
    write(tmp_path, RULE_TEMPLATE.replace("{backend}", backend), "rules/DeepSeek-V2-Lite-sft.yaml")
    path = write(tmp_path, legacy_yaml("rules/DeepSeek-V2-Lite-sft.yaml"))  # relative to the YAML's folder
    cfg = load_config(path)
    assert cfg.model_name_or_path == "deepseek-ai/DeepSeek-V2-Lite" and cfg.trust_remote_code
    assert cfg.lora_rank == 16 and cfg.dataset == "identity" and cfg.output_dir == "saves/legacy"
    assert cfg.max_steps == 5 and cfg.use_kt
    assert (cfg.kt.kt_backend, cfg.kt.kt_expert_weight_format) == expected
    assert cfg.kt.kt_num_threads == 32

    err = capsys.readouterr().err
    assert err.startswith(f"ktcore: translated legacy KT config {path}: ")
    for fragment in ("section model: flattened", "section ktransformers: flattened", "cpu_infer -> kt_config.kt_num_threads=32",
                     "chunk_size=8192 dropped",
                     f"kt_optimize_rule DeepSeek-V2-Lite-sft.yaml -> kt_config.kt_backend={expected[0]}, "
                     f"kt_expert_weight_format={expected[1]}"):
        assert fragment in err


def test_legacy_quiet_prints_nothing(tmp_path, capsys):
    load_config(write(tmp_path, "cpu_infer: 4\n"), quiet=True)
    assert capsys.readouterr().err == ""


def test_new_style_config_prints_no_note(tmp_path, capsys):
    load_config(write(tmp_path, "use_kt: true\nkt_config:\n  kt_backend: torch\n"))
    assert capsys.readouterr().err == ""


def test_flat_legacy_kt_keys_move_into_kt_config(capsys):
    cfg = config_from_dict({"kt_backend": "torch", "kt_num_threads": 3, "kt_max_cache_depth": 2})
    assert (cfg.kt.kt_backend, cfg.kt.kt_num_threads, cfg.kt.kt_max_cache_depth) == ("torch", 3, 2)
    assert "kt_backend -> kt_config.kt_backend" in capsys.readouterr().err


def test_legacy_rule_with_unknown_backend_is_a_clear_error(tmp_path):
    write(tmp_path, RULE_TEMPLATE.replace("{backend}", "CUDAGraphMagic"), "rules.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, legacy_yaml("rules.yaml")))
    msg = str(info.value)
    assert "kt_optimize_rule" in msg and "unknown expert backend 'CUDAGraphMagic'" in msg
    assert "use one of AMXInt8, AMXBF16, llamafile" in msg and "\n" not in msg


def test_legacy_rule_file_missing_or_invalid(tmp_path):
    with pytest.raises(ConfigError, match="kt_optimize_rule file .*gone.yaml' does not exist"):
        load_config(write(tmp_path, legacy_yaml("gone.yaml")))
    write(tmp_path, "- match: [\n", "broken.yaml")
    with pytest.raises(ConfigError, match="broken.yaml' is not valid YAML") as info:
        load_config(write(tmp_path, legacy_yaml("broken.yaml")))
    assert "\n" not in str(info.value)


def test_legacy_rules_become_per_layer_placement(tmp_path):
    gpu_rule = RULE_TEMPLATE.replace("{backend}", "AMXInt8").replace('generate_device: "cpu"', 'generate_device: "cuda"')
    mixed = gpu_rule + RULE_TEMPLATE.replace("{backend}", "AMXBF16") + RULE_TEMPLATE.replace("{backend}", "llamafile")
    write(tmp_path, mixed, "mixed.yaml")
    cfg = load_config(write(tmp_path, legacy_yaml("mixed.yaml")), quiet=True)
    rules = cfg.kt.kt_placement
    assert [r.get("device", "cpu") for r in rules] == ["gpu", "cpu", "cpu"]
    assert [r.get("backend") for r in rules] == [None, "amx_bf16", "llamafile"]
    assert cfg.kt.kt_backend == "auto"  # two CPU backends: no single default to take


def test_legacy_rule_without_experts_changes_no_backend(tmp_path):
    write(tmp_path, "- match:\n    name: lm_head\n  replace:\n    class: default\n", "plain.yaml")
    cfg = load_config(write(tmp_path, legacy_yaml("plain.yaml")), quiet=True)
    assert cfg.kt.kt_backend == "auto"


def test_legacy_keys_still_validated(tmp_path):
    path = write(tmp_path, "model:\n  model_name_or_path: m\n  lora_rnak: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'lora_rnak'; did you mean 'lora_rank'"):
        load_config(path, quiet=True)


def test_annotations_are_all_understood():
    """Every key's annotation is one the validator checks (a new exotic type must extend _type_ok)."""
    from ktcore.config import _resolve

    simple = {bool, int, float, str, list, type(None)}
    for f in TRAIN_FIELDS + KT_FIELDS:
        ann = _resolve(f.type)
        args = typing.get_args(ann) or (ann,)
        assert set(args) <= simple, f"{f.name}: {ann}"


@pytest.mark.parametrize("spelling, name", [("AMXBF16", "amx_bf16"), ("AMXInt8", "amx_int8"), ("amxbf16", "amx_bf16"),
                                            ("LLAMAFILE", "llamafile")])
def test_ktransformers_backend_spellings_are_aliases(capsys, spelling, name):
    cfg = config_from_dict({"use_kt": True, "kt_config": {"kt_backend": spelling}})
    assert cfg.kt.kt_backend == name
    assert f"kt_backend {spelling} -> {name}" in capsys.readouterr().err


def test_a_top_level_kt_key_that_disagrees_with_kt_config_is_refused():
    with pytest.raises(ConfigError, match="kt_backend: 'torch' at the top level and 'auto' in kt_config disagree"):
        config_from_dict({"kt_backend": "torch", "kt_config": {"kt_backend": "auto"}})
    assert config_from_dict({"kt_backend": "torch", "kt_config": {"kt_backend": "torch"}}, quiet=True).kt.kt_backend \
        == "torch"


@pytest.mark.parametrize("disable, enabled", [(True, False), (False, True)])
def test_llamafactory_disable_gradient_checkpointing_is_understood(disable, enabled):
    cfg = config_from_dict({"disable_gradient_checkpointing": disable}, quiet=True)
    assert cfg.gradient_checkpointing is enabled
    with pytest.raises(ConfigError, match="disagree"):
        config_from_dict({"disable_gradient_checkpointing": disable, "gradient_checkpointing": not enabled})


def test_llamafactory_infer_backend_of_a_kt_chat_yaml():
    """LLaMA-Factory's KT chat YAMLs say `infer_backend: ktransformers`: ktcore chat is that engine; an engine
    ktcore cannot stand for (vllm, sglang) is refused in one line naming the key."""
    for engine in ("ktransformers", "huggingface", "KTransformers"):
        assert config_from_dict({"infer_backend": engine, "use_kt": True}, quiet=True).use_kt
    with pytest.raises(ConfigError, match="infer_backend 'vllm': ktcore chat runs the model itself"):
        config_from_dict({"infer_backend": "vllm"})
