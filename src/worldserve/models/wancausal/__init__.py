"""``wan-causal``: a block-causal Wan2.1-class (Self-Forcing / CausVid) world model on diffusers."""
