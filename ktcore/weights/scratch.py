"""The scratch directory of ``kt_weight_lifecycle: ephemeral``: made by this process, removed when loading ends,
when the process exits, and on SIGINT/SIGTERM.

Its name, ``ktcore-ephemeral-<pid>-*`` in the temp directory (``TMPDIR``), says whose it is: a later run
removes those whose process is gone (killed with SIGKILL, which nothing can catch), and nothing named otherwise.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from ..files import _alive, remove_path

PREFIX = "ktcore-ephemeral-"


def _remove_orphans(base: Path) -> None:
    pattern = re.compile(re.escape(PREFIX) + r"(\d+)-")
    for path in base.glob(PREFIX + "*"):
        match = pattern.match(path.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            remove_path(path)


@contextmanager
def scratch_dir():
    """Yield a new empty directory that is removed however this process leaves the block (but SIGKILL)."""
    base = Path(tempfile.gettempdir())
    _remove_orphans(base)
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))

    def cleanup() -> None:
        remove_path(path)

    def on_signal(signum, frame):
        cleanup()
        handler = previous[signum]
        if callable(handler):  # Python's own SIGINT handler raises KeyboardInterrupt, unwinding the block
            return handler(signum, frame)
        signal.signal(signum, signal.SIG_DFL)  # end as the signal would have, with its exit status
        os.kill(os.getpid(), signum)

    atexit.register(cleanup)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if handler is not signal.SIG_IGN:
                previous[signum] = handler
                signal.signal(signum, on_signal)
    try:
        yield path
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        cleanup()
        atexit.unregister(cleanup)
