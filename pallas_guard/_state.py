"""What the front door injected on a kernel's behalf, so the lowering net does not record it twice."""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
_injected: weakref.WeakSet[Any] = weakref.WeakSet()
_injected_ids: set[int] = set()  # values that take no weak reference


def mark_injected(value: Any) -> None:
    with _lock:
        try:
            _injected.add(value)
        except TypeError:
            _injected_ids.add(id(value))


def is_injected(value: Any) -> bool:
    if not value or value is True:
        return False
    try:
        return value in _injected
    except TypeError:
        return id(value) in _injected_ids


def interpreter_name(value: Any) -> str | None:
    """A short name for an ``interpret=`` value, for records."""
    if not value:
        return None
    if value is True:
        return "plain"
    module = type(value).__module__
    if "mosaic_gpu" in module:
        return "gpu"
    if "mosaic" in module:
        return "tpu"
    return type(value).__name__
