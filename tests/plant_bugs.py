"""Plant plausible bugs in the product code, one at a time, and check that the suite catches each.

    .venv/bin/python tests/plant_bugs.py [NAME ...]

Each plant replaces exact snippets in whichever tracked file holds them (so it survives modules moving), runs
the tests that should notice, restores the file, and reports ``caught`` (the tests failed), ``MISSED`` (they
passed) or ``stale`` (the snippet is gone: re-point the plant at today's code). A file with uncommitted changes
is never touched. Exit status 1 when any plant is missed or stale.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plant:
    name: str
    edits: tuple  # (snippet, replacement) pairs, all in one file
    tests: tuple  # pytest arguments
    where: str = ""  # part of the file's path, where the snippet is in more than one file


PLANTS = [
    Plant("gate and up swapped when llamafile packs dense experts",
          (("Projection(quantise(weights.gate), t, i, h), Projection(quantise(weights.up), t, i, h)",
            "Projection(quantise(weights.up), t, i, h), Projection(quantise(weights.gate), t, i, h)"),),
          ("backends/llamafile/tests/test_contract.py", "backends/llamafile/tests/test_models.py",
           "-k", "Q8_0 or Q4_K or F32 or dequantised_weights")),
    Plant("gate_up and down LoRA scales swapped where ExpertLayer hands them to autograd",
          (("scales = (lora.gate_up_scale, lora.down_scale)", "scales = (lora.down_scale, lora.gate_up_scale)"),),
          ("tests/test_torch_backend.py", "backends/amx_bf16/tests/test_amx_bf16.py", "-k", "Contract")),
    *(Plant(f"{name} computes the expert-LoRA gradients before it hands back the input gradient",
            (("            return native_grads(lora, lora_gu, lora_dn) if lora is not None else ExpertLoRAGrads()\n\n"
              "        return grad_x, grad_w, lora_grads\n",
              "            return native_grads(lora, lora_gu, lora_dn) if lora is not None else ExpertLoRAGrads()\n\n"
              "        grads = lora_grads()\n        return grad_x, grad_w, lambda: grads\n"),),
            (f"backends/{name}/tests/test_{name}.py", "-k", "second_part"), where=f"{name}/")
      for name in ("amx_bf16", "amx_int8")),
    Plant("sha256_file hashes only the first MiB",
          (("        while block := f.read(chunk):\n            h.update(block)\n", "        h.update(f.read(chunk))\n"),),
          ("tests/test_adapters.py",)),
    Plant("expert-LoRA factors rounded to bf16 where they cross into the native backends",
          (("a, b = _native(a.detach()), _native(b.detach())",
            "a, b = _native(a.detach()).bfloat16(), _native(b.detach()).bfloat16()"),),
          ("tests/test_expert_lora.py", "backends/llamafile/tests/test_contract.py", "-k",
           "lora or Q8_0 or Q4_K")),
    Plant("a weight-store file used without checking its SHA-256",
          (('if hashlib.sha256(buf.numpy()).hexdigest() != self.manifest["files"][name]["sha256"]:', "if False:"),),
          ("tests/test_weight_store.py", "-k", "broken_expert_store")),
    Plant("an int8 store written with gate's scales for up",
          (('"up.scales": us[:, start:end]', '"up.scales": gs[:, start:end]'),),
          ("tests/test_weight_store.py", "-k", "int8_store")),
    Plant("a recomputed layer with resident experts takes the layer's current set, not its forward's",
          (("    chosen = replay.kept() if replay.recomputing() else None\n",
            "    chosen = replay.kept() if replay.recomputing() else None\n"
            "    chosen = resident.choose() if chosen is not None else None\n"),),
          ("tests/test_resident.py", "-k", "checkpointed")),
    Plant("resident experts' LoRA factors gathered without their gradient",
          (("return None if a is None else (b.index_select(0, ids), a.index_select(0, ids), scale)",
            "return None if a is None else (b.detach()[ids], a.detach()[ids], scale)"),),
          ("tests/test_resident.py", "-k", "across_refreshes")),
    Plant("a resident expert's token-slots computed by the CPU backend as well",
          (("torch.where(slot < resident.n, module.num_experts, top_k_index)", "top_k_index"),),
          ("tests/test_resident.py", "-k", "across_refreshes")),
]


def holder(snippet: str, where: str = "") -> Path | None:
    """The one tracked Python file holding ``snippet`` (of those whose path contains ``where``)."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = [ROOT / f for f in files.stdout.split()
             if "/tests/" not in f"/{f}" and where in f and snippet in (ROOT / f).read_text()]
    return found[0] if len(found) == 1 else None


def run(plant: Plant) -> str:
    path = holder(plant.edits[0][0], plant.where)
    if path is None or any(old not in path.read_text() for old, _ in plant.edits):
        return "stale"
    if subprocess.run(["git", "diff", "--quiet", "--", str(path)], cwd=ROOT).returncode:
        sys.exit(f"{path} has uncommitted changes; commit or stash them first")
    original = path.read_text()
    planted = original
    for old, new in plant.edits:
        planted = planted.replace(old, new)
    try:
        path.write_text(planted)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *plant.tests],
                              cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    return {0: "MISSED", 1: "caught"}.get(proc.returncode, f"error (pytest exit {proc.returncode})")


def main(names: list[str]) -> int:
    chosen = [p for p in PLANTS if not names or any(n in p.name for n in names)]
    bad = 0
    for plant in chosen:
        start = time.perf_counter()
        verdict = run(plant)
        bad += verdict != "caught"
        print(f"{verdict:8s} {plant.name} ({time.perf_counter() - start:.0f} s: pytest {' '.join(plant.tests)})",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
