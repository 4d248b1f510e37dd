"""ktcore's TRL training frontend (``ktcore train CFG.yaml --frontend trl``).

Kept import-light: ``ktcore_trl.plugin`` registers the frontend without importing trl; ``ktcore_trl.train``
and ``ktcore_trl.data`` do the work when the frontend is used.
"""

__version__ = "0.1.0"
