"""``ktcore bench convert``: ``ktcore convert``'s throughput against ``dd`` reading the same files, one run.

Both start from a cold page cache for the source files: this process cannot drop the system's caches (that
needs root), so it writes back and evicts just those files (``fsync`` + ``posix_fadvise(DONTNEED)``, which any
reader of a file may do) before ``dd`` and again before the conversion. The rate is source bytes (the shards
holding routed experts) over wall time; the conversion's includes hashing, writing and fsyncing the store.
Where the disk writes slower than it reads, the conversion cannot beat its write rate: ``dd`` writing with
``oflag=direct conv=fsync`` into the store's directory (as the conversion writes) is measured too, and the
store's write rate given as a share of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import KtcoreError


def synthetic_model(path: Path, gb: float) -> Path:
    """A random bf16 model of Qwen3-30B-A3B's layers with about ``gb`` GB of routed experts at ``path``
    (reused when a complete one is there already)."""
    from .bench_train import SHAPES, make_config, write_random_model

    if (path / "model.safetensors.index.json").is_file():
        return path
    shape = SHAPES["qwen3-30b-a3b"]
    c = shape.config
    layer_gb = 3 * c["num_experts"] * c["hidden_size"] * c["moe_intermediate_size"] * 2 / 1e9
    return write_random_model(make_config(shape, layers=max(1, round(gb / layer_gb))), path)


def expert_shards(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir`` that hold routed experts (what the conversion reads)."""
    from ..model.wrap import expert_modules, find_arch
    from ..weights.loading import meta_model_of
    from ..weights.safetensors_reader import SafetensorsCheckpoint, SafetensorsExpertSource

    config, model = meta_model_of(model_dir)
    arch = find_arch(config)
    with SafetensorsCheckpoint(model_dir) as ckpt:
        files = set()
        for layer, _, module in expert_modules(model, arch):
            files.update(ckpt.file_of(k) for k in SafetensorsExpertSource(ckpt, arch, layer, module).keys())
    return sorted(files)


def evict(files) -> None:
    """Write back and drop these files' pages from the page cache."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_seconds(files, block: str = "16M") -> float:
    """Wall time of ``dd if=FILE of=/dev/null bs=16M`` over every file, one after another."""
    start = time.perf_counter()
    for file in files:
        subprocess.run(["dd", f"if={file}", "of=/dev/null", f"bs={block}"], check=True, capture_output=True)
    return time.perf_counter() - start


def dd_write_mb_per_s(directory: Path, mib: int = 2048) -> float:
    """MB/s of ``dd if=/dev/zero bs=16M oflag=direct conv=fsync`` writing ``mib`` MiB into ``directory`` (as the
    conversion writes; without ``oflag=direct`` where the file system refuses it), the file removed afterwards:
    the most a conversion that writes its store durably can reach where the disk writes slower than it reads."""
    target = directory / f".ktcore-bench-dd-{os.getpid()}"
    try:
        for flags in (["oflag=direct", "conv=fsync"], ["conv=fsync"]):
            start = time.perf_counter()
            done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={mib // 16}", *flags],
                                  capture_output=True)
            if done.returncode == 0:
                return mib * 2**20 / (time.perf_counter() - start) / 1e6
        raise KtcoreError(f"dd could not write {target}: {done.stderr.decode().strip()}")
    finally:
        target.unlink(missing_ok=True)


def run(model_dir, out, fmt: str = "bf16", threadpools: int = 1, keep: bool = False, workers: int = 0) -> dict:
    """dd, then ``convert_model`` into ``out`` (a new directory, removed afterwards unless ``keep``)."""
    from ..weights.convert import convert_model, default_workers

    model_dir, out = Path(model_dir), Path(out)
    if out.exists():
        raise KtcoreError(f"{out} exists; bench convert writes a fresh store there (remove it, or another --workdir)")
    files = expert_shards(model_dir)
    nbytes = sum(f.stat().st_size for f in files)
    evict(files)
    dd = dd_seconds(files)
    evict(files)
    start = time.perf_counter()
    summary = convert_model(model_dir, out, fmt, threadpools, progress=False, workers=workers)
    seconds = time.perf_counter() - start
    write_rate = dd_write_mb_per_s(out.parent)
    result = {"model": str(model_dir), "format": fmt, "threadpools": threadpools, "source_gb": round(nbytes / 1e9, 3),
              "dd_s": round(dd, 2), "dd_mb_per_s": round(nbytes / dd / 1e6, 1), "convert_s": round(seconds, 2),
              "convert_mb_per_s": round(nbytes / seconds / 1e6, 1), "ratio": round(dd / seconds, 3),
              # the fixed start: the model built on the meta device, the checkpoint's headers read
              "startup_s": round(seconds - summary["seconds"], 2),
              "store_gb": round(summary["bytes_written"] / 1e9, 3), "workers": workers or default_workers(),
              "dd_write_mb_per_s": round(write_rate, 1),
              "store_write_ratio": round(summary["bytes_written"] / seconds / 1e6 / write_rate, 3)}
    if not keep:
        shutil.rmtree(out)
    return result


def format_result(result: dict) -> str:
    return (f"{result['source_gb']} GB of expert shards ({result['model']})\n"
            f"  dd bs=16M        {result['dd_s']:>8.2f} s  {result['dd_mb_per_s']:>8.1f} MB/s\n"
            f"  convert {result['format']:<5} x{result['threadpools']} {result['convert_s']:>8.2f} s  "
            f"{result['convert_mb_per_s']:>8.1f} MB/s  ({result['ratio']:.2f} x dd; wrote {result['store_gb']} GB, "
            f"{result['workers']} layers at once; {result['startup_s']:.2f} s of it starting)\n"
            f"  dd write direct  {result['dd_write_mb_per_s']:>19.1f} MB/s  (the store was written at "
            f"{result['store_write_ratio']:.2f} x that)\n"
            + json.dumps(result))
