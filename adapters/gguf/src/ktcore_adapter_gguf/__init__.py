"""ktcore-adapter-gguf: llama.cpp LoRA adapter GGUF (general.type = adapter), expert LoRA on the _exps tensors."""
