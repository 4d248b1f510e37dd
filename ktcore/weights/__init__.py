"""Checkpoint readers (safetensors shards; GGUF comes with the architectures issue)."""
