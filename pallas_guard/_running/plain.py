"""The guard's plain interpretation: JAX's plain interpreter, linear in the data.

JAX's plain interpreter runs the grid in one ``while_loop`` whose carry holds every block operand,
and at each step writes every block back into its carried operand, read-only ones included; XLA
copies the whole operand for each such write, so a kernel costs time quadratic in its data. While
the lowering net lowers (or the engine traces) the plain interpreter inside :func:`linear`, the
write-back of a block of an operand the kernel never writes (no write or accumulate effect on its
ref) gives back the carried operand unchanged. That write would have put back the very block just
read from the same carried array at the same start, so the values are the same; and each skipped
operand is presented to XLA as JAX's loop presents it (loop-invariant where its block is the whole
operand, loop-variant behind an optimization barrier otherwise), so that XLA compiles the kernel's
own arithmetic as it does in JAX's loop and the result is the same bit for bit; where the loop
would then move too few bytes per step for XLA to compile it as it compiles JAX's
(``SMALL_LOOP_BYTES``), nothing is left out. An aliased input/output pair that JAX's loop keeps
in step by assigning one carried array to the other (a whole copy per step) is carried once
(:class:`_SharingLoops`). Both wrappers act only inside :func:`linear`; elsewhere, and with the
``fast_plain`` setting off, JAX's interpreter runs as it ships.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.patch import wrap


@dataclasses.dataclass(frozen=True)
class _Skipping:
    """The block operands of the kernel being interpreted, and which of them it writes."""

    blocks: int
    written: frozenset[int]
    aliased: tuple[tuple[int, int], ...]
    """Each aliased pair as (input, output) positions among the block operands."""
    calls: Iterator[int] = dataclasses.field(default_factory=itertools.count)


_skipping: contextvars.ContextVar[_Skipping | None] = contextvars.ContextVar("pallas_guard_plain", default=None)
_hooking = threading.Lock()


EXACT_FROM = (0, 8)
"""The first jax release whose XLA gives JAX's bits with the write-backs left out, on every kernel
the tests compare (``tests/test_fast_plain.py``: the corpus and the guard's own kernels, measured in
0.8.3, 0.9.2, 0.10.2, 0.11.2 and 0.12.0.1). jax 0.7.2's XLA rounds the layer-norm and RMS-norm
backward kernels differently once any write-back is left out (bare or behind a barrier): there the
plain interpreter runs as JAX ships it, correct before fast."""


SMALL_LOOP_BYTES = 1024
"""The most bytes one grid step may move for XLA's CPU compiler to compile the grid loop as one
"small" call (another code generator, which rounds a kernel's arithmetic otherwise), in the jax
releases where a threshold applies (0.8.3 to 0.11.2 measured: 1 KiB at most); from
``EVERY_LOOP_SMALL_FROM`` every loop is compiled that way. Leaving write-backs out moves fewer bytes
per step, so a loop JAX's interpreter makes large can become small: the guard leaves them out only
where the blocks still written back move twice this much per step, above it in both loops."""

EVERY_LOOP_SMALL_FROM = (0, 12)
"""The first jax release whose XLA compiles every grid loop as one small call (blocks of 16 MiB
measured), JAX's and the guard's alike: no step is too small for the fast path there."""

_THRESHOLD_FLAG = re.compile(r"xla_cpu_small_while_loop_byte_threshold=(-?\d+)")


def enabled() -> bool:
    """The setting is on, and this jax is one where the fast path is bit for bit."""
    release = jax_lookup.jax_release()
    return bool(_settings.current("fast_plain").value) and (not release or release >= EXACT_FROM)


def hook(hooks: list[Any]) -> None:
    """Wrap the interpreter's write-back and its grid loop once (the wrappers are idle outside
    :func:`linear`); the entries added to ``hooks`` put them back."""
    with _hooking:
        module = jax_pallas.hlo_interpreter_module()
        wrap(module, jax_pallas.WRITE_BACK, _skipping_write_back, hooks, is_ours=_is_ours)
        wrap(module, jax_pallas.GRID_LOOPS, _SharingLoops, hooks, is_ours=_is_ours, usable=_has_grid_loop)


def _has_grid_loop(loops: Any) -> bool:
    return callable(getattr(loops, "while_loop", None))


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
        # the same way (its arithmetic, fused otherwise, rounds otherwise). Only a block that is the
        # whole (padded) operand has its write-back folded away by XLA in JAX's loop (its slice and
        # its update are the operand itself, wherever the index map points), leaving the operand
        # loop-invariant; any smaller block's write-back keeps the operand loop-variant, even at the
        # same index every step, which an optimization barrier does here without the copy.
        if tuple(value.shape) == tuple(block_shape):
            return value
        from jax import lax

        return lax.optimization_barrier(value)  # type: ignore[no-untyped-call]

    pallas_guard_write_back.pallas_guard_plain = True  # type: ignore[attr-defined]
    return pallas_guard_write_back


class _NotShared(Exception):
    """The traced grid step left an aliased pair's operands apart: the loop is traced again as JAX
    wrote it."""


class _SharingLoops:
    """The plain interpreter's view of JAX's loops module, whose grid loop carries each aliased pair
    once. Where JAX keeps an aliased input and output in step (each grid step assigns one carried
    array to the other, so that both see every write), the loop carries the same array in two places
    and XLA copies it whole at every step. Inside :func:`linear`, where the two start as one array
    and every traced step leaves them as one, the loop carries it once and hands it to the step in
    both places: the same values, without the copy. Anything else runs JAX's loop as it is."""

    pallas_guard_plain = True

    def __init__(self, loops: Any) -> None:
        self._loops = loops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loops, name)

    def while_loop(self, cond_fun: Callable[..., Any], body_fun: Callable[..., Any], init_val: Any) -> Any:
        skipping = _skipping.get()
        carried = list(init_val) if isinstance(init_val, tuple) else []
        # The interpreter's grid carry: (step, grid indices, *block operands, *scratch).
        shared = {
            2 + into: 2 + out
            for into, out in (skipping.aliased if skipping is not None else ())
            if 2 + out < len(carried) and carried[2 + into] is carried[2 + out]
        }
        if not shared:
            return self._loops.while_loop(cond_fun, body_fun, init_val)
        kept = [position for position in range(len(carried)) if position not in shared]

        def widen(narrow: Any) -> tuple[Any, ...]:
            full = dict(zip(kept, narrow, strict=True))
            full.update({into: full[out] for into, out in shared.items()})
            return tuple(full[position] for position in range(len(carried)))

        def step(narrow: Any) -> tuple[Any, ...]:
            stepped = body_fun(widen(narrow))
            if any(stepped[into] is not stepped[out] for into, out in shared.items()):
                raise _NotShared
            return tuple(stepped[position] for position in kept)

        try:
            narrow = self._loops.while_loop(
                lambda narrow: cond_fun(widen(narrow)), step, tuple(carried[position] for position in kept)
            )
        except _NotShared:
            return self._loops.while_loop(cond_fun, body_fun, init_val)
        return widen(narrow)


@contextlib.contextmanager
def linear(params: Mapping[str, Any]) -> Iterator[None]:
    """Inside: JAX's plain interpreter, traced for the ``pallas_call`` with ``params``, leaves the
    blocks the kernel never writes where they are. JAX's interpreter unchanged where the setting is
    off, the write-back is not wrapped, or which refs the kernel writes cannot be told."""
    state = None
    if enabled() and _is_ours(getattr(jax_pallas.hlo_interpreter_module(), jax_pallas.WRITE_BACK, None)):
        written = jax_pallas.written_blocks(params)
        blocks = len(getattr(params.get("grid_mapping"), "block_mappings", None) or ())
        aliased = _aliased_blocks(params, blocks)
        if written is not None and blocks and (len(written) < blocks or aliased) and _stays_large(params, written):
            state = _Skipping(blocks, written, aliased)
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


def _aliased_blocks(params: Mapping[str, Any], blocks: int) -> tuple[tuple[int, int], ...]:
    """The aliased pairs as (input, output) positions among the block operands: an input counts
    the operands after the scalar prefetch, an output those after the inputs."""
    mapping = params.get("grid_mapping")
    first = getattr(mapping, "num_index_operands", None)
    outputs = getattr(mapping, "num_outputs", None)
    if not isinstance(first, int) or not isinstance(outputs, int):
        return ()
    pairs = tuple(params.get("input_output_aliases") or ())
    return tuple((into - first, blocks - outputs + out) for into, out in pairs if 0 <= into - first < blocks - outputs)


def _stays_large(params: Mapping[str, Any], written: frozenset[int]) -> bool:
    """The grid loop is compiled as JAX's is, small or not (``SMALL_LOOP_BYTES``): every loop is
    small in this jax, or the blocks the kernel writes (written back in both loops) move enough bytes
    per step to keep both large. An unknown block size counts as too small."""
    flag = _THRESHOLD_FLAG.search(os.environ.get("XLA_FLAGS", ""))
    if flag is not None:
        threshold = int(flag.group(1))
    else:
        release = jax_lookup.jax_release()
        if release and release >= EVERY_LOOP_SMALL_FROM:
            return True
        threshold = SMALL_LOOP_BYTES
    if threshold <= 0:
        return True  # no loop is small
    mappings = getattr(params.get("grid_mapping"), "block_mappings", None) or ()
    moved = 0
    for position in written:
        aval = jax_pallas.block_aval(mappings[position])
        itemsize = getattr(getattr(aval, "dtype", None), "itemsize", None)
        shape = getattr(aval, "shape", None)
        if not isinstance(itemsize, int) or shape is None:
            return False
        moved += math.prod(shape) * itemsize
    return moved >= 2 * threshold
