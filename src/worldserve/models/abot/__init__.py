"""``abot-world``: ABot-World-0-5B-LF (amap-cvlab), a keyboard world model on Wan2.2-TI2V-5B's parts."""
