"""Model integration: ktcore in transformers (experts wrapped, placeholders, expert LoRA, dense MLPs, placement)."""
