"""The `llmaccel` logger prints INFO lines (KV capacity, conversions, kernel builds) by default, as
vLLM's does; set LLMACCEL_LOG_LEVEL=WARNING to quiet it, or configure logging yourself first."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    logger = logging.getLogger("llmaccel")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("LLMACCEL_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
