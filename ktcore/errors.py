"""ktcore's error types (kept free of heavy imports so the CLI can catch them cheaply).

Each is raised with one line that names the file, key or plugin at fault and the fix; the CLI prints that line
and exits with code 2 instead of a traceback.
"""


class KtcoreError(Exception):
    """Base class of the errors ktcore reports to users as one line."""


class ConfigError(KtcoreError, ValueError):
    """A bad configuration; the message is one line that says what to change."""


class PluginError(KtcoreError):
    """A plugin problem (broken, conflicting, unknown); the message says what to do."""


class CheckpointError(KtcoreError, ValueError):
    """A checkpoint is missing, truncated or does not fit the model; the message names the file and tensor."""
