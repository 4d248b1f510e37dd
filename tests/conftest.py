import copy

import pytest

from ktcore_tiny import SHARED_DATA, tiny_qwen3_moe


@pytest.fixture
def qwen3_pair():
    """(plain transformers model, identical copy) in fp32."""
    model = tiny_qwen3_moe()
    return model, copy.deepcopy(model)


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"LLaMA-Factory demo data not found at {SHARED_DATA} (CI provides ../shared; a plain clone does not)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _fresh_registry():
    from ktcore import plugins
    from ktcore.plugins import hw

    plugins.reset_registry()
    hw._detect.cache_clear()
    yield
    plugins.reset_registry()
    hw._detect.cache_clear()
