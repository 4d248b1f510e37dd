"""Checkpoints: the safetensors and GGUF readers (validated before use, under the model's names) and
``load_model``, which streams a checkpoint's routed experts into the backend."""
