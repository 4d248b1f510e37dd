"""What a model path gives besides ktcore's expert streaming: its tokenizer, a plain transformers model, and the
name an adapter records as its base. A path is a directory saved by ``save_pretrained`` or a ``.gguf`` file
(config and tokenizer from its metadata); ``ktcore chat`` and the training frontends open it the same way."""

from __future__ import annotations

from pathlib import Path


def is_gguf(path) -> bool:
    path = Path(path)
    return path.is_file() and path.suffix.lower() == ".gguf"


def _from_pretrained_args(path) -> tuple[str, dict]:
    """(the name transformers' ``from_pretrained`` takes, its extra keywords): a GGUF file is its folder plus
    ``gguf_file``. A Hub ID (a string, no local path) passes through."""
    if is_gguf(path):
        path = Path(path)
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}


def load_tokenizer(path, trust_remote_code: bool = False):
    """The tokenizer of a model directory, or the one a ``.gguf`` file's metadata describes."""
    from transformers import AutoTokenizer

    name, kwargs = _from_pretrained_args(path)
    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)


def record_base(model, path) -> None:
    """Name ``path`` (a ``.gguf`` file, resolved to an absolute path) as the model's origin, which PEFT writes as
    the adapter's ``base_model_name_or_path``: the base that ``ktcore chat``, ``adapter verify`` and
    ``adapter convert`` find and fingerprint. (transformers would name the GGUF's folder, or nothing.)"""
    if is_gguf(path):
        model.config._name_or_path = str(Path(path).resolve())
        model.name_or_path = model.config._name_or_path


def load_plain_model(path, dtype=None, trust_remote_code: bool = False, **from_pretrained):
    """The model with plain transformers (no CPU experts); a ``.gguf`` file's tensors dequantised to ``dtype``.
    ``from_pretrained``: more keywords for transformers (``config=``)."""
    from transformers import AutoModelForCausalLM

    name, kwargs = _from_pretrained_args(path)
    extra = {} if dtype is None else {"dtype": dtype}  # None: transformers' own default
    extra.update(from_pretrained)
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs, **extra)
    if kwargs:
        # transformers' GGUF loading leaves plain dequantised tensors but marks the model quantised, and then
        # refuses to save it or to train it
        model.hf_quantizer, model.is_quantized = None, False
        record_base(model, path)
    return model


def write_metadata_dir(path, out) -> Path:
    """A directory with the config.json and tokenizer files a ``.gguf`` file's metadata describes, and no weights:
    for code that opens a model by directory (LLaMA-Factory's config and tokenizer loading) while ktcore loads
    the weights from the file itself. The config is the one ``ktcore.load_model`` builds the model from."""
    from .gguf_reader import GGUFFile, gguf_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with GGUFFile(path) as file:
        gguf_config(file).save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return out
