"""The guard's plain interpretation: JAX's plain interpreter, linear in the data.

JAX's plain interpreter runs the grid in one ``while_loop`` whose carry holds every block operand,
and at each step writes every block back into its carried operand, read-only ones included; XLA
copies the whole operand for each such write, so a kernel costs time quadratic in its data. While
the lowering net lowers (or the engine traces) the plain interpreter inside :func:`linear`, the
write-back of a block of an operand the kernel never writes (no write or accumulate effect on its
ref) gives back the carried operand unchanged. That write would have put back the very block just
read from the same carried array at the same start, so the values are the same; and each skipped
operand is presented to XLA as JAX's loop presents it (loop-invariant where its block never moves,
loop-variant behind an optimization barrier where it does), so that XLA compiles the kernel's own
arithmetic as it does in JAX's loop and the result is the same bit for bit; aliased
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
    still: frozenset[int]
    """The block operands whose block index is the same at every grid step."""
    calls: Iterator[int] = dataclasses.field(default_factory=itertools.count)


_skipping: contextvars.ContextVar[_Skipping | None] = contextvars.ContextVar("pallas_guard_plain", default=None)
_hooking = threading.Lock()


EXACT_FROM = (0, 8)
"""The first jax release whose XLA gives JAX's bits with the write-backs left out, on every kernel
the tests compare (``tests/test_fast_plain.py``: the corpus and the guard's own kernels, measured in
0.8.3, 0.9.2, 0.10.2, 0.11.2 and 0.12.0.1). jax 0.7.2's XLA rounds the layer-norm and RMS-norm
backward kernels differently once any write-back is left out (bare or behind a barrier): there the
plain interpreter runs as JAX ships it, correct before fast."""


def enabled() -> bool:
    """The setting is on, and this jax is one where the fast path is bit for bit."""
    release = _internals.jax_release()
    return bool(_settings.current("fast_plain").value) and (not release or release >= EXACT_FROM)


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
        operand = next(skipping.calls) % skipping.blocks if skipping is not None else None
        if skipping is None or operand in skipping.written:
            return write_back(start, block_shape, value, update, *rest)
        # The operand is presented to XLA as JAX's loop presents it, so that XLA compiles the body
        # the same way (its arithmetic, fused otherwise, rounds otherwise): the write-back of a
        # block at the same index every step is folded away by XLA in JAX's loop too (the operand
        # is loop-invariant there); a moving block's write-back keeps the operand loop-variant,
        # which an optimization barrier does here without the copy.
        if operand in skipping.still:
            return value
        from jax import lax

        return lax.optimization_barrier(value)  # type: ignore[no-untyped-call]

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
            state = _Skipping(blocks, written, _still_blocks(params))
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


def _still_blocks(params: Mapping[str, Any]) -> frozenset[int]:
    """The block operands whose index map returns the same block at every grid step: no output
    of its jaxpr depends on its inputs (the grid indices, scalar prefetch)."""
    still = set()
    for position, mapping in enumerate(getattr(params.get("grid_mapping"), "block_mappings", None) or ()):
        closed = getattr(mapping, "index_map_jaxpr", None)
        jaxpr: Any = getattr(closed, "jaxpr", closed)
        if not hasattr(jaxpr, "eqns"):
            continue  # unknown: treated as moving (the barrier), JAX's loop-variant operand
        moving = set(jaxpr.invars)
        for eqn in jaxpr.eqns:
            if any(var in moving for var in eqn.invars if not _is_literal(var)):
                moving.update(eqn.outvars)
        if not any(var in moving for var in jaxpr.outvars if not _is_literal(var)):
            still.add(position)
    return frozenset(still)


def _is_literal(var: Any) -> bool:
    return hasattr(var, "val")  # a jaxpr Literal: a constant, never an input
