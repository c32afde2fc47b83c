"""The optimizer step and the SFT / RL loops, composed of the pieces in distributed/, models/, rl/."""
