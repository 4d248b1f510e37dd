import copy

import pytest

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


@pytest.fixture(autouse=True)
def _fresh_registry():
    from ktcore import plugins
    from ktcore.plugins import hw

    plugins.reset_registry()
    hw._detect.cache_clear()
    yield
    plugins.reset_registry()
    hw._detect.cache_clear()
