"""The optimizer step, the loss interface and the SFT loop, composed of the pieces in distributed/, models/, data/;
the RL loop (``rl/``) builds on them."""
