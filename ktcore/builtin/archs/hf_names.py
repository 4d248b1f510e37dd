"""The names transformers 5 gives the routed experts of the MoE families it fuses (per-expert keys as the Hub
checkpoints hold them, the fused in-memory ones), shared by the built-in architecture plugins."""

EXPERTS = "model.layers.{layer}.mlp.experts"
PER_EXPERT_KEYS = {part: EXPERTS + ".{expert}." + part + "_proj.weight" for part in ("gate", "up", "down")}
FUSED_KEYS = {"gate_up": EXPERTS + ".gate_up_proj", "down": EXPERTS + ".down_proj"}
# the MLPs of a MoE family's dense layers, which llama.cpp's tables for the family lack: (model name, GGUF name)
GGUF_DENSE_MLP = (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight")
