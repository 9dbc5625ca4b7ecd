"""State the two layers share: what the front door injected on a kernel's behalf (the lowering
net does not record it twice), and whether the front door is verifying an interpreter."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
# By identity: InterpretParams are dataclasses that compare equal by value, and a user's own
# ``pltpu.InterpretParams()`` equal to one the front door injected is still the user's.
_injected: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_injected_ids: set[int] = set()  # values that take no weak reference


def mark_injected(value: Any) -> None:
    with _lock:
        try:
            _injected[id(value)] = value
        except TypeError:
            _injected_ids.add(id(value))


def is_injected(value: Any) -> bool:
    if not value or value is True:
        return False
    return _injected.get(id(value)) is value or id(value) in _injected_ids


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


# Set while the front door verifies an interpreter with a trial lowering: the net stays out of it.
_verifying: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_guard_verifying", default=False)


def verifying() -> bool:
    return _verifying.get()


@contextlib.contextmanager
def verification() -> Iterator[None]:
    token = _verifying.set(True)
    try:
        yield
    finally:
        _verifying.reset(token)


# defined_at -> what the front door verified before leaving a kernel to the net's plain
# interpreter, so the net's record says it too. Bounded: one entry per kernel definition.
_verified: dict[str, tuple[str, ...]] = {}


def note_verified(defined_at: str | None, tried: tuple[str, ...]) -> None:
    if defined_at is not None and len(_verified) < 4096:
        _verified[defined_at] = tried


def verified(defined_at: str | None) -> tuple[str, ...]:
    return _verified.get(defined_at or "", ())
