"""One JSON object per line on standard error: operational events and alert lines alike."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}


class JsonLog:
    """Writes ``{"ts", "level", "event", ...}`` lines; thread-safe, flushed per line."""

    def __init__(self, stream: TextIO | None = None, level: str = "INFO") -> None:
        self.stream = stream
        self.threshold = LEVELS.get(level.upper(), 20)
        self._lock = threading.Lock()

    def enabled(self, level: str) -> bool:
        return LEVELS[level] >= self.threshold

    def write(self, level: str, event: str, *, force: bool = False, **fields: Any) -> None:
        if not force and not self.enabled(level):
            return
        line = json.dumps(
            {"ts": round(time.time(), 6), "level": level.lower(), "event": event, **fields},
            default=str,
            ensure_ascii=False,
            separators=(",", ":"),
        )
        stream = self.stream or sys.stderr
        with self._lock:
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):
                pass

    def debug(self, event: str, **fields: Any) -> None:
        self.write("DEBUG", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self.write("INFO", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.write("WARNING", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.write("ERROR", event, **fields)
