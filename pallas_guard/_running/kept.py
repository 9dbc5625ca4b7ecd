"""Compiles kept on disk between runs: one JSON file per kernel lowering, compiler and target, in
``$XDG_CACHE_HOME/pallas_guard/<kind>`` (else ``~/.cache/...``). Delete the folder to compile
everything again."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any


def folder(kind: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallas_guard", kind)


def file_for(kind: str, *parts: str | bytes) -> str:
    """The file kept for what ``parts`` (versions, flags, target, the lowering's text) identify."""
    digest = hashlib.sha256(b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)).hexdigest()
    return os.path.join(folder(kind), f"{digest}.json")


def read(path: str | None) -> Any | None:
    """What was kept at ``path``; None where nothing was, or it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):  # absent, unreadable or damaged: compiled again
        return None


def write(path: str | None, fields: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Written whole, then renamed: a reader in another process sees all of it or nothing.
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(fields, file)
        os.replace(temporary, path)
    except OSError:  # a read-only home: the compile is not kept, nothing else changes
        pass
