"""The ``ferrokv`` logger: INFO and above to stderr by default, as vLLM does for ``vllm``.

``configure_logging()`` runs once on ``import ferrokv``. It gives the ``ferrokv`` logger one
handler with one prefix (``INFO 12-01 10:00:00 [ferrokv] message``) and stops propagation to the
root logger, so an application that configures logging itself never sees a line twice.
Environment: ``FERROKV_LOGGING_LEVEL`` (DEBUG, INFO, WARNING, ERROR, CRITICAL or a number; default
INFO) sets the level; ``FERROKV_CONFIGURE_LOGGING=0`` leaves the logger entirely to the application.
Messages therefore never start with "ferrokv:" themselves.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["CONFIGURE_ENV", "FORMAT", "LEVEL_ENV", "LOGGER_NAME", "configure_logging", "logging_level"]

LOGGER_NAME = "ferrokv"
LEVEL_ENV = "FERROKV_LOGGING_LEVEL"
CONFIGURE_ENV = "FERROKV_CONFIGURE_LOGGING"
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (as ``logging.lastResort``
    does), so redirecting stderr after import (pytest, notebooks) still captures the lines."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def logging_level(value: str | None = None) -> int:
    """The level named by ``value`` (default: ``$FERROKV_LOGGING_LEVEL``, else INFO)."""
    raw = os.environ.get(LEVEL_ENV, "INFO") if value is None else value
    text = raw.strip().upper()
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text)
    if not isinstance(level, int):
        raise ValueError(
            f"{LEVEL_ENV}: {raw!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL or a number)")
    return level


def configure_logging() -> logging.Logger:
    """Idempotent: a second call only re-reads the level."""
    logger = logging.getLogger(LOGGER_NAME)
    if os.environ.get(CONFIGURE_ENV, "1").strip() == "0":
        return logger
    logger.setLevel(logging_level())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt=_DATEFMT))
        logger.addHandler(handler)
    logger.propagate = False
    return logger
