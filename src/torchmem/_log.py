"""The ``torchmem`` logger and its debug switch.

Library code logs through ``logging.getLogger("torchmem")`` (and children such as
``torchmem.ledger``) and never configures logging on its own -- except when the user asks for
debug lines with ``TORCHMEM_DEBUG=1`` (MemLord's ``DEBUG=1`` works too): then the first call to
:func:`get_logger` attaches one stderr handler at DEBUG level, coloured when stderr is a terminal
(rich's handler, or plain ANSI codes if rich is missing) and plain text otherwise.

Example:
    >>> log = get_logger("ledger")
    >>> log.name
    'torchmem.ledger'
    >>> debug_requested({"TORCHMEM_DEBUG": "1"}), debug_requested({"DEBUG": "0"})
    (True, False)
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Optional

__all__ = [
    "get_logger",
    "debug_requested",
    "setup_debug_logging",
    "remove_debug_logging",
    "ColorFormatter",
]

ROOT = "torchmem"
_HANDLER_FLAG = "_torchmem_debug_handler"
_configured = False

# ANSI colours by level (used when rich is unavailable and the stream is a TTY)
_COLORS = {
    logging.DEBUG: "\x1b[36m",  # cyan
    logging.INFO: "\x1b[32m",  # green
    logging.WARNING: "\x1b[33m",  # yellow
    logging.ERROR: "\x1b[31m",  # red
    logging.CRITICAL: "\x1b[35m",  # magenta
}
_RESET = "\x1b[0m"


def debug_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``TORCHMEM_DEBUG`` or MemLord's ``DEBUG`` is set to something other than 0/empty.

    Example:
        >>> debug_requested({}), debug_requested({"DEBUG": "1"}), debug_requested({"TORCHMEM_DEBUG": "0"})
        (False, True, False)
    """
    env = os.environ if environ is None else environ
    for key in ("TORCHMEM_DEBUG", "DEBUG"):
        value = env.get(key, "").strip().lower()
        if value not in ("", "0", "false", "no", "off"):
            return True
    return False


class ColorFormatter(logging.Formatter):
    """``[torchmem.ledger] DEBUG message`` with the level coloured by ANSI codes when ``color``.

    Example:
        >>> rec = logging.LogRecord("torchmem.ledger", logging.INFO, "f.py", 1, "hi", None, None)
        >>> ColorFormatter(color=False).format(rec)
        '[torchmem.ledger] INFO hi'
        >>> ColorFormatter(color=True).format(rec)
        '[torchmem.ledger] \\x1b[32mINFO\\x1b[0m hi'
    """

    def __init__(self, color: bool) -> None:
        super().__init__()
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname
        if self.color:
            level = f"{_COLORS.get(record.levelno, '')}{level}{_RESET}"
        msg = f"[{record.name}] {level} {record.getMessage()}"
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return msg


def _make_handler(stream: IO[str]) -> logging.Handler:
    tty = bool(getattr(stream, "isatty", lambda: False)())
    if tty:
        try:
            from rich.console import Console
            from rich.highlighter import NullHighlighter
            from rich.logging import RichHandler

            rich_handler = RichHandler(
                console=Console(file=stream), show_path=False, markup=False,
                highlighter=NullHighlighter(),
            )
            rich_handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            return rich_handler
        except Exception:  # pragma: no cover - rich is a core dependency
            pass
    handler = logging.StreamHandler(stream)
    handler.setFormatter(ColorFormatter(color=tty))
    return handler


def setup_debug_logging(stream: Optional[IO[str]] = None, *, force: bool = False) -> bool:
    """Attach torchmem's debug handler if debug was requested (or ``force``); True if attached.

    Called by :func:`get_logger`; idempotent (one handler at most).

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> setup_debug_logging(buf, force=True)
        True
        >>> get_logger("demo").debug("x=%d", 3); "[torchmem.demo] DEBUG x=3" in buf.getvalue()
        True
        >>> remove_debug_logging()
    """
    global _configured
    if not force and not debug_requested():
        return False
    root = logging.getLogger(ROOT)
    for h in list(root.handlers):
        if getattr(h, _HANDLER_FLAG, False):
            root.removeHandler(h)
    handler = _make_handler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_FLAG, True)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    _configured = True
    return True


def remove_debug_logging() -> None:
    """Detach the handler added by :func:`setup_debug_logging` and reset the level.

    Example:
        >>> remove_debug_logging()
    """
    root = logging.getLogger(ROOT)
    for h in list(root.handlers):
        if getattr(h, _HANDLER_FLAG, False):
            root.removeHandler(h)
    root.setLevel(logging.NOTSET)


def get_logger(name: str = "") -> logging.Logger:
    """The ``torchmem`` logger or a child (``get_logger("ledger")`` -> ``torchmem.ledger``).

    Example:
        >>> get_logger().name, get_logger("devices").name
        ('torchmem', 'torchmem.devices')
    """
    global _configured
    if not _configured:
        _configured = True
        setup_debug_logging()
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)
