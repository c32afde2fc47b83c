"""The project's one logger.

Rank 0 logs at INFO by default; other ranks log WARNING and above, each message prefixed with
``[rank N]`` so that an 8-rank hang can be read from one interleaved log. ``log_all`` forces a
message out on every rank.
"""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "prime_spmd"


def global_rank() -> int:
    """The torchrun global rank of this process (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.rank = global_rank()
        return super().format(record)


def get_logger() -> logging.Logger:
    """Return the project logger, configuring it once (stderr, rank prefix, level by rank)."""
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_RankFormatter("%(asctime)s [rank %(rank)d] %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        level = os.environ.get("PRIME_SPMD_LOG_LEVEL", "INFO" if global_rank() == 0 else "WARNING")
        logger.setLevel(level)
    return logger


logger = get_logger()

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log a warning the first time this exact message is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
