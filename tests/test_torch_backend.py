"""The reference backend against the float64 dense reference (the contract every backend passes)."""

import torch

from ktcore.testing import ExpertBackendContract


class TestTorchBackendFP32(ExpertBackendContract):
    backend_name = "torch"
    weight_dtype = torch.float32
    rtol_out = 1e-6
    rtol_grad = 1e-6


class TestTorchBackendBF16(ExpertBackendContract):
    backend_name = "torch"
    weight_dtype = torch.bfloat16
    input_dtype = torch.bfloat16
    rtol_out = 1e-2
    rtol_grad = 2e-2
