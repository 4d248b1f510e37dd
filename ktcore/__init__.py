"""ktcore: LoRA fine-tuning and inference of MoE models whose routed experts run on CPU backends.

This module stays light: plugin modules import ``hookimpl`` from here without pulling in torch. The three
functions below are the edge where a config (a dict of ``kt_*`` keys, a YAML path, a ``TrainConfig`` or a
``KTConfig``) is parsed, once; everything below them takes the ``KTConfig``.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("ktcore")

__all__ = ["hookimpl", "load_model", "wrap_model", "get_backend", "list_plugins", "__version__"]


def load_model(path, config=None, **kwargs):
    """Build an HF model from ``path`` with its routed experts streamed into the CPU backend."""
    from .config import as_kt_config
    from .weights.loading import load_model as _load

    return _load(path, as_kt_config(config), **kwargs)


def wrap_model(model, config=None):
    """Move the routed experts of an in-memory HF model into the CPU backend (in place); returns the model."""
    from .config import as_kt_config
    from .model.wrap import wrap_model as _wrap

    return _wrap(model, as_kt_config(config))


def get_backend(name="auto", config=None, **kwargs):
    """An ExpertBackend instance: ``name`` is a backend name, or "auto" for the config's ``kt_backend`` (whose
    own "auto", the default, picks the best backend usable here)."""
    from .config import as_kt_config
    from .plugins.select import get_backend as _get

    kt = as_kt_config(config)
    return _get(kt.kt_backend if name == "auto" else name, kt, **kwargs)


def list_plugins(kind=None):
    """Records of every plugin descriptor (and every broken or disabled plugin)."""
    from .plugins import list_plugins as _list

    return _list(kind)
