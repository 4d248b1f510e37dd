"""ktcore expert backend ``amx_int8``: int8 experts (``int8-sym-channel-v1``, ``ktcore.experts.int8``) computed by
AMX INT8 tiles or AVX-512 VNNI in a torch-ABI-free pybind11 extension.

Importing this package is cheap and never loads the compiled extension; ``ktcore_amx_int8._ext`` is the extension
(``Engine``, ``amx_unavailable_reason()``, ``vnni_unavailable_reason()``, ``amx_int8_peak_gops()``),
``ktcore_amx_int8.backend.AMXInt8Backend`` the backend class and ``ktcore_amx_int8.doctor`` what ``ktcore doctor``
measures with it.
"""

__version__ = "0.1.0"
