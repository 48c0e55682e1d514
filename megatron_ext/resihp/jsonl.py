"""JSON-lines writer shared by the trace and the verdict log: one object per line, flushed at once
so a crashed run keeps everything written before the crash."""
from __future__ import annotations

import io
import json
import os
import threading
from typing import Any


class JsonLinesWriter:
    """Writes objects with a ``to_json()`` method. ``mode`` "w" starts the file, "a" appends."""

    def __init__(self, path: str | os.PathLike | io.TextIOBase, mode: str = "w"):
        if isinstance(path, io.TextIOBase):
            self._fh, self._owned = path, False
        else:
            parent = os.path.dirname(os.fspath(path))
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._fh, self._owned = open(path, mode, encoding="utf-8"), True
        # A lost rank's verdict is written from the liveness monitor's thread, beside the main one's.
        self._lock = threading.Lock()

    def write(self, item: Any) -> None:
        self.write_text(item.to_json())

    def write_line(self, obj: dict[str, Any]) -> None:
        """A plain JSON object (e.g. a re-layout plan beside the verdicts)."""
        self.write_text(json.dumps(obj))

    def write_text(self, line: str) -> None:
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._owned:
            self._fh.close()

    def __enter__(self) -> "JsonLinesWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
