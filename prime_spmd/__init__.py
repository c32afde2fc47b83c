"""prime-spmd: asynchronous RL post-training for LLMs as one torchrun SPMD program."""

__version__ = "0.1.0"
