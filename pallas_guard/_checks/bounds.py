"""The bounds check on the plain interpreter: an index check at every access, at its speed.

The plain interpreter turns a kernel into XLA operations: each ref access is discharged to a
``dynamic_slice``/``dynamic_update_slice`` (or a gather/scatter), and each grid step copies blocks
in and out the same way; all of them clamp an out-of-range index silently. While the lowering net
lowers a kernel in the plain interpreter with ``bounds`` in force, the discharge rules of the access
primitives (wrapped while the guard is installed, acting only then) put a check before each access:
its element range against the buffer it indexes, element by element where the access is masked
(masked-off elements are never findings). The block copies get the same check (an index map or
scalar-prefetch value that points outside its array). The first check that fails calls back to the
host (``checked_plain.check_vector``), which raises it as ``PallasGuardError``. The checks read
indices and change no value: a kernel without a finding returns what the unchecked plain interpreter
returns, bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pallas_guard._checks import on_numbers
from pallas_guard._checks import protocol as _checks
from pallas_guard._checks.checked_plain import (
    NO_SITE,
    Active,
    Condition,
    Index,
    PlainLowering,
    Range,
    TableEntry,
    as_index,
    check_vector,
    compose,
    indexed,
    plus,
    site_text,
    traced,
)
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state
from pallas_guard._running import findings as _findings
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard._vocabulary.patch import wrap

if TYPE_CHECKING:
    from pallas_guard._guard.engine import Run


@dataclasses.dataclass(frozen=True)
class _Checking:
    """What the checks of one kernel's lowering need beyond the access itself."""

    blocks: tuple[tuple[tuple[int, ...], tuple[int, ...], str, str | None], ...]
    """(block shape, array shape, name, index map's ``file:line``) of each block-specified operand,
    to name a block copy."""
    grid_mapping: Any
    copies: Iterator[int] = dataclasses.field(default_factory=itertools.count)
    step: list[Any] = dataclasses.field(default_factory=list)
    """The program ids of the grid step whose blocks are being copied (set as the interpreter
    computes where they start)."""
    discharging: list[int] = dataclasses.field(default_factory=lambda: [0])
    """How many jaxprs are being discharged, one inside the other: 1 at the kernel's top level."""
    spans: dict[int, tuple[tuple[int, int], ...] | None] = dataclasses.field(default_factory=dict)
    """Each block mapping's span over the grid (``_span``), by ``id``, once computed."""
    known: dict[int, tuple[Any, tuple[tuple[int, int], ...]]] = dataclasses.field(default_factory=dict)
    """The starts the trace computed whose span is known: ``id`` -> (the starts, their span)."""

    def span(self, mapping: Any) -> tuple[tuple[int, int], ...] | None:
        if id(mapping) not in self.spans:
            self.spans[id(mapping)] = _span(mapping, getattr(self.grid_mapping, "grid", None))
        return self.spans[id(mapping)]


_checking: contextvars.ContextVar[_Checking | None] = contextvars.ContextVar("pallas_guard_bounds", default=None)


@contextlib.contextmanager
def _checking_in(state: _Checking) -> Iterator[None]:
    """The discharge rules check accesses against ``state`` while the checked interpreter is traced."""
    token = _checking.set(state)
    try:
        yield
    finally:
        _checking.reset(token)
        state.step.clear()  # tracers of this trace, which ends here
        state.known.clear()


# --- hooks: JAX's discharge rules and the interpreter's block copies, checking only when asked ---


_hooking = threading.Lock()


def hook(hooks: list[Any]) -> None:
    """Wrap what is not wrapped yet (modules imported since the last call bring new primitives);
    each of ``hooks`` puts one back (``restore()``)."""
    with _hooking:
        for registry in jax_state.discharge_registries():
            for access in jax_state.ref_accesses():
                rule = registry.rules.get(access.primitive)
                if rule is not None and not _is_ours(rule):
                    wrapper = _checking_rule(rule, access, registry.leading)
                    registry.rules[access.primitive] = wrapper
                    hooks.append(TableEntry(registry.rules, access.primitive, rule, wrapper))
            _inline_run_state(registry, hooks)
        wrap(jax_pallas.block_mapping_class(), jax_pallas.BLOCK_START, _recording_step, hooks, is_ours=_is_ours)
        discharge = jax_state.state_discharge_module()
        wrap(discharge, jax_state.DISCHARGE_EVALUATOR, _counting_levels, hooks, is_ours=_is_ours)
        module = jax_pallas.hlo_interpreter_module()
        wrap(module, jax_pallas.BLOCK_COPY, _checking_block_copy, hooks, is_ours=_is_ours)


def _inline_run_state(registry: jax_state.DischargeRegistry, hooks: list[Any]) -> None:
    """A ``pl.run_state`` body is discharged where the kernel is, while its accesses are checked:
    JAX's rule binds ``run_state`` again, whose body is discharged only when that lowers, after the
    checks' trace; evaluated in place (what that lowering emits, inline), its accesses get theirs."""
    evaluation = jax_state.run_state_evaluation()
    if evaluation is None or registry.leading not in (1, 2):  # before 0.9: a partial rule, its gap noted
        return
    primitive, evaluate = evaluation
    rule = registry.rules.get(primitive)
    if rule is None or _is_ours(rule):
        return

    def pallas_guard_run_state_in_place(*args: Any, **params: Any) -> Any:
        if _checking.get() is None or not all(params.get("is_initialized", ())):
            return rule(*args, **params)
        leading, operands = args[: registry.leading], args[registry.leading :]
        if registry.leading == 1:  # a DischargeContext
            discharged = list(leading[0].should_discharge)
            strip = bool(getattr(leading[0], "strip_memory_space", False))
        else:  # in_avals, out_avals
            discharged, strip = [type(aval).__name__ == "AbstractRef" for aval in leading[0]], False
        outputs = evaluate(strip, *operands, **params)
        return [out if ref else None for ref, out in zip(discharged, outputs, strict=True)], outputs

    pallas_guard_run_state_in_place.pallas_guard_checking = True  # type: ignore[attr-defined]
    registry.rules[primitive] = pallas_guard_run_state_in_place
    hooks.append(TableEntry(registry.rules, primitive, rule, pallas_guard_run_state_in_place))


def _run_state_checked() -> bool:
    """Whether accesses in ``pl.run_state`` bodies are checked with this jax."""
    evaluation = jax_state.run_state_evaluation()
    return evaluation is not None and any(
        _is_ours(registry.rules.get(evaluation[0])) for registry in jax_state.discharge_registries()
    )


def _is_ours(function: Any) -> bool:
    return getattr(function, "pallas_guard_checking", False) is True


def _checking_rule(rule: Callable[..., Any], access: jax_state.RefAccess, leading: int) -> Callable[..., Any]:
    def pallas_guard_checked_discharge(*args: Any, **params: Any) -> Any:
        checking = _checking.get()
        if checking is not None:
            _check_access(checking, access, args[leading:], params)
        return rule(*args, **params)

    pallas_guard_checked_discharge.pallas_guard_checking = True  # type: ignore[attr-defined]
    return pallas_guard_checked_discharge


def _counting_levels(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    def pallas_guard_discharge_level(*args: Any, **kwargs: Any) -> Any:
        checking = _checking.get()
        if checking is None:
            return evaluate(*args, **kwargs)
        checking.discharging[0] += 1
        try:
            return evaluate(*args, **kwargs)
        finally:
            checking.discharging[0] -= 1

    pallas_guard_discharge_level.pallas_guard_checking = True  # type: ignore[attr-defined]
    return pallas_guard_discharge_level


def _recording_step(start: Callable[..., Any]) -> Callable[..., Any]:
    def pallas_guard_block_start(self: Any, loop_idx: Any, *args: Any) -> Any:
        checking = _checking.get()
        if checking is None:
            return start(self, loop_idx, *args)
        vmapped = getattr(checking.grid_mapping, "vmapped_dims", None) or ()
        checking.step[:] = [index for axis, index in enumerate(loop_idx) if axis not in vmapped]
        starts = start(self, loop_idx, *args)
        span = checking.span(self)
        if span is not None:  # the copy of this block is checked against it, while tracing
            checking.known[id(starts)] = (starts, span)
        return starts

    pallas_guard_block_start.pallas_guard_checking = True  # type: ignore[attr-defined]
    return pallas_guard_block_start


def _checking_block_copy(copy: Callable[..., Any]) -> Callable[..., Any]:
    def pallas_guard_checked_block_copy(start: Any, block_shape: Any, value: Any, *rest: Any) -> Any:
        checking = _checking.get()
        if checking is not None:
            _check_block(checking, start, tuple(block_shape), value)
        return copy(start, block_shape, value, *rest)

    pallas_guard_checked_block_copy.pallas_guard_checking = True  # type: ignore[attr-defined]
    return pallas_guard_checked_block_copy


def _blocks(grid_mapping: Any) -> tuple[tuple[tuple[int, ...], tuple[int, ...], str, str | None], ...]:
    found = []
    for mapping in getattr(grid_mapping, "block_mappings", ()) or ():
        array = getattr(mapping, "array_shape_dtype", None) or getattr(mapping, "array_aval", None)
        shape = tuple(getattr(array, "shape", ()))
        block = tuple(_block_size(b) for b in getattr(mapping, "block_shape", ()))
        _, index_map = _diagnostics.traced_function(getattr(mapping, "index_map_jaxpr", None))
        found.append((block, shape, str(getattr(mapping, "origin", "") or ""), index_map))
    return tuple(found)


def _block_size(dim: Any) -> int:
    if isinstance(dim, int):
        return dim
    size = getattr(dim, "block_size", None)
    return size if isinstance(size, int) else 1


# --- the checks -----------------------------------------------------------------------------------


def _check_access(
    checking: _Checking, access: jax_state.RefAccess, operands_flat: Sequence[Any], params: dict[str, Any]
) -> None:
    import jax

    tree = params.get(access.tree_param)
    if tree is None:
        return
    flat = list(operands_flat)
    if access.leading:
        operands: tuple[Any, ...] = (flat[0], jax.tree_util.tree_unflatten(tree, flat[access.leading :]))
    else:
        operands = tuple(jax.tree_util.tree_unflatten(tree, flat))
    mask = operands[access.mask_at] if access.mask_at is not None and len(operands) > access.mask_at else None
    site = _site()
    # Bound here, in the discharged kernel, they are the program ids of whichever step evaluates it
    # (bound only for an access that gets a check). Only at the kernel's top level: inside a loop,
    # branch or scope body, JAX's plain interpreter cannot evaluate a program id (it lowers none).
    top_level = checking.discharging[0] == 1
    step = functools.partial(jax_pallas.program_ids, checking.grid_mapping) if top_level else _no_step
    for role, ref, transforms in indexed(operands):
        if access.kind == "copy":  # a DMA: source, destination, then semaphores
            kind = ("DMA read", "DMA write")[role] if role < 2 else "semaphore access"
        else:
            kind = access.kind
        _check_indexed(kind, ref, transforms, mask if role == 0 else None, site, step=step)


def _site() -> str:
    """Where the kernel makes the access being discharged: ``at file:line (`code`)``."""
    text = site_text()
    return text if text == NO_SITE else f"at {text}"


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _check_indexed(kind: str, ref: Any, transforms: tuple[Any, ...], mask: Any, site: str, *, step: _Step) -> None:
    """Check one access through ``transforms``: composed into element ranges of the buffer where
    they are slices and integers (a view may overhang where the elements read do not), one
    indexer at a time otherwise."""
    indexer_class = jax_state.nd_indexer_class()
    indexers = [t for t in transforms if indexer_class is not None and isinstance(t, indexer_class)]
    if not indexers:
        return
    dtype = str(getattr(ref, "dtype", "")) or "?"
    composed = compose(indexers) if len(indexers) == len(transforms) else None
    if composed is not None:
        _check_ranges(kind, composed, tuple(indexers[0].shape), dtype=dtype, mask=mask, site=site, step=step)
        return
    for position, indexer in enumerate(indexers):
        last = position == len(indexers) - 1
        single = compose([indexer])
        if single is not None:
            masked = mask if last else None
            _check_ranges(kind, single, tuple(indexer.shape), dtype=dtype, mask=masked, site=site, step=step)
        elif mask is None or not last:
            _check_gather(kind, indexer, dtype, site, step)
        # A masked gather-style access: which elements the mask covers is not followed; unchecked.


_Step = Callable[[], list[Any] | None]
"""Gives the program ids of the grid step making an access (None where they cannot be told)."""


def _no_step() -> None:
    return None


def _below(a: Index, b: Index) -> Condition:
    from jax import lax

    return a < b if isinstance(a, int) and isinstance(b, int) else lax.lt(traced(a), traced(b))


def _inside(first: Index, last: Index, n: int) -> Condition:
    """``0 <= first`` and ``last < n``."""
    return _both(_below(-1, first), _below(last, n))


def _both(a: Condition, b: Condition) -> Condition:
    from jax import lax

    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    return lax.bitwise_and(a, b)


def _check_ranges(
    kind: str, ranges: list[Range], shape: tuple[int, ...], *, dtype: str, mask: Any, site: str, step: _Step
) -> None:
    from jax import lax

    first = [as_index(offset) for offset, _, _ in ranges]
    last = [plus(first[d], stride * (size - 1)) if size else first[d] for d, (_, stride, size) in enumerate(ranges)]
    inside = [_inside(f, la, n) for f, la, (_, _, size), n in zip(first, last, ranges, shape, strict=True) if size != 0]
    ok: Condition = functools.reduce(_both, inside, True)
    if ok is True:
        return  # proven inside while tracing: every element, masked or not
    if mask is not None:
        ok = lax.bitwise_not(_unmasked_outside(ranges, shape, first, mask))
    shown, values = [], []
    for d, (_, stride, size) in enumerate(ranges):
        if size is None:
            shown.append("{}")
            values.append(first[d])
        else:
            shown.append("{}:{}" + (f":{stride}" if stride != 1 else ""))
            values += [first[d], plus(first[d], stride * size)]
    masked = " (unmasked elements)" if mask is not None else ""
    message = f"{kind} [{', '.join(shown)}]{masked} of a {_escape(dtype)}{list(shape)} buffer {_escape(site)}".replace(
        "[]", "[()]"
    )
    _check(ok, message, values, step)


def _unmasked_outside(ranges: list[Range], shape: tuple[int, ...], first: list[Any], mask: Any) -> Any:
    """Whether an element the mask lets through lies outside the buffer."""
    import jax.numpy as jnp

    kept = [(d, size) for d, (_, _, size) in enumerate(ranges) if size is not None]
    out_shape = tuple(size for _, size in kept)
    outside = jnp.zeros(out_shape, jnp.bool_)
    for d, (_, stride, size) in enumerate(ranges):
        if size is None:
            outside = outside | (traced(first[d]) < 0) | (traced(first[d]) >= shape[d])
            continue
        axis = next(i for i, (dim, _) in enumerate(kept) if dim == d)
        position = traced(first[d]) + stride * jnp.arange(size, dtype=jnp.int32)
        bad = (position < 0) | (position >= shape[d])
        outside = outside | bad.reshape(tuple(size if i == axis else 1 for i in range(len(out_shape))))
    return jnp.any(outside & jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), out_shape))


def _check_gather(kind: str, indexer: Any, dtype: str, site: str, step: _Step) -> None:
    """An indexer with index arrays (a gather or scatter): every index inside its dimension."""
    import jax.numpy as jnp

    ok = jnp.bool_(True)
    shown, values = [], []
    slice_class = jax_state.slice_class()
    for index, n in zip(indexer.indices, indexer.shape, strict=True):
        if slice_class is not None and isinstance(index, slice_class):
            if not isinstance(index.size, int):
                shown.append(":")
                continue
            start = jnp.asarray(index.start, jnp.int32)
            end = start + getattr(index, "stride", 1) * (index.size - 1)
            ok = ok & ((index.size == 0) | ((start >= 0) & (end < n)))
            shown.append("{}:{}")
            values += [start, end + 1]
        else:
            array = jnp.asarray(index).astype(jnp.int32)
            ok = ok & jnp.all((array >= 0) & (array < n))
            shown.append("{}..{}" if array.shape else "{}")
            values += [jnp.min(array), jnp.max(array)] if array.shape else [array]
    message = f"{kind} [{', '.join(shown)}] of a {_escape(dtype)}{list(indexer.shape)} buffer {_escape(site)}"
    _check(ok, message, values, step)


def _check_block(checking: _Checking, start: Any, block: tuple[int, ...], value: Any) -> None:
    """A block copied in at a grid step lies inside its (padded) array: the check that the index
    map's block index is in range (a ragged last block is padded, never a finding). The copy back
    out uses the same start: checked here once."""
    starts = [as_index(s) for s in start]
    shape = tuple(value.shape)
    ok = functools.reduce(
        _both, [_inside(s, plus(s, b - 1), n) for s, b, n in zip(starts, block, shape, strict=True)], True
    )
    # The interpreter copies every block operand in order at each step: the count names this one.
    position = next(checking.copies)
    if ok is True or _inside_at_every_step(checking, start, block, shape):
        return  # a block index known while tracing, inside its array
    name, array, index_map = "an operand", shape, None
    if checking.blocks:
        known_block, array, origin, index_map = checking.blocks[position % len(checking.blocks)]
        if known_block == block and _padded(array, block) == shape:
            name = origin or name
        else:
            array, index_map = shape, None
    its_map = f"its index map at {_escape(index_map)}" if index_map else "its index map"
    message = (
        f"block copy of {_escape(name)} ({_escape(str(value.dtype))}{list(array)}): the block of shape "
        f"{list(block)} at element offset [{', '.join('{}' for _ in starts)}] lies outside the array ({its_map} "
        "points past the array's last block)"
    )
    _check(ok, message, starts, lambda: list(checking.step) or None)


def _span(mapping: Any, grid: Any) -> tuple[tuple[int, int], ...] | None:
    """The lowest and highest element at which ``mapping``'s block starts, per dimension, over
    every step of ``grid``: its index map computed while lowering (``on_numbers.at_every_step``),
    each block index turned into an element offset as the interpreter turns it. None where a start
    is known only when the kernel runs."""
    import numpy as np

    indices = on_numbers.at_every_step(getattr(mapping, "index_map_jaxpr", None), grid)
    dims = tuple(getattr(mapping, "block_shape", ()) or ())
    if indices is None or len(indices) < len(dims):
        return None
    span = []
    for index, dim in zip(indices, dims, strict=False):
        kind = type(dim).__name__
        factor = (
            getattr(dim, "block_size", None) if kind == "Blocked" else 1 if kind in ("Squeezed", "Element") else None
        )
        if not isinstance(factor, int):
            return None
        starts = index.astype(np.int64) * factor
        low, high = int(starts.min()), int(starts.max())
        if low < -(2**31) or high >= 2**31:
            return None  # the interpreter computes starts in int32: one that wraps is left to the check
        span.append((low, high))
    return tuple(span)


def _inside_at_every_step(checking: _Checking, start: Any, block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``start``, computed by the index map at the grid step being traced, puts the block
    inside its (padded) array at every grid step: known while lowering, no check as the kernel runs."""
    known = checking.known.get(id(start))
    if known is None or known[0] is not start or len(known[1]) != len(shape) or len(block) != len(shape):
        return False
    return all(low >= 0 and high + b - 1 < n for (low, high), b, n in zip(known[1], block, shape, strict=True))


def _padded(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // b) * b if b else n for n, b in zip(shape, block, strict=False))


def _check(ok: Condition, message: str, values: list[Any], step: _Step) -> None:
    """One check; ``step`` (gives the program ids, none for a grid of no axes) says at which grid
    step."""
    import numpy as np
    from jax import lax

    if ok is True:
        return
    program_ids = step()
    if program_ids:
        message += f", at grid step ({', '.join('{}' for _ in program_ids)}{',' if len(program_ids) == 1 else ''})"
        values = [*values, *program_ids]
    # Built from scalars and broadcasts alone: an array constant would become a const of the
    # discharged body, which JAX's discharge of a loop refuses.
    parts = [lax.broadcast_in_dim(np.int32(v) if isinstance(v, int) else as_index(v), (1,), ()) for v in values]
    check_vector(ok, message, lax.concatenate(parts, 0))


class Bounds(_checks.Check):
    """Works inside the interpretation: the lowering net lowers the plain interpreter with index
    checks (``checked_plain.lower``) where the front door marked the kernel (``checked_plain.mark``)
    or the setting is in force; TPU interpret mode and the Mosaic-GPU interpreter check reads
    themselves."""

    name = "bounds"
    order = 4
    in_plain = True

    def arm_plain(self, lowering: PlainLowering) -> Active:
        hook(lowering.hooks)
        kernel, call_site = lowering.kernel, lowering.call_site
        equations = jax_state.jaxpr_equations(lowering.given["jaxpr"])
        if any(eqn.primitive.name == "run_state" for eqn in equations) and not _run_state_checked():
            # Its body is discharged apart from the kernel's accesses: a gap said, not hidden.
            gap = "bounds does not check accesses in pl.run_state bodies"
            note = f"runs partly unchecked: {gap}"
            _record.annotate(
                kernel, call_site, _checks.unchecked("bounds", gap, kernel=kernel, call_site=call_site, note=note)
            )
        grid_mapping = lowering.given.get("grid_mapping")
        return functools.partial(_checking_in, _Checking(_blocks(grid_mapping), grid_mapping))

    def plain_finding(
        self, message: str, lowering: PlainLowering, source: str, call_site: _diagnostics.CallSite
    ) -> PallasGuardError:
        # Every failed check the races check does not claim is an access outside its buffer.
        return _diagnostics.bounds_finding(message, kernel=lowering.kernel, call_site=call_site, source=source)

    def finding(self, run: Run, error: BaseException) -> PallasGuardError | None:
        recorded = _findings.recorded_in(error, run.call_site)
        if recorded is not None:
            return recorded
        found = _diagnostics.bounds_error(error, kernel=run.kernel.info, call_site=run.call_site)
        if found is None:
            return None
        # Not the plain interpreter's (recorded above): the checking interpreter's own read check.
        interpreter = next((n for n in run.candidates.names if n != "plain"), None)
        return _checks.found(self.name, found, kernel=run.kernel.info, call_site=run.call_site, interpreter=interpreter)


CHECK = Bounds()
