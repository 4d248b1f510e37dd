"""Test helpers for ktcore and for third-party plugin authors.

``ktcore.testing.upcycle`` and ``ktcore.testing.tiny`` need only ktcore's own dependencies. The contract suite
(``ExpertBackendContract`` and its helpers, in ``ktcore.testing.contract``) is built on pytest and is imported
the first time one of its names is used.
"""

__all__ = ["CASES", "Case", "ExpertBackendContract", "dense_reference", "relative_error"]


def __getattr__(name):
    if name in __all__:
        from . import contract

        return getattr(contract, name)
    raise AttributeError(f"module 'ktcore.testing' has no attribute {name!r}")
