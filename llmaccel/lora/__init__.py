"""LoRA adapters served beside the base model, many in one batch (lora/layers.py says how)."""
