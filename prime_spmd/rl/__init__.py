"""RL pieces: rollout records, advantages, losses, the async schedule."""
