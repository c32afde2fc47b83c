"""The RL loop (``loop.py``, its colocated/disjoint roles, the inference-side loop) and its pieces: the async
schedule, advantages, losses, the stop/go protocol."""
