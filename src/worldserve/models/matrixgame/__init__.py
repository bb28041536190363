"""``matrix-game-2``: Skywork's Matrix-Game 2.0, the keyboard-and-mouse world model, built on the shared Wan parts."""
