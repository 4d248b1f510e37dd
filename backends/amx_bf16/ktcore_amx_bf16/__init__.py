"""ktcore expert backend ``amx_bf16``: AMX BF16 tile kernels in a torch-ABI-free pybind11 extension.

Importing this package is cheap and never loads the compiled extension; ``ktcore_amx_bf16._ext`` is the
extension (``Engine``, ``amx_unavailable_reason()``), ``ktcore_amx_bf16.backend.AMXBF16Backend`` the backend class,
``ktcore_amx_bf16.measure`` the machine's yardsticks (``amx_peak_gflops(seconds)``), which the backend does not
need, and ``ktcore_amx_bf16.doctor`` what ``ktcore doctor`` measures with them.
"""

__version__ = "0.1.0"
