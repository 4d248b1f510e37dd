"""ktcore expert backend ``amx_bf16``: AMX BF16 tile kernels in a torch-ABI-free pybind11 extension.

Importing this package is cheap and never loads the compiled extension; ``ktcore_amx_bf16._ext`` is the
extension (``measure_amx_peak_gflops(seconds)``, ``measure_read_bandwidth(nbytes)``, ``Engine``),
``ktcore_amx_bf16.backend.AMXBF16Backend`` the backend class and ``ktcore_amx_bf16.doctor`` what
``ktcore doctor`` measures with it.
"""

__version__ = "0.1.0"
