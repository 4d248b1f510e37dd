"""LLaMA-Factory-style datasets for the TRL frontend.

A ``dataset_dir`` holds ``dataset_info.json``, which maps dataset names to files and says how to read them::

    {"my_sft":  {"file_name": "data.json"},                                   # alpaca, default columns
     "my_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt",
                 "columns": {"messages": "conversations", "system": "system"},
                 "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}},
     "my_pref": {"file_name": "pairs.json", "ranking": true, "formatting": "sharegpt",
                 "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}}

Reading is split in two so that every problem shows up before a model is loaded:

1. ``load_examples(cfg)`` reads and validates the files and returns ``Example`` records (a conversation as chat
   messages, plus chosen/rejected answers for preference data). No tokenizer needed.
2. ``tokenize_sft(examples, tokenizer, cfg)`` renders them with the chat template (the tokenizer's own for
   ``template: default``), masks everything but the assistant answers with -100 and applies ``cutoff_len``.

Every problem is a ``ktcore.config.ConfigError`` with one line naming the file or key and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ktcore.config import ConfigError
from ktcore.files import inside_root
from ktcore.frontends.skeleton import IGNORE_INDEX

INFO_FILE = "dataset_info.json"
DATA_SUFFIXES = (".json", ".jsonl")

# LLaMA-Factory's documented defaults for dataset_info.json entries.
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None,
                  "system": None, "chosen": None, "rejected": None}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "tools": None, "chosen": None, "rejected": None}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}

# Chat templates the frontend knows by name besides the tokenizer's own ("default").
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML, "qwen": CHATML}
TEMPLATE_CHOICES = ("default",) + tuple(TEMPLATES)


@dataclass
class Example:
    """One conversation. ``messages`` ends with the assistant answer for SFT; for preference data it ends with
    the last user turn and ``chosen``/``rejected`` hold the two answers."""

    messages: list = field(default_factory=list)  # [{"role": ..., "content": ...}], system first if any
    chosen: Optional[str] = None
    rejected: Optional[str] = None
    source: str = ""  # "file.json[3]" for messages about this example


def resolve_template(cfg, tokenizer=None) -> Optional[str]:
    """The Jinja chat template to use: None for the tokenizer's own. Unknown names are a ConfigError."""
    name = cfg.template
    if name in (None, "", "default"):
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{cfg.where}: template: the tokenizer of {cfg.model_name_or_path} has no chat "
                              f"template; set template to one of {', '.join(TEMPLATES)}")
        return None
    if name not in TEMPLATES:
        raise ConfigError(f"{cfg.where}: template {name!r} is not known to the trl frontend; choose one of "
                          f"{', '.join(TEMPLATE_CHOICES)} (default: the tokenizer's own chat template)")
    return TEMPLATES[name]


# ---- reading dataset_info.json and the files ---------------------------------------------------------------


def _dataset_names(value: Optional[str], key: str, cfg) -> list[str]:
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{cfg.where}: {key} is required: a comma list of names from "
                          f"{Path(cfg.dataset_dir) / INFO_FILE}")
    return names


def read_dataset_info(dataset_dir) -> dict:
    path = Path(dataset_dir) / INFO_FILE
    if not Path(dataset_dir).is_dir():
        raise ConfigError(f"dataset_dir {str(dataset_dir)!r} is not a directory; set dataset_dir to the folder "
                          f"holding {INFO_FILE}")
    if not path.is_file():
        raise ConfigError(f"{path}: no {INFO_FILE} in dataset_dir; create it (it maps dataset names to files) "
                          "or point dataset_dir at the folder that has it")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}; fix the file") from exc
    if not isinstance(info, dict):
        raise ConfigError(f"{path}: must be a JSON object mapping dataset names to entries")
    return info


def _read_records(path: Path, name: str) -> list:
    files = sorted(p for p in path.iterdir() if p.suffix in DATA_SUFFIXES) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise ConfigError(f"{path}: dataset {name!r}: the folder holds no .json or .jsonl files")
    records: list = []
    for file in files:
        if file.suffix not in DATA_SUFFIXES:
            raise ConfigError(f"{file}: dataset {name!r}: unsupported file type {file.suffix!r}; use .json "
                              "(a list of objects) or .jsonl (one object per line)")
        try:
            text = file.read_text(encoding="utf-8")
            if file.suffix == ".jsonl":
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                rows = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: dataset {name!r} is not valid JSON: {exc}; fix the file") from exc
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{file}: dataset {name!r} must be a JSON list of objects (or JSON lines)")
        records += [(f"{file.name}[{i}]", r) for i, r in enumerate(rows)]
    return records


def _entry(info: dict, name: str, info_path: Path) -> dict:
    if name not in info:
        raise ConfigError(f"{info_path}: dataset {name!r} is not defined; add it or choose one of "
                          f"{', '.join(sorted(info)) or '(none defined)'}")
    entry = info[name]
    if not isinstance(entry, dict):
        raise ConfigError(f"{info_path}: entry {name!r} must be an object with at least file_name")
    if "file_name" not in entry:
        other = [k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
                 if k in entry]
        how = f" ({other[0]} is not supported by the trl frontend yet; download the data)" if other else ""
        raise ConfigError(f"{info_path}: entry {name!r} has no file_name{how}; set file_name to a .json/.jsonl "
                          "file or folder inside dataset_dir")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(f"{info_path}: entry {name!r}: formatting {formatting!r} is not one of alpaca, sharegpt")
    return entry


def _text(value, what: str, src: str, file_hint: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{file_hint}: {src}: {what} must be a string, got {type(value).__name__}")
    return value


def _alpaca(record: dict, src: str, columns: dict, ranking: bool, hint: str) -> Example:
    col = lambda key: record.get(columns[key]) if columns.get(key) else None  # noqa: E731
    messages = []
    system = _text(col("system"), f"column {columns.get('system')!r}", src, hint)
    if system:
        messages.append({"role": "system", "content": system})
    history = col("history") or []
    if not isinstance(history, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2 for t in history):
        raise ConfigError(f"{hint}: {src}: column {columns['history']!r} must be a list of [query, answer] pairs")
    for query, answer in history:
        messages += [{"role": "user", "content": str(query)}, {"role": "assistant", "content": str(answer)}]
    prompt = _text(col("prompt"), f"column {columns['prompt']!r}", src, hint)
    query = _text(col("query"), f"column {columns.get('query')!r}", src, hint)
    messages.append({"role": "user", "content": "\n".join(p for p in (prompt, query) if p)})
    if ranking:
        chosen, rejected = col("chosen"), col("rejected")
        return Example(messages, _text(chosen, "chosen", src, hint), _text(rejected, "rejected", src, hint), src)
    messages.append({"role": "assistant", "content": _text(col("response"), f"column {columns['response']!r}",
                                                           src, hint)})
    return Example(messages, source=src)


def _sharegpt(record: dict, src: str, columns: dict, tags: dict, ranking: bool, hint: str) -> Example:
    turns = record.get(columns["messages"])
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{hint}: {src}: column {columns['messages']!r} must be a non-empty list of turns")
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system",
             tags["observation_tag"]: "tool", tags["function_tag"]: "assistant"}
    messages = []
    system = record.get(columns["system"]) if columns.get("system") else None
    if system:
        messages.append({"role": "system", "content": _text(system, "system", src, hint)})

    def convert(turn, i):
        if not isinstance(turn, dict) or tags["role_tag"] not in turn or tags["content_tag"] not in turn:
            raise ConfigError(f"{hint}: {src}: turn {i} needs keys {tags['role_tag']!r} and {tags['content_tag']!r} "
                              "(set tags.role_tag / tags.content_tag in dataset_info.json)")
        role = roles.get(turn[tags["role_tag"]])
        if role is None:
            raise ConfigError(f"{hint}: {src}: turn {i} has role {turn[tags['role_tag']]!r}; expected one of "
                              f"{', '.join(repr(r) for r in roles)} (set tags.*_tag in dataset_info.json)")
        return {"role": role, "content": _text(turn[tags["content_tag"]], "content", src, hint)}

    converted = [convert(t, i) for i, t in enumerate(turns)]
    if converted[0]["role"] == "system":  # a system turn in the conversation wins over the system column
        messages = []
    messages += converted
    if ranking:
        chosen, rejected = record.get(columns["chosen"]), record.get(columns["rejected"])
        pick = lambda v, what: convert(v, what)["content"] if isinstance(v, dict) else _text(v, what, src, hint)  # noqa: E731
        return Example(messages, pick(chosen, "chosen"), pick(rejected, "rejected"), src)
    if messages[-1]["role"] != "assistant":
        raise ConfigError(f"{hint}: {src}: the last turn must be the assistant's ({tags['assistant_tag']!r}) for SFT")
    return Example(messages, source=src)


def load_examples(cfg, names: Optional[str] = None, key: str = "dataset", ranking: Optional[bool] = None
                  ) -> list[Example]:
    """Read the datasets named by ``cfg.dataset`` (or ``names``); validate everything; no tokenizer needed.

    ``ranking``: True to require preference data (DPO), False to require SFT data, None for either.
    """
    dataset_dir = Path(cfg.dataset_dir)
    info = read_dataset_info(dataset_dir)
    info_path = dataset_dir / INFO_FILE
    examples: list[Example] = []
    for name in _dataset_names(names if names is not None else getattr(cfg, key), key, cfg):
        entry = _entry(info, name, info_path)
        is_ranking = bool(entry.get("ranking", False))
        if ranking is not None and is_ranking != ranking:
            want = "preference pairs (ranking: true)" if ranking else "SFT data (no ranking)"
            raise ConfigError(f"{info_path}: dataset {name!r} is {'a preference' if is_ranking else 'an SFT'} "
                              f"dataset but stage {cfg.stage!r} needs {want}; pick another dataset")
        path = inside_root(dataset_dir, entry["file_name"], f"{info_path}: dataset {name!r}: file_name")
        if not path.exists():
            raise ConfigError(f"{path}: file of dataset {name!r} does not exist; fix file_name in {info_path}")
        formatting = entry.get("formatting", "alpaca")
        defaults = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
        columns = {**defaults, **(entry.get("columns") or {})}
        tags = {**SHAREGPT_TAGS, **(entry.get("tags") or {})}
        records = _read_records(path, name)
        if cfg.max_samples is not None:
            records = records[: cfg.max_samples]
        required = (["prompt"] if formatting == "alpaca" else ["messages"])
        required += ["chosen", "rejected"] if is_ranking else (["response"] if formatting == "alpaca" else [])
        for column in required:
            if not columns.get(column):
                raise ConfigError(f"{info_path}: dataset {name!r} needs columns.{column} (which key of each record "
                                  "holds it)")
            missing = [src for src, r in records if columns[column] not in r]
            if missing:
                raise ConfigError(f"{path}: dataset {name!r}: {len(missing)} record(s) lack column "
                                  f"{columns[column]!r} (first: {missing[0]}); fix the data or set columns.{column} "
                                  f"in {info_path}")
        for src, record in records:
            if formatting == "alpaca":
                examples.append(_alpaca(record, src, columns, is_ranking, str(path)))
            else:
                examples.append(_sharegpt(record, src, columns, tags, is_ranking, str(path)))
    if not examples:
        raise ConfigError(f"{cfg.where}: {key} {getattr(cfg, key) if names is None else names!r} holds no "
                          "examples; add data or raise max_samples")
    return examples


# ---- tokenizing with the chat template ---------------------------------------------------------------------


def _render(tokenizer, template, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _segments(tokenizer, template, messages, src: str) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, trained) pieces: each assistant answer is trained."""
    full = _render(tokenizer, template, messages, False)
    pieces, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, template, messages[:i], True)
        upto = _render(tokenizer, template, messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= done):
            raise ConfigError(f"{src}: the chat template does not render this conversation turn by turn (a prefix of "
                              "the chat changes when a turn is added), so prompt and answer cannot be told apart; "
                              f"set template to one of {', '.join(TEMPLATES)}")
        pieces += [(full[done:len(before)], False), (full[len(before):len(upto)], True)]
        done = len(upto)
    pieces.append((full[done:], False))
    return [(text, trained) for text, trained in pieces if text]


def _budget(source: int, target: int, cutoff: int) -> tuple[int, int]:
    """How many prompt and answer tokens of one turn fit in ``cutoff`` (answers keep at least their share)."""
    if source + target <= cutoff:
        return source, target
    if 2 * target < cutoff:
        max_target = target
    elif 2 * source < cutoff:
        max_target = cutoff - source
    else:
        max_target = int(cutoff * target / (source + target))
    new_target = min(max_target, target)
    return min(max(cutoff - new_target, 0), source), new_target


def tokenize_example(example: Example, tokenizer, template, cutoff_len: int) -> dict:
    """``input_ids`` and ``labels`` (-100 on prompt tokens) of one SFT example, cut to ``cutoff_len``."""
    pieces = _segments(tokenizer, template, example.messages, example.source)
    encoded = [(tokenizer(text, add_special_tokens=False)["input_ids"], trained) for text, trained in pieces]
    input_ids, labels, left = [], [], cutoff_len
    pending: list[int] = []  # prompt tokens waiting for their answer
    for ids, trained in encoded:
        if not trained:
            pending += ids
            continue
        if left <= 0:
            break
        n_src, n_tgt = _budget(len(pending), len(ids), left)
        input_ids += pending[:n_src] + ids[:n_tgt]
        labels += [IGNORE_INDEX] * n_src + ids[:n_tgt]
        left -= n_src + n_tgt
        pending = []
    if pending and left > 0:  # trailing template text after the last answer (e.g. a newline)
        input_ids += pending[:left]
        labels += [IGNORE_INDEX] * min(len(pending), left)
    return {"input_ids": input_ids, "labels": labels}


def tokenize_sft(examples: list[Example], tokenizer, cfg, template: Optional[str] = None):
    """A ``datasets.Dataset`` with ``input_ids`` and ``labels`` for TRL's SFTTrainer (prompt tokens -100)."""
    rows = []
    for example in examples:
        row = tokenize_example(example, tokenizer, template, cfg.cutoff_len)
        if any(label != IGNORE_INDEX for label in row["labels"]):
            rows.append(row)
    if not rows:
        raise ConfigError(f"{cfg.where}: no example keeps an answer token after cutoff_len={cfg.cutoff_len}; "
                          "raise cutoff_len or check the dataset's answer column")
    return _dataset(rows)


def _dataset(rows: list[dict]):
    """A ``datasets.Dataset`` whose fingerprint is the hash of its content.

    (``Dataset.from_list`` would fingerprint by pickling the Arrow table, which fails with some
    pyarrow/dill/Python combinations, e.g. pyarrow 26 on Python 3.12.)
    """
    import hashlib

    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    return Dataset(InMemoryTable(pa.table(columns)), fingerprint=f"ktcore-{digest}")


# ---- preference pairs (DPO) --------------------------------------------------------------------------------


def tokenize_pair(example: Example, tokenizer, template, cutoff_len: int) -> dict:
    """``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` of one preference pair (TRL's DPO collator format).

    The prompt is the conversation rendered up to the assistant's turn; each answer is the text the chat
    template adds for it (including its end-of-turn tokens). ``cutoff_len`` bounds prompt + the longer answer
    (answers keep at least their share, as in SFT).
    """
    prompt_text = _render(tokenizer, template, example.messages, True)
    answers = []
    for answer in (example.chosen, example.rejected):
        full = _render(tokenizer, template, example.messages + [{"role": "assistant", "content": answer}], False)
        if not full.startswith(prompt_text):
            raise ConfigError(f"{example.source}: the chat template renders the prompt differently once an answer "
                              f"follows, so prompt and answer cannot be told apart; set template to one of "
                              f"{', '.join(TEMPLATES)}")
        answers.append(tokenizer(full[len(prompt_text):], add_special_tokens=False)["input_ids"])
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    n_src, n_tgt = _budget(len(prompt), max(len(a) for a in answers), cutoff_len)
    return {"prompt_ids": prompt[len(prompt) - n_src:] if n_src else [],  # keep the end of a long prompt
            "chosen_ids": answers[0][:n_tgt], "rejected_ids": answers[1][:n_tgt]}


def tokenize_pairs(examples: list[Example], tokenizer, cfg, template: Optional[str] = None):
    """A ``datasets.Dataset`` with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` for TRL's DPOTrainer."""
    rows = []
    for example in examples:
        row = tokenize_pair(example, tokenizer, template, cfg.cutoff_len)
        if row["chosen_ids"] and row["rejected_ids"] and row["chosen_ids"] != row["rejected_ids"]:
            rows.append(row)
    if not rows:
        raise ConfigError(f"{cfg.where}: no preference pair keeps two different answers after "
                          f"cutoff_len={cfg.cutoff_len}; raise cutoff_len or check the chosen/rejected columns")
    return _dataset(rows)
