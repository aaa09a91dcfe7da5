"""gpufeed's loggers.

File names need not be UTF-8: on Linux they are bytes, and Python keeps the bytes it can't decode as
surrogates. A message naming such a file can't be written by a handler with a strict encoding (a
`logging.FileHandler` opened with the default `errors`, a pipe under `PYTHONIOENCODING=utf-8`):
logging prints "--- Logging error ---" and loses the message. gpufeed's messages carry those
characters as backslash escapes instead (``caf\\udce9.jpg``), as the decode workers' reasons do.
"""

from __future__ import annotations

import logging


class _EscapeNames(logging.Filter):
    """Rewrites a record whose message holds surrogates into the same text with them escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
        if safe != text:
            record.msg, record.args = safe, None
        return True


_ESCAPE = _EscapeNames()


def logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` with the escape above (a logger's filters don't reach its children,
    so each module's logger gets it)."""
    log = logging.getLogger(name)
    if _ESCAPE not in log.filters:
        log.addFilter(_ESCAPE)
    return log
