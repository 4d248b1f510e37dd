"""llama.cpp itself as an oracle: greedy tokens and next-token log-probabilities of a GGUF model (plus a LoRA
adapter GGUF) from node-llama-cpp's prebuilt CPU build of llama.cpp, run by ``run.mjs`` beside this file.

node-llama-cpp is installed outside the repository (``scripts/setup.sh`` does it when npm is present) into
``~/.cache/ktcore/node-llama-cpp-<VERSION>``, or the directory ``$KTCORE_NODE_LLAMA_CPP`` names. Tests call
``unavailable()`` and skip with its reason when node, npm's install or the prebuilt binary is missing.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

VERSION = "3.21.1"  # keep in step with scripts/setup.sh
SCRIPT = Path(__file__).with_name("run.mjs")


def install_dir() -> Path:
    default = Path.home() / ".cache" / "ktcore" / f"node-llama-cpp-{VERSION}"
    return Path(os.environ.get("KTCORE_NODE_LLAMA_CPP", default))


def _module() -> Path:
    return install_dir() / "node_modules" / "node-llama-cpp" / "dist" / "index.js"


def unavailable() -> Optional[str]:
    """Why llama.cpp cannot run here, or None when it can."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"the llama.cpp tests use node-llama-cpp's linux-x64 CPU binary; this is {platform.system()} " \
               f"{platform.machine()}"
    node = shutil.which("node")
    if node is None:
        return "node is not installed (Node.js >= 20 and npm run the llama.cpp tests; then bash scripts/setup.sh)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < 20:
        return f"node {version} is too old: node-llama-cpp {VERSION} needs Node.js >= 20"
    package = install_dir() / "node_modules" / "node-llama-cpp" / "package.json"
    if not package.is_file():
        return (f"node-llama-cpp {VERSION} is not installed in {install_dir()} (bash scripts/setup.sh installs it "
                "when npm is present)")
    found = json.loads(package.read_text(encoding="utf-8")).get("version")
    if found != VERSION:
        return f"{package}: node-llama-cpp {found}, the tests pin {VERSION} (rerun bash scripts/setup.sh)"
    binaries = install_dir() / "node_modules" / "@node-llama-cpp" / "linux-x64" / "bins"
    if not any(binaries.glob("*/llama-addon.node")):
        return f"node-llama-cpp's prebuilt linux-x64 binary is missing under {binaries} (rerun bash scripts/setup.sh)"
    return None


@dataclass
class Prompt:
    tokens: list[int]             # the prompt, already tokenized (chat template applied)
    max_new_tokens: int = 16      # greedy tokens to generate (an end-of-generation token ends it early)
    score: list[int] = field(default_factory=list)  # a continuation to read log-probabilities along


@dataclass
class Result:
    greedy: list[int]
    logprobs: list[dict[int, float]]  # [i]: the most likely next tokens after tokens + score[:i] -> log p


def run(model, prompts: Sequence[Prompt], lora=None, threads: int = 1, top: int = 20,
        context_size: int = 512, timeout: float = 600) -> tuple[str, list[Result]]:
    """(llama.cpp release, one Result per prompt) for the GGUF ``model`` with the LoRA GGUF ``lora`` (if any)."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    request = {"module": str(_module()), "model": str(model), "lora": str(lora) if lora else None,
               "threads": threads, "context_size": context_size, "top": top,
               "prompts": [{"tokens": p.tokens, "max_new_tokens": p.max_new_tokens, "score": p.score}
                           for p in prompts]}
    with tempfile.TemporaryDirectory(prefix="ktcore-llamacpp-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request), encoding="utf-8")
        proc = subprocess.run(["node", str(SCRIPT), str(request_path), str(result_path)], capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp (node {SCRIPT.name}) failed with exit code {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        answer = json.loads(result_path.read_text(encoding="utf-8"))
    results = [Result(greedy=r["greedy"], logprobs=[{int(t): lp for t, lp in pos} for pos in r["logprobs"]])
               for r in answer["results"]]
    return answer["llama_cpp"]["release"], results


def add_stand_in_vocab(writer, vocab_size: int) -> None:
    """Give a test model's GGUF (``gguf.GGUFWriter``) the vocab llama.cpp insists on: byte-level BPE whose token 0 is
    the newline llama.cpp looks up while loading; the others are placeholders (the tests pass token ids)."""
    tokens = ["\u010a"] + [f"t{i}" for i in range(1, vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab_size)  # normal tokens
    writer.add_token_merges([f"{tokens[1]} {tokens[2]}"])  # the key must exist; an empty list is not written


def logprob_gap(ours, theirs: list[dict[int, float]]) -> float:
    """The largest |log p_ours - log p_llama.cpp| over llama.cpp's listed most likely tokens at each position;
    ``ours`` is a [positions, vocab] tensor of log-probabilities for the same positions."""
    return max(abs(float(ours[i, token]) - lp) for i, top in enumerate(theirs) for token, lp in top.items())
