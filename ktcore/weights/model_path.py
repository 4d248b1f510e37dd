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


def load_tokenizer(path, trust_remote_code: bool = False, config=None):
    """The tokenizer of a model directory, or the one a ``.gguf`` file's metadata describes (``config``: the
    config ktcore builds from that file's header, when the caller has it already; see ``gguf_tokenizer``)."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        return gguf_tokenizer(Path(path), config)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def gguf_tokenizer(path: Path, config=None):
    """What ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` returns, without its detour.

    AutoTokenizer first builds the file's transformers config only to pick the tokenizer class, and for a GGUF
    architecture outside transformers' fast config table (llama among them) that is a whole second parse of
    the file with gguf-py: about 3 s of SmolLM2-135M's 8 s ``ktcore chat`` load (benchmarks/RESULTS.md). The
    class is the one AutoTokenizer's own table gives for that config, here ktcore's config of the same header
    (built from the transformers mapping, tested equal); the class then reads and converts the tokenizer
    itself, as it does under AutoTokenizer, so the tokens are transformers' own in every version ktcore runs
    under. A ``tokenizer_config.json`` beside the file may name another class: then AutoTokenizer decides."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if (path.parent / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if config is None:
        from .gguf_reader import GGUFFile, gguf_config

        with GGUFFile(path) as file:
            config = gguf_config(file)
    tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend) or TokenizersBackend
    return tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)


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
        config = gguf_config(file)
    config.save_pretrained(out)
    load_tokenizer(path, config=config).save_pretrained(out)
    return out
