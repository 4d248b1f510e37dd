"""A tiny chat MoE on disk, for frontend tests: loads through the real loading code in seconds."""

from __future__ import annotations

from pathlib import Path


def save_tiny_chat_moe(out, seed: int = 0) -> Path:
    """Saves a random Qwen3-MoE (6 routed experts, top-2, hidden 48) and a byte-level tokenizer with a chat
    template into ``out``; returns it."""
    from ktcore.commands.demo import build_byte_tokenizer, build_tiny_moe

    out = Path(out)
    tokenizer = build_byte_tokenizer()
    model = build_tiny_moe(tokenizer, seed=seed, hidden_size=48, moe_intermediate_size=32, num_experts=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64,
                           max_position_embeddings=1024)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
