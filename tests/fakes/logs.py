"""Run `stargate.logs.configure_logging` in a test and read what it wrote, then put logging back."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from stargate.logs import CLAMPED_LOGGERS, configure_logging


@contextmanager
def captured_logs(level: str = "debug", log_format: str = "text") -> Iterator[io.StringIO]:
    """Configure logging as a command would, writing to the yielded buffer instead of stderr."""
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in CLAMPED_LOGGERS}
    buffer = io.StringIO()
    configure_logging(level, log_format, stream=buffer)
    try:
        yield buffer
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)  # no-op for those still there
        root.setLevel(root_level)
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)
