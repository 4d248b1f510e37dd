import pytest


@pytest.fixture(autouse=True)
def _few_threads(monkeypatch):
    monkeypatch.delenv("KTCORE_LLAMAFILE_ISA", raising=False)
