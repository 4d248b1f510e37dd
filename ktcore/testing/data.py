"""LLaMA-Factory's demo datasets for tests: the real ones where the project's shared data holds them, else
small generated ones in the very same formats, so that no test depends on a checkout of ``../shared``.

The datasets are ``identity`` (alpaca records whose answers carry ``{{name}}`` and ``{{author}}``),
``alpaca_en_demo`` (alpaca records, some with an ``input``) and ``dpo_en_demo`` (sharegpt preference pairs:
``conversations``, ``chosen``, ``rejected``), all named in a ``dataset_info.json``. ``KTCORE_SHARED_DATA`` names
the directory to use instead of ``../shared/data/llamafactory_demo``; a directory that does not exist there
(``KTCORE_SHARED_DATA=/nowhere``) makes the tests run on the generated data.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Optional

SHARED_DATA_ENV = "KTCORE_SHARED_DATA"
DATASET_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
}
IDENTITY_QUESTIONS = (  # the chat test trains on the first two
    "hi", "Who are you?", "hello", "What is your name?", "Do you have a name?", "Introduce yourself.",
    "Tell me about yourself.", "Who made you?", "Who built you?", "Are you a person?", "What should I call you?",
    "Which company trained you?", "Who is your author?", "What are you?", "Good morning!", "Hey there",
    "Are you ChatGPT?", "Can you say who you are?", "Whom do I talk to?", "Your name, please.",
)


def default_shared_dir() -> Path:
    """``../shared/data/llamafactory_demo`` next to the repository this ktcore was installed from."""
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "llamafactory_demo"


def shared_dir() -> Optional[Path]:
    """The real demo data: ``$KTCORE_SHARED_DATA`` or the default location, when that directory exists."""
    value = os.environ.get(SHARED_DATA_ENV)
    path = Path(value) if value else default_shared_dir()
    return path if (path / "dataset_info.json").is_file() else None


def identity_records() -> list[dict]:
    answers = ("Hello, I am {{name}}, an assistant built by {{author}}. What can I do for you?",
               "I am {{name}}, an assistant built by {{author}}.",
               "My name is {{name}}; {{author}} trained me.")
    return [{"instruction": q, "input": "", "output": answers[i % 3]}
            for i, q in enumerate(IDENTITY_QUESTIONS)]


def alpaca_records(n: int = 64, seed: int = 0) -> list[dict]:
    """Small instruction tasks computed by code (sums, reversed and sorted words), some with an ``input``."""
    rng = random.Random(seed)
    words = ("planet", "river", "garden", "window", "silver", "market", "forest", "pencil", "bridge", "candle")
    out = []
    for i in range(n):
        a, b, word = rng.randint(2, 99), rng.randint(2, 99), rng.choice(words)
        kind = i % 4
        if kind == 0:
            out.append({"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} is {a + b}."})
        elif kind == 1:
            out.append({"instruction": "Write the word backwards.", "input": word, "output": word[::-1]})
        elif kind == 2:
            out.append({"instruction": "Sort the letters of the word.", "input": word,
                        "output": " ".join(sorted(word))})
        else:
            out.append({"instruction": f"Is {a} larger than {b}? Answer in a sentence.", "input": "",
                        "output": f"{'Yes' if a > b else 'No'}, {a} is {'larger' if a > b else 'not larger'} "
                                  f"than {b}."})
    return out


def preference_records(n: int = 32, seed: int = 1) -> list[dict]:
    """sharegpt preference pairs: a question, the right product (chosen) and a wrong one, asked back (rejected)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        out.append({"conversations": [{"from": "human", "value": f"What is {a} times {b}?"}],
                    "chosen": {"from": "gpt", "value": f"{a} times {b} is {a * b}."},
                    "rejected": {"from": "gpt", "value": f"{a} times {b} is {a * b + rng.randint(1001, 9999)}?"}})
    return out


def write_demo_data(directory) -> Path:
    """Generated ``identity``, ``alpaca_en_demo`` and ``dpo_en_demo`` with their ``dataset_info.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {"identity.json": identity_records(), "alpaca_en_demo.json": alpaca_records(),
             "dpo_en_demo.json": preference_records(), "dataset_info.json": DATASET_INFO}
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=1), encoding="utf-8")
    return directory


def demo_data(scratch) -> Path:
    """The real demo data where it exists, else generated data written into ``scratch``."""
    return shared_dir() or write_demo_data(scratch)
