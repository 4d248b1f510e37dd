"""The example backend must match ktcore's float64 reference: subclass the contract, name the backend.

Run after `pip install -e .` (ktcore finds the backend through the entry point): `pytest tests`.
"""

from ktcore.testing import ExpertBackendContract


class TestExampleBackend(ExpertBackendContract):
    backend_name = "example"
    rtol_out = 1e-5
    rtol_grad = 1e-5
