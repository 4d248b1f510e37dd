"""A safetensors file built in memory in its final byte layout, then hashed and written in one go.

``ktcore convert`` fills each store file's tensors in place (``StagedFile.tensors`` are views of one buffer that
holds the file's bytes, header first), so no tensor is copied into a file buffer and no layer is allocated anew:

* the buffers are page-aligned anonymous maps kept per thread and reused for the next layer
  (``ktcore.weights.buffers``);
* ``write_staged`` hashes the buffer (SHA-256, in a second thread: hashlib releases the GIL on large buffers)
  while it writes it, with ``O_DIRECT`` where the file system takes it: the disk reads the buffer itself, no copy
  goes into the page cache, and the fsync that follows has nothing left to write back. Elsewhere (tmpfs, or a
  file system refusing the alignment) it writes through the page cache.

Every file still goes through ``ktcore.files.atomic_file`` (temp name, fsync, rename), and the hash is of the very
bytes written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..files import atomic_file
from .buffers import buffer
from .safetensors_reader import DTYPES

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of the logical block size (<= 4096)
WRITE_CHUNK = 64 << 20  # bytes per write call


def safetensors_layout(specs: dict[str, tuple[torch.dtype, tuple]],
                       metadata: Optional[dict] = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(the file's first bytes: header length and header, padded so the data starts 8-aligned; tensor name ->
    its ``[start, end)`` bytes in the file) for tensors of these (dtype, shape). Tensors go widest dtype first,
    so each starts at a multiple of its element size and a map of the file can be viewed as each dtype in place."""
    order = sorted(specs, key=lambda n: -specs[n][0].itemsize)
    header, offset, spans = {}, 0, {}
    for name in order:
        dtype, shape = specs[name]
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (offset, offset + nbytes)
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    prefix = len(blob).to_bytes(8, "little") + blob
    return prefix, {name: (len(prefix) + start, len(prefix) + end) for name, (start, end) in spans.items()}


@dataclass
class StagedFile:
    """One file's bytes in a reused buffer: ``tensors`` are views to fill, ``size`` the file's length."""

    buffer: mmap.mmap
    size: int
    tensors: dict[str, torch.Tensor]

    @classmethod
    def make(cls, specs: dict[str, tuple[torch.dtype, tuple]], metadata: Optional[dict] = None,
             slot=("file", 0)) -> "StagedFile":
        """A file of tensors of these (dtype, shape), in this thread's buffer ``slot`` (the previous file staged
        there is gone). The tensors' contents are undefined until filled."""
        prefix, spans = safetensors_layout(specs, metadata)
        size = max([len(prefix), *(end for _, end in spans.values())])
        buf = buffer(slot, max(ALIGN, -(-size // ALIGN) * ALIGN))
        buf[:len(prefix)] = prefix
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)
        tensors = {name: raw[start:end].view(specs[name][0]).reshape(specs[name][1])
                   for name, (start, end) in spans.items()}
        return cls(buf, size, tensors)


def write_staged(path: Path, staged: StagedFile) -> dict:
    """Write ``staged`` at ``path`` atomically while hashing it; returns ``{"size", "sha256"}``."""
    view = memoryview(staged.buffer)
    digest: dict = {}
    hasher = threading.Thread(target=lambda: digest.update(sha256=hashlib.sha256(view[:staged.size]).hexdigest()))
    hasher.start()
    try:
        with atomic_file(path) as tmp:
            _write(tmp, view, staged.size)
    finally:
        hasher.join()
        view.release()
    return {"size": staged.size, "sha256": digest["sha256"]}


def _write(path: Path, view: memoryview, size: int) -> None:
    """``view[:size]`` into the (empty) file ``path``: with O_DIRECT (whole aligned blocks, then cut to ``size``)
    where the file system takes it, else through the page cache."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, os.O_WRONLY | direct)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            try:
                _write_all(fd, view, -(-size // ALIGN) * ALIGN)
                os.ftruncate(fd, size)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        _write_all(fd, view, size)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview, size: int) -> None:
    offset = 0
    while offset < size:
        written = os.pwrite(fd, view[offset:min(size, offset + WRITE_CHUNK)], offset)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += written
