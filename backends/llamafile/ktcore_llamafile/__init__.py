"""ktcore expert backend ``llamafile``: experts computed straight from GGUF quantised blocks.

Importing this package is cheap; ``ktcore_llamafile._ext`` is the compiled extension and
``ktcore_llamafile.backend.LlamafileBackend`` the backend class.
"""

__version__ = "0.1.0"
