"""ktcore-adapter-peft: The standard PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), ktcore's default adapter format."""
