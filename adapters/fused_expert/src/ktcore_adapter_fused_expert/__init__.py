"""ktcore-adapter-fused-expert: KT-compatible fused-expert LoRA (fused_expert_lora.safetensors + kt_adapter_manifest.json), validated fail-closed."""
