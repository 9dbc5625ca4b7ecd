"""The bounds check on the plain interpreter: an index check at every access, at its speed.

The plain interpreter turns a kernel into XLA operations: each ref access is discharged to a
``dynamic_slice``/``dynamic_update_slice`` (or a gather/scatter), and each grid step copies blocks
in and out the same way; all of them clamp an out-of-range index silently. While the lowering net
lowers a kernel in the plain interpreter with ``bounds`` in force, the discharge rules of the access
primitives (wrapped while the guard is installed, acting only then) put a ``checkify.check`` before
each access: its element range against the buffer it indexes, element by element where the access
is masked (masked-off elements are never findings). The block copies get the same check (an index
map or scalar-prefetch value that points outside its array). The interpreter runs under
``checkify.checkify``, which carries the first failed check through the grid loop; one host callback
per kernel call raises it as ``PallasGuardError``. The checks read indices and change no value: a
kernel without a finding returns what the unchecked plain interpreter returns, bit for bit.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import linecache
import os
import string
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding.diagnostics import CallSite, KernelInfo
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import source as jax_source
from pallas_guard._jax import state as jax_state
from pallas_guard._running import findings as _findings
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary import settings as _settings
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


_MARK_KEY = "pallas_guard"


def mark(checks: frozenset[str], *, fast_plain: bool) -> dict[str, str]:
    """The ``metadata`` of a kernel the guard runs eagerly in the plain interpreter, with the checks
    and the ``fast_plain`` setting in force. JAX keeps one executable per equation (params included)
    and reuses it for any later eager call of the same equation: marked, the guard's executables are
    never reused for a call under other settings, under policy ``off`` or after ``uninstall()`` (the
    plain interpreter ignores metadata)."""
    how = "interpreted" if fast_plain else "interpreted-as-jax-ships"
    return {_MARK_KEY: "+".join((how, *sorted(checks)))}


def marked_checks(params: dict[str, Any]) -> frozenset[str]:
    """The checks a kernel was marked with (none for an unmarked one)."""
    value = (params.get("metadata") or {}).get(_MARK_KEY)
    return frozenset(value.split("+")[1:]) if isinstance(value, str) else frozenset()


_checking: contextvars.ContextVar[_Checking | None] = contextvars.ContextVar("pallas_guard_bounds", default=None)


# --- hooks: JAX's discharge rules and the interpreter's block copies, checking only when asked ---


class TableEntry:
    """One entry of a JAX table replaced by a checking wrapper, and the exact object to put back."""

    def __init__(self, table: Any, key: Any, original: Any, wrapper: Any) -> None:
        self.table, self.key, self.original, self.wrapper = table, key, original, wrapper

    def restore(self) -> None:
        if self.table.get(self.key) is self.wrapper:  # leave what someone registered over it
            self.table[self.key] = self.original


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
        wrap(jax_pallas.block_mapping_class(), jax_pallas.BLOCK_START, _recording_step, hooks, is_ours=_is_ours)
        discharge = jax_state.state_discharge_module()
        wrap(discharge, jax_state.DISCHARGE_EVALUATOR, _counting_levels, hooks, is_ours=_is_ours)
        module = jax_pallas.hlo_interpreter_module()
        wrap(module, jax_pallas.BLOCK_COPY, _checking_block_copy, hooks, is_ours=_is_ours)


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
        if checking is not None:
            vmapped = getattr(checking.grid_mapping, "vmapped_dims", None) or ()
            checking.step[:] = [index for axis, index in enumerate(loop_idx) if axis not in vmapped]
        return start(self, loop_idx, *args)

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


# --- the checked lowering -------------------------------------------------------------------------


PLAIN_CHECKS = frozenset({"bounds", "races"})
"""The checks made inside the plain interpretation, lowered by :func:`lower`: bounds through the
discharge rules, races through the kernel traced again with its DMA table (``_dma_races``)."""


def lower(
    ctx: Any,
    in_nodes: Sequence[Any],
    params: dict[str, Any],
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    hooks: list[Any],
    checks: frozenset[str] = frozenset({"bounds"}),
) -> Any:
    """Lower one ``pallas_call`` equation in the plain interpreter with the ``checks`` of
    ``PLAIN_CHECKS`` asked for; None where this jax lacks a piece (the caller lowers it unchecked).
    A kernel whose DMAs the race check cannot follow runs without it, its decision saying why."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import checkify, io_callback

    from pallas_guard._checks import dma_races as _dma_races

    tools = jax_lowering.lowering_tools()
    if tools is None or unchecked_reason("pallas_call", params) is not None:
        return None
    # The checks go in through discharge rules, whose results JAX caches per jaxpr object: a
    # private copy neither reads an unchecked discharge cached before nor leaves a checked one.
    private = jax_state.private_params(params)
    races = None
    if "races" in checks and _dma_races.has_dmas(private["jaxpr"]):
        races = _dma_races.Instrumented()
        try:
            private = _dma_races.instrument(private, races)
        except _dma_races.Unsupported as why:
            races = None
            note = f"runs unchecked: races could not be checked: {why}"
            _record.annotate(
                kernel, call_site, _checks.unchecked("races", str(why), kernel=kernel, call_site=call_site, note=note)
            )
        else:
            if not races.points:  # race-free whichever way it runs, decided while tracing
                races = None
    if "bounds" not in checks and races is None:
        return None
    interpret = jax_pallas.plain_interpreter(private)
    if interpret is None:
        return None
    lower_fun = tools[2]
    state = None
    if "bounds" in checks:
        hook(hooks)
        if any(eqn.primitive.name == "run_state" for eqn in jax_state.jaxpr_equations(params["jaxpr"])):
            # Its body is discharged apart from the kernel's accesses: a gap said, not hidden.
            gap = "bounds does not check accesses in pl.run_state bodies"
            note = f"runs partly unchecked: {gap}"
            _record.annotate(
                kernel, call_site, _checks.unchecked("bounds", gap, kernel=kernel, call_site=call_site, note=note)
            )
        state = _Checking(_blocks(params.get("grid_mapping")), params.get("grid_mapping"))
    source = _settings.stated("checks")

    def checked(*args: Any) -> Any:
        token = _checking.set(state)
        try:
            error, out = checkify.checkify(interpret, errors=checkify.user_checks)(*args)
        except Exception:
            # A discharge cut short can leave a checked entry in JAX's discharge cache under a
            # jaxpr the kernel shares, where the unchecked lowering that follows would read it.
            jax_state.forget_discharges()
            raise
        finally:
            _checking.reset(token)
            if state is not None:
                state.step.clear()  # tracers of this trace, which ends here
        raise_finding = functools.partial(
            _raise_finding, kernel=kernel, call_site=call_site, source=source, races=races
        )
        # Only a failed check calls back to the host (a call per kernel call would cost more than a
        # small kernel). Unordered: no effect token, which a lowering rule has no place for.
        failed = functools.reduce(jnp.logical_or, list(getattr(error, "_pred", {}).values()), jnp.bool_(False))
        lax.cond(failed, lambda e: io_callback(raise_finding, None, e, ordered=False), lambda e: None, error)
        return out

    return lower_fun(checked, multiple_results=True)(ctx, *in_nodes)


def unchecked_reason(entry_point: str, params: dict[str, Any]) -> str | None:
    """Why a kernel the plain interpreter runs cannot get the bounds check, or None."""
    if entry_point != "pallas_call":
        return f"{entry_point} lowers through its own rule, which the check does not reach"
    if getattr(params.get("jaxpr"), "constvars", None):
        return "the kernel captures constants"  # JAX's own rule refuses it
    if jax_pallas.plain_interpreter(params) is None:
        return "this jax's plain interpreter is not where the guard looks for it"
    return None


def _raise_finding(error: Any, *, kernel: KernelInfo, call_site: CallSite, source: str, races: Any) -> None:
    from pallas_guard._checks import dma_races as _dma_races

    finding = error.get()
    if not finding:
        return
    finding = str(finding).splitlines()[0].removesuffix(" (`check` failed)")
    if races is not None and _dma_races.is_race(finding):
        what, text = _dma_races.describe(finding, races)
        found = _diagnostics.race_finding(text, what=what, kernel=kernel, call_site=call_site, source=source)
        _findings.record(_checks.found("races", found, kernel=kernel, call_site=call_site, interpreter="plain"))
        return
    error = _diagnostics.bounds_finding(finding, kernel=kernel, call_site=call_site, source=source)
    _findings.record(_checks.found("bounds", error, kernel=kernel, call_site=call_site, interpreter="plain"))


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


def indexed(operands: Sequence[Any]) -> Iterator[tuple[int, Any, tuple[Any, ...]]]:
    """(role, ref, its transforms) for each indexed ref among an access's operands: a ``(ref,
    transforms)`` pair of neighbours (older jax), or a transformed-ref object. ``role`` counts the
    ref operands, indexed or whole (a DMA's source is 0, its destination 1)."""
    indexer = jax_state.nd_indexer_class()
    pairs = len(operands) > 1 and isinstance(operands[1], tuple | list)
    for position, item in enumerate(operands):
        transforms = getattr(item, "transforms", None)
        if transforms is not None and hasattr(item, "ref"):
            yield position, item.ref, tuple(transforms)
        elif position and isinstance(item, tuple | list) and any(isinstance(t, indexer or ()) for t in item):
            yield (position - 1) // 2 if pairs else position - 1, operands[position - 1], tuple(item)


def _site() -> str:
    """Where the kernel makes the access being discharged: ``at file:line (`code`)``."""
    text = site_text()
    return text if text == NO_SITE else f"at {text}"


NO_SITE = "in the kernel body"


def site_text(eqn: Any = None) -> str:
    """``file:line (`code`)`` of the kernel line that made an access (the one being discharged, or
    equation ``eqn``'s), else ``NO_SITE``."""
    found = jax_source.access_site(eqn)
    if found is None:
        return NO_SITE
    filename, line, _ = found
    code = linecache.getline(filename, line).strip()
    shown = f"{os.path.basename(filename)}:{line}"
    return f"{shown} (`{code}`)" if code else shown


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


# A base dimension: (offset, stride, size) where a range of it is accessed (size None: an integer
# index, the dimension dropped).
_Range = tuple[Any, int, int | None]


def compose(indexers: Sequence[Any]) -> list[_Range] | None:
    """The element ranges of the buffer a chain of slice/integer indexers accesses, per buffer
    dimension; None where an indexer has index arrays or a dynamic size."""
    slice_class = jax_state.slice_class()
    ranges: list[_Range] = [(0, 1, n) for n in indexers[0].shape]
    for indexer in indexers:
        view = [d for d, (_, _, size) in enumerate(ranges) if size is not None]
        if len(view) != len(indexer.indices):
            return None
        for dim, index in zip(view, indexer.indices, strict=True):
            offset, stride, _ = ranges[dim]
            if slice_class is not None and isinstance(index, slice_class):
                size, step = index.size, getattr(index, "stride", 1)
                if not isinstance(size, int) or not isinstance(step, int):
                    return None
                ranges[dim] = (plus(offset, times(as_index(index.start), stride)), stride * step, size)
            elif getattr(index, "shape", ()) == ():
                ranges[dim] = (plus(offset, times(as_index(index), stride)), stride, None)
            else:
                return None
    return ranges


# Index arithmetic, in lax (a jnp operator on a tracer is a jitted call of its own, which a kernel
# with many accesses pays for hundreds of times at its first lowering). An index known while
# tracing stays a Python int, and a condition it decides a Python bool: an access proven inside its
# buffer gets no check at all.
_Index = Any  # int, or an int32 scalar being traced
_Condition = Any  # bool, or a bool scalar being traced


def as_index(value: Any) -> _Index:
    import numpy as np
    from jax import lax

    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value)
    return lax.convert_element_type(value, np.int32)


def _traced(value: _Index) -> Any:
    import numpy as np

    return np.int32(value) if isinstance(value, int) else value


def plus(a: _Index, b: _Index) -> _Index:
    from jax import lax

    return a + b if isinstance(a, int) and isinstance(b, int) else lax.add(_traced(a), _traced(b))


def times(a: _Index, b: int) -> _Index:
    from jax import lax

    return a * b if isinstance(a, int) else (a if b == 1 else lax.mul(a, _traced(b)))


def _below(a: _Index, b: _Index) -> _Condition:
    from jax import lax

    return a < b if isinstance(a, int) and isinstance(b, int) else lax.lt(_traced(a), _traced(b))


def _inside(first: _Index, last: _Index, n: int) -> _Condition:
    """``0 <= first`` and ``last < n``."""
    return _both(_below(-1, first), _below(last, n))


def _both(a: _Condition, b: _Condition) -> _Condition:
    from jax import lax

    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    return lax.bitwise_and(a, b)


def _check_ranges(
    kind: str, ranges: list[_Range], shape: tuple[int, ...], *, dtype: str, mask: Any, site: str, step: _Step
) -> None:
    from jax import lax

    first = [as_index(offset) for offset, _, _ in ranges]
    last = [plus(first[d], stride * (size - 1)) if size else first[d] for d, (_, stride, size) in enumerate(ranges)]
    inside = [_inside(f, la, n) for f, la, (_, _, size), n in zip(first, last, ranges, shape, strict=True) if size != 0]
    ok: _Condition = functools.reduce(_both, inside, True)
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


def _unmasked_outside(ranges: list[_Range], shape: tuple[int, ...], first: list[Any], mask: Any) -> Any:
    """Whether an element the mask lets through lies outside the buffer."""
    import jax.numpy as jnp

    kept = [(d, size) for d, (_, _, size) in enumerate(ranges) if size is not None]
    out_shape = tuple(size for _, size in kept)
    outside = jnp.zeros(out_shape, jnp.bool_)
    for d, (_, stride, size) in enumerate(ranges):
        if size is None:
            outside = outside | (_traced(first[d]) < 0) | (_traced(first[d]) >= shape[d])
            continue
        axis = next(i for i, (dim, _) in enumerate(kept) if dim == d)
        position = _traced(first[d]) + stride * jnp.arange(size, dtype=jnp.int32)
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
    if ok is True:
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


def _padded(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // b) * b if b else n for n, b in zip(shape, block, strict=False))


_PAYLOAD = 16
"""How many values a finding shows (indices, ranges, program ids), at least: every check reports
them in one int32 vector of this length (longer only for a finding with more). ``checkify`` keeps
an error slot per payload shape, carried through every loop of the kernel and merged at every step,
so one shape keeps its pass and the compiled program small."""


def _check(ok: _Condition, message: str, values: list[Any], step: _Step) -> None:
    """One check; ``step`` (gives the program ids, none for a grid of no axes) says at which grid
    step."""
    import numpy as np
    from jax import lax
    from jax.experimental import checkify

    if ok is True:
        return
    program_ids = step()
    if program_ids:
        message += f", at grid step ({', '.join('{}' for _ in program_ids)}{',' if len(program_ids) == 1 else ''})"
        values = [*values, *program_ids]
    pred = lax.convert_element_type(ok, np.bool_)  # a bool scalar, also where it is known (False)
    # Built from scalars and broadcasts alone: an array constant would become a const of the
    # discharged body, which JAX's discharge of a loop refuses.
    parts = [lax.broadcast_in_dim(np.int32(v) if isinstance(v, int) else as_index(v), (1,), ()) for v in values]
    if len(values) < _PAYLOAD:
        parts.append(lax.full((_PAYLOAD - len(values),), 0, np.int32))
    checkify.check(pred, _fields_of_one_vector(message), lax.concatenate(parts, 0))


def check_vector(ok: Any, message: str, vector: Any) -> None:
    """One check whose values are one int32 vector already (``message``'s fields its elements)."""
    from jax.experimental import checkify

    checkify.check(ok, _fields_of_one_vector(message), vector)


def _fields_of_one_vector(message: str) -> str:
    """``message`` with its ``{}`` fields numbered as elements of one argument: ``{0[0]}``, ..."""
    parts, position = [], 0
    for literal, field, _, _ in string.Formatter().parse(message):
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is not None:
            parts.append(f"{{0[{position}]}}")
            position += 1
    return "".join(parts)


class Bounds(_checks.Check):
    """Works inside the interpretation: the lowering net lowers the plain interpreter with index
    checks (``lower``) where the front door marked the kernel (``mark``) or the setting is in force;
    TPU interpret mode and the Mosaic-GPU interpreter check reads themselves."""

    name = "bounds"

    def finding(self, run: Run, error: BaseException) -> PallasGuardError | None:
        recorded = _findings.recorded_in(error)
        if recorded is not None:
            return recorded
        found = _diagnostics.bounds_error(error, kernel=run.kernel.info, call_site=run.call_site)
        if found is None:
            return None
        # Not the plain interpreter's (recorded above): the checking interpreter's own read check.
        interpreter = next((n for n in run.candidates.names if n != "plain"), None)
        return _checks.found(self.name, found, kernel=run.kernel.info, call_site=run.call_site, interpreter=interpreter)


CHECK = Bounds()
