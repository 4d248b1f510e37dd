"""Test helpers for ktcore and for third-party plugin authors."""

from .contract import CASES, Case, ExpertBackendContract, dense_reference, relative_error

__all__ = ["CASES", "Case", "ExpertBackendContract", "dense_reference", "relative_error"]
