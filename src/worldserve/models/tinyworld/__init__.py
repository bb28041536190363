"""tinyworld: a small block-causal diffusion world model trained on the procedural world."""
