"""Process state shared by the layers: whether the guard is active, and what the guard injected."""

from __future__ import annotations

import _thread

# Only the type checker needs these (see pallas_guard/__init__.py): this module loads at start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import weakref
    from typing import Any

_active = False
_lock = _thread.allocate_lock()  # threading's Lock; `import threading` costs more
# Interpreter objects the front door passed on a kernel's behalf, so the net does not record twice.
# Created on first use (after jax.experimental.pallas is imported), keeping weakref off start-up.
_injected: weakref.WeakSet[Any] | None = None
_injected_ids: set[int] = set()


def active() -> bool:
    return _active


def set_active(value: bool) -> None:
    global _active  # noqa: PLW0603 - the one switch the wrappers and rules read
    _active = value


def mark_injected(value: Any) -> None:
    global _injected  # noqa: PLW0603
    with _lock:
        if _injected is None:
            import weakref

            _injected = weakref.WeakSet()
        try:
            _injected.add(value)
        except TypeError:
            _injected_ids.add(id(value))


def is_injected(value: Any) -> bool:
    if not value or value is True:
        return False
    try:
        return _injected is not None and value in _injected
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
