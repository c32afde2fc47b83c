"""Building blocks shared by our model families: norm, rope, attention, MoE."""
