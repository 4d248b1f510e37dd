"""ktcore: LoRA fine-tuning and inference of MoE models whose routed experts run on CPU backends.

This module stays light: plugin modules import ``hookimpl`` from here without pulling in torch.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("ktcore")

__all__ = ["hookimpl", "load_model", "wrap_model", "get_backend", "list_plugins", "__version__"]


def load_model(path, config=None, **kwargs):
    """Build an HF model from ``path`` with its routed experts streamed into the CPU backend."""
    from .weights.loading import load_model as _load

    return _load(path, config, **kwargs)


def wrap_model(model, config=None):
    """Move the routed experts of an in-memory HF model into the CPU backend (in place); returns the model."""
    from .model.wrap import wrap_model as _wrap

    return _wrap(model, config)


def get_backend(name="auto", config=None, **kwargs):
    """An ExpertBackend instance: ``name`` is a backend name or "auto"."""
    from .plugins.select import get_backend as _get

    return _get(name, config, **kwargs)


def list_plugins(kind=None):
    """Records of every plugin descriptor (and every broken or disabled plugin)."""
    from .plugins import list_plugins as _list

    return _list(kind)
