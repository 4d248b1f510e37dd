"""A LLaMA-Factory YAML works as written: LLaMA-Factory 0.9.5's own keys (ktcore.llamafactory_keys) are accepted,
the TRL frontend hands TRL those its config has a field for and refuses the rest in one line, before the model
loads; a typo of a key is still an error naming the nearest one."""

import pytest

from ktcore.config import ConfigError, config_from_dict

pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")
from trl import DPOConfig, SFTConfig  # noqa: E402

from ktcore_trl.train import check_config, stage_kwargs  # noqa: E402


def config(tmp_path, **keys):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3_moe"}')
    return config_from_dict({"model_name_or_path": str(tmp_path / "model"), "output_dir": str(tmp_path / "out"),
                             **keys}, quiet=True)


def test_llamafactory_keys_are_accepted_and_typos_are_not(tmp_path):
    cfg = config(tmp_path, flash_attn="disabled", dataloader_pin_memory=False)
    assert cfg.llamafactory_keys == {"flash_attn": "disabled", "dataloader_pin_memory": False}
    assert cfg.to_dict()["flash_attn"] == "disabled"  # round-trips with the YAML's other keys
    with pytest.raises(ConfigError, match="unknown key 'flash_atn'; did you mean"):
        config(tmp_path, flash_atn="disabled")


@pytest.mark.parametrize("stage, args_cls", [("sft", SFTConfig), ("dpo", DPOConfig)])
def test_trl_takes_the_training_arguments_among_them(tmp_path, stage, args_cls):
    cfg = config(tmp_path, stage=stage, dataloader_pin_memory=False, adam_beta2=0.95)
    args = args_cls(**stage_kwargs(cfg, args_cls))
    assert args.dataloader_pin_memory is False and args.adam_beta2 == 0.95


def test_trl_refuses_what_it_cannot_apply_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="neat_packing: LLaMA-Factory key.* the TRL frontend has no counterpart"):
        check_config(config(tmp_path, neat_packing=True))
    with pytest.raises(ConfigError, match=r"remove_unused_columns: ktcore sets these .*remove_unused_columns=False"):
        check_config(config(tmp_path, remove_unused_columns=True))
