"""The reference backend against the float64 dense reference (the contract every backend passes)."""

import torch

from ktcore.testing import ExpertBackendContract


class TestTorchBackendFP32(ExpertBackendContract):
    backend_name = "torch"
    weight_dtype = torch.float32
    rtol_out, rtol_grad = 2e-6, 5e-6  # about 10x the worst measured: 2.4e-7 / 6.3e-7


class TestTorchBackendBF16(ExpertBackendContract):
    backend_name = "torch"
    weight_dtype = torch.bfloat16
    input_dtype = torch.bfloat16
    rtol_out, rtol_grad = 5e-2, 1e-1  # measured 9.7e-3 / 1.2e-2: every product and sum rounded to bf16
