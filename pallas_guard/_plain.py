"""The guard's plain interpretation: JAX's plain interpreter, linear in the data.

JAX's plain interpreter runs the grid in one ``while_loop`` whose carry holds every block operand,
and at each step writes every block back into its carried operand, read-only ones included; XLA
copies the whole operand for each such write, so a kernel costs time quadratic in its data. While
the lowering net lowers (or the engine traces) the plain interpreter inside :func:`linear`, the
write-back of a block of an operand the kernel never writes (no write or accumulate effect on its
ref) gives back the carried operand unchanged. That write would have put back the very block just
read from the same carried array at the same start, so the result is the same bit for bit; aliased
pairs are synchronised after the write-backs, as before. The write-back wrapper acts only inside
:func:`linear`; elsewhere, and with the ``fast_plain`` setting off, JAX's interpreter runs as it
ships.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import _internals, _settings
from ._patch import Patch


@dataclasses.dataclass(frozen=True)
class _Skipping:
    """The block operands of the kernel being interpreted, and which of them it writes."""

    blocks: int
    written: frozenset[int]
    calls: Iterator[int] = dataclasses.field(default_factory=itertools.count)


_skipping: contextvars.ContextVar[_Skipping | None] = contextvars.ContextVar("pallas_guard_plain", default=None)
_hooking = threading.Lock()


def enabled() -> bool:
    return bool(_settings.current("fast_plain").value)


def hook(hooks: list[Any]) -> None:
    """Wrap the interpreter's write-back once (the wrapper is idle outside :func:`linear`); the
    entry added to ``hooks`` puts it back."""
    with _hooking:
        module = _internals.hlo_interpreter_module()
        write_back = getattr(module, _internals.WRITE_BACK, None)
        if module is None or not callable(write_back) or _is_ours(write_back):
            return
        wrapper = _skipping_write_back(write_back)
        setattr(module, _internals.WRITE_BACK, wrapper)
        hooks.append(Patch(module, _internals.WRITE_BACK, write_back, wrapper))


def _is_ours(function: Any) -> bool:
    return getattr(function, "pallas_guard_plain", False) is True


def _skipping_write_back(write_back: Callable[..., Any]) -> Callable[..., Any]:
    def pallas_guard_write_back(start: Any, block_shape: Any, value: Any, update: Any, *rest: Any) -> Any:
        skipping = _skipping.get()
        # One call per block operand, in order, each time the loop body is traced.
        if skipping is not None and next(skipping.calls) % skipping.blocks not in skipping.written:
            return value
        return write_back(start, block_shape, value, update, *rest)

    pallas_guard_write_back.pallas_guard_plain = True  # type: ignore[attr-defined]
    return pallas_guard_write_back


@contextlib.contextmanager
def linear(params: Mapping[str, Any]) -> Iterator[None]:
    """Inside: JAX's plain interpreter, traced for the ``pallas_call`` with ``params``, leaves the
    blocks the kernel never writes where they are. JAX's interpreter unchanged where the setting is
    off, the write-back is not wrapped, or which refs the kernel writes cannot be told."""
    state = None
    if enabled() and _is_ours(getattr(_internals.hlo_interpreter_module(), _internals.WRITE_BACK, None)):
        written = _internals.written_blocks(params)
        blocks = len(getattr(params.get("grid_mapping"), "block_mappings", None) or ())
        if written is not None and blocks and len(written) < blocks:
            state = _Skipping(blocks, written)
    token = _skipping.set(state)
    try:
        yield
    finally:
        _skipping.reset(token)


def interpreting(rule: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's lowering rule for ``pallas_call_p``, for ``interpret=True``: the plain interpreter,
    linear in the data. One interpreter trace per :func:`linear` block, which counts the write-backs
    of one trace (a failed lowering retried must not inherit the count)."""

    def interpret_plain(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
        with linear(params):
            return rule(ctx, *in_nodes, **params)

    return interpret_plain
