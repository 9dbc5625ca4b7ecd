"""The race check inside the plain interpretation: DMAs in flight, followed as values.

JAX's plain interpreter copies a DMA's data when the DMA starts and treats its wait as a semaphore
count, so a kernel that reads a buffer while a DMA into it is still in flight returns the right
answer on a CPU and a wrong one on a TPU. TPU interpret mode finds such races by simulating every
DMA on the host, at tens of milliseconds a grid step. This check finds them at the plain
interpreter's speed. Where a kernel's DMAs in flight do not depend on its values (started and
waited within a grid step or loop iteration), they are decided while tracing (``dma_decided``): only
an access whose overlap with a DMA in flight depends on traced indices gets a check, and a kernel
with none is left as it is. Where they cross grid steps but program ids, loop counters and
constants alone place them, the grid is followed step by step while lowering (``dma_stepped``), and
a kernel that never races is left as it is. Otherwise, before the kernel is interpreted, its jaxpr is traced again
(``instrument``) with one more scratch buffer, the **table** of the DMAs in flight (``dma_table``:
``SLOTS`` rows of int32 fields:
state, start order, semaphore, bytes, destination and source buffer and box), which the plain
interpreter carries from grid step to grid step like any scratch buffer. Around each DMA start and
wait, and before each access to a buffer some DMA of the kernel touches, the traced kernel reads
the table and updates it; a check there (``checked_plain.check_vector``) fails on a race, with the facts as one int32
vector (kind, sites, buffer, the region both touch, the grid step), which :func:`describe` turns
into the finding. A kernel without DMAs is not traced again at all.

A race is what TPU interpret mode's happens-before detector reports on one core: an access to a
DMA's destination, or a write to its source, between the DMA's start and the wait that completes
it (a DMA reading or writing a region another DMA in flight writes counts too); and what a TPU
does not survive: a wait no started DMA can satisfy (the core waits forever), a DMA still in flight
when the kernel ends, or when the pipeline copies the block it writes. A wait completes the DMAs on
its semaphore in the order they started, as many as its byte count covers (a semaphore counts
bytes on a TPU). Regions are boxes in the buffer's first four dimensions (a strided slice covers
its span; an index array, a bitcast or reshape the whole dimension): a box can only over-report,
never miss. Values are untouched: the table is a buffer of its own and the checks read indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from pallas_guard._checks.dma_decided import Decided
from pallas_guard._checks.dma_jaxpr import CALLS, OpenBody, has_dmas, is_literal, sub_jaxprs, unflatten, unsupported
from pallas_guard._checks.dma_stepped import race_free
from pallas_guard._checks.dma_table import (
    DIMS,
    DST,
    DST_BOX,
    FIELDS,
    KINDS,
    MARK,
    SITE,
    SLOTS,
    SRC_BOX,
    Buffer,
    Evaluator,
    Instrumented,
    Unsupported,
)
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas


def instrument(params: dict[str, Any], instrumented: Instrumented) -> dict[str, Any]:
    """``params`` of a ``pallas_call`` whose kernel checks every DMA and every access to a buffer a
    DMA touches: decided while tracing where it can be (``Decided``; ``params`` themselves where
    nothing needs a check), else with the table as one more scratch operand. Raises
    :class:`Unsupported`."""
    import jax

    jaxpr = params["jaxpr"]
    grid_mapping: Any = params["grid_mapping"]
    why = unsupported(jaxpr)
    if why is not None:
        raise Unsupported(why)
    if getattr(grid_mapping, "local_grid_env", None) is not None:
        raise Unsupported("it runs on a core mesh: TPU interpret mode simulates the cores")
    if not dataclasses.is_dataclass(grid_mapping):
        raise Unsupported("this jax's grid mapping cannot take one more scratch operand")
    state_types = jax_lookup.import_optional("jax._src.state.types")
    ref_type = getattr(state_types, "AbstractRef", None)
    if ref_type is None:
        raise Unsupported("this jax has no AbstractRef")
    instrumented.buffers.extend(_operand_buffers(jaxpr, grid_mapping))
    involved, hoisted = _involved(jaxpr)
    # The plain interpreter hands each grid step the scalar-prefetch operands as the call passed
    # them, so what a kernel writes there (paged attention's buffer index and first-step flag) is
    # lost between steps, which a TPU keeps: its DMAs would be followed through another control
    # flow than the TPU's. Such operands get a scratch copy, filled at the first step and kept.
    kept = sorted(_written_inputs(jaxpr) & set(range(params["grid_mapping"].num_index_operands)))
    vmapped = tuple(getattr(grid_mapping, "vmapped_dims", None) or ())
    instrumented.grid_axes = len(params["grid_mapping"].grid) - len(vmapped)
    hoisted_ids = {}
    for key, aval in hoisted.items():
        hoisted_ids[key] = len(instrumented.buffers)
        instrumented.buffers.append(Buffer(f"a pl.run_scoped buffer ({aval})", tuple(getattr(aval, "shape", ()))))
    evaluator: Evaluator
    if DECIDE_WHILE_TRACING and not kept:
        evaluator = Decided(instrumented, involved, ref_type, hoisted_ids)
        try:
            new_jaxpr = _trace_instrumented(jaxpr, grid_mapping, evaluator, kept=[], hoisted=hoisted, table_aval=None)
        except (Unsupported, MemoryError, RecursionError):
            raise
        except Exception:  # undecided, or a kernel this way fails on: the table follows it instead
            del instrumented.points[:], instrumented.sites[:]
        else:
            if not instrumented.points:  # no DMA in flight where the kernel touches its buffers
                return params
            return {**params, "jaxpr": new_jaxpr, "grid_mapping": _with_scratch(grid_mapping, (*hoisted.values(),))}
        grid = tuple(params["grid_mapping"].grid)
        if (
            FOLLOW_STEPS
            and not vmapped
            and all(isinstance(n, int) for n in grid)
            and race_free(
                jaxpr, grid, instrumented=instrumented, involved=involved, ref_type=ref_type, hoisted_ids=hoisted_ids
            )
        ):
            return params  # its DMAs cross grid steps, and never race at any step
    table_aval = ref_type(jax.core.ShapedArray((SLOTS + 1, FIELDS), jax.numpy.int32))
    evaluator = Evaluator(instrumented, involved, ref_type, hoisted_ids)
    new_jaxpr = _trace_instrumented(jaxpr, grid_mapping, evaluator, kept=kept, hoisted=hoisted, table_aval=table_aval)
    kept_avals = [jaxpr.invars[position].aval for position in kept]
    new_mapping = _with_scratch(grid_mapping, (*kept_avals, *hoisted.values(), table_aval))
    return {**params, "jaxpr": new_jaxpr, "grid_mapping": new_mapping}


FOLLOW_STEPS = True
"""Whether a kernel the trace cannot decide is followed grid step by grid step (``dma_stepped``)
before the table. Off only where the table's own cost is measured."""

DECIDE_WHILE_TRACING = True
"""Whether the check first tries to decide the DMAs in flight while tracing (``Decided``), before
it falls back to the table. Off only in tests, which hold both ways against the same corpus."""


def _trace_instrumented(
    jaxpr: Any,
    grid_mapping: Any,
    evaluator: Evaluator,
    *,
    kept: list[int],
    hoisted: dict[Any, Any],
    table_aval: Any,
) -> Any:
    """The kernel's jaxpr traced again through ``evaluator``, with the scratch operands it adds: a
    copy of each ``kept`` scalar-prefetch operand, the ``hoisted`` scope buffers, the table if any."""

    def kernel(*refs: Any) -> list[Any]:
        n = len(jaxpr.invars)
        operands, copies = list(refs[:n]), refs[n : n + len(kept)]
        rest = list(refs[n + len(kept) :])
        if table_aval is not None:
            evaluator.table = rest.pop()
        evaluator.hoisted = dict(zip(hoisted, rest, strict=True))
        evaluator.step_ids = _step_ids(evaluator.instrumented.grid_axes)
        evaluator.begin_step()
        for position, copy in zip(kept, copies, strict=True):
            evaluator.keep_across_steps(operands[position], copy)
            operands[position] = copy
        evaluator.run(jaxpr, (), operands, list(range(len(operands))))
        evaluator.end_step()
        return []

    with _grid_context(grid_mapping):  # program ids and grid sizes are bound while tracing
        kept_avals = [jaxpr.invars[position].aval for position in kept]
        avals = [v.aval for v in jaxpr.invars] + kept_avals + list(hoisted.values())
        return _trace(kernel, avals + ([table_aval] if table_aval is not None else []), jaxpr)


def _operand_buffers(jaxpr: Any, grid_mapping: Any) -> list[Buffer]:
    """The kernel's operands as buffers, named as the kernel's parameters are."""
    names = tuple(getattr(getattr(jaxpr, "debug_info", None), "arg_names", None) or ())
    first_block = grid_mapping.num_index_operands
    pipelined = set()
    for position, mapping in enumerate(grid_mapping.block_mappings):
        space = str(getattr(jax_pallas.block_aval(mapping), "memory_space", "") or "").lower()
        if "any" not in space and "hbm" not in space:
            pipelined.add(first_block + position)
    buffers = []
    for position, var in enumerate(jaxpr.invars):
        name = names[position] if position < len(names) and names[position] else f"operand {position}"
        buffers.append(Buffer(f"`{name}`", tuple(getattr(var.aval, "shape", ())), pipelined=position in pipelined))
    return buffers


def _with_scratch(grid_mapping: Any, avals: tuple[Any, ...]) -> Any:
    """``grid_mapping`` with ``avals`` as its last scratch operands (how a grid mapping counts them
    varies by jax)."""
    fields = {f.name for f in dataclasses.fields(grid_mapping)}
    if "scratch_avals" in fields:
        return dataclasses.replace(grid_mapping, scratch_avals=(*grid_mapping.scratch_avals, *avals))
    if "num_scratch_operands" in fields:
        return dataclasses.replace(grid_mapping, num_scratch_operands=grid_mapping.num_scratch_operands + len(avals))
    raise Unsupported("this jax's grid mapping counts its scratch operands in a way the check does not know")


def _written_inputs(jaxpr: Any) -> set[int]:
    """The positions of the kernel's refs it writes (its write and accumulate effects)."""
    state = jax_lookup.import_optional("jax._src.state.types")
    kinds = tuple(k for k in (getattr(state, "WriteEffect", None), getattr(state, "AccumEffect", None)) if k)
    written = set()
    for effect in getattr(jaxpr, "effects", ()) or ():
        if kinds and isinstance(effect, kinds):
            target = getattr(effect, "input_index", getattr(effect, "input", None))
            if isinstance(target, int) and not isinstance(target, bool):
                written.add(target)
            else:
                written.update(i for i, v in enumerate(jaxpr.invars) if v is target)
    return written


def _involved(jaxpr: Any) -> tuple[frozenset[Any], dict[Any, Any]]:
    """The buffers (kernel operand positions, or allocation keys) some DMA reads or writes; and the
    ``pl.run_scoped`` allocations the check must see (by key: their avals): those of a scope with a
    DMA or an access to such a buffer, which become scratch operands of the kernel (JAX lowers a
    scope's body on its own, apart from the table the kernel carries)."""
    found: set[Any] = set()
    scopes: list[tuple[Any, list[Any]]] = []

    def walk(inner: Any, keys: list[Any]) -> None:
        inner = getattr(inner, "jaxpr", inner)
        env = dict(zip(inner.invars, keys, strict=False))
        for eqn in inner.eqns:
            name = eqn.primitive.name
            if name == "dma_start":
                operands = unflatten(eqn)
                if operands is not None:
                    for item in operands[:2]:
                        found.add(env.get(item.ref))
            if name == "run_scoped":
                scopes.append((eqn, [env.get(v) for v in eqn.invars if not is_literal(v)]))
            for sub, sub_keys in _sub_keys(eqn, env):
                walk(sub, sub_keys)

    walk(jaxpr, list(range(len(getattr(jaxpr, "invars", ())))))
    found.discard(None)
    hoisted: dict[Any, Any] = {}
    for eqn, keys in scopes:
        body = eqn.params["jaxpr"]
        allocations = {("alloc", id(v)): v.aval for v in body.invars}
        if has_dmas(body) or any(k in found for k in (*keys, *allocations)):
            if eqn.params.get("collective_axes"):
                raise Unsupported("it has DMAs in a pl.run_scoped over collective axes")
            hoisted.update(allocations)
    return frozenset(found), hoisted


def _sub_keys(eqn: Any, env: dict[Any, Any]) -> Iterator[tuple[Any, list[Any]]]:
    """Each nested jaxpr of ``eqn`` with the buffer of each of its inputs (None for a value)."""
    name = eqn.primitive.name
    params = eqn.params
    outer = [env.get(v) if not is_literal(v) else None for v in eqn.invars]
    if name == "cond":
        for branch in params["branches"]:
            yield branch, outer[1:]
    elif name == "while":
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        yield params["body_jaxpr"], outer[n_cond : n_cond + n_body] + [None] * (len(outer) - n_cond - n_body)
        yield params["cond_jaxpr"], outer[:n_cond] + [None] * (len(outer) - n_cond - n_body)
    elif name == "scan":
        yield params["jaxpr"], outer
    elif name == "run_scoped":
        body = params["jaxpr"]
        keys = dict(zip(body.constvars, outer, strict=False))
        yield OpenBody(body), [keys.get(v) for v in body.constvars] + [("alloc", id(v)) for v in body.invars]
    elif name in CALLS:
        for sub in sub_jaxprs(eqn)[:1]:
            yield sub, outer


def _trace(kernel: Callable[..., list[Any]], avals: list[Any], like: Any) -> Any:
    debug_info = getattr(like, "debug_info", None)
    if debug_info is not None and getattr(debug_info, "arg_names", None) is not None:
        added = len(avals) - len(debug_info.arg_names)
        debug_info = debug_info._replace(arg_names=(*debug_info.arg_names, *["pallas_guard_race_check"] * added))
    jaxpr, consts = _traced_jaxpr(kernel, avals, debug_info)
    if consts or jaxpr.constvars:
        raise Unsupported("the check's trace of the kernel captured constants")
    return jaxpr


def _traced_jaxpr(function: Callable[..., Any], avals: list[Any], debug_info: Any) -> tuple[Any, list[Any]]:
    """``function`` traced to a jaxpr over ``avals`` (refs among them), with the values it closes
    over as the jaxpr's constants, as JAX traces a kernel body."""
    lu: Any = jax_lookup.import_optional("jax._src.linear_util")
    pe: Any = jax_lookup.import_optional("jax._src.interpreters.partial_eval")
    try:
        wrapped = lu.wrap_init(function, debug_info=debug_info)
    except TypeError:  # a jax whose wrap_init takes no debug_info
        wrapped = lu.wrap_init(function)
    traced = pe.trace_to_jaxpr_dynamic(wrapped, avals)
    return traced[0], list(traced[2])


def _grid_context(grid_mapping: Any) -> Any:
    import contextlib

    trace_env = getattr(grid_mapping, "trace_env", None)
    if callable(trace_env):
        return trace_env()
    core = jax_lookup.import_optional("jax._src.pallas.core")
    tracing_grid_env = getattr(core, "tracing_grid_env", None)
    if tracing_grid_env is None:
        return contextlib.nullcontext()
    return tracing_grid_env(tuple(grid_mapping.grid), tuple(getattr(grid_mapping, "vmapped_dims", ()) or ()))


def _step_ids(axes: int) -> list[Any]:
    from jax.experimental import pallas as pl

    return [pl.program_id(axis) for axis in range(axes)]


def is_race(finding: str) -> bool:
    return finding.startswith(MARK)


def describe(finding: str, instrumented: Instrumented) -> tuple[str, str]:
    """(what, the finding in words) from the check's message and its numbers."""
    numbers = [int(n) for n in finding[len(MARK) :].split()]
    recorded, row, step = numbers[:FIELDS], numbers[FIELDS : 2 * FIELDS], numbers[2 * FIELDS :]
    point = instrumented.points[recorded[0] - 1]
    kind, against = point.kind, point.against
    if kind in (2, 5) and row[DST] != point.buffer:  # the DMA's source it shares, not its destination
        kind, against = kind + 1, SRC_BOX
    traced = iter(recorded[1:])
    box = [
        (first if first is not None else next(traced), end if end is not None else next(traced))
        for first, end in point.template
    ]
    if against is not None:
        box = [
            (max(first, row[against + 2 * d]), min(end, row[against + 2 * d + 1])) for d, (first, end) in enumerate(box)
        ]
    buffer = point.buffer
    if point.site < 0:  # the DMA's own destination
        buffer = row[DST]
        box = [(row[DST_BOX + 2 * d], row[DST_BOX + 2 * d + 1]) for d in range(DIMS)]

    def site_text(index: int) -> str:
        return instrumented.sites[index] if 0 <= index < len(instrumented.sites) else "in the kernel body"

    def region() -> str:
        if not 0 <= buffer < len(instrumented.buffers):
            return "a buffer"
        named = instrumented.buffers[buffer]
        dims = [
            str(first) if end == first + 1 else f"{first}:{end}" for first, end in box[: min(len(named.shape), DIMS)]
        ]
        return f"{named.name}[{', '.join(dims)}]" if dims else named.name

    what = KINDS.get(kind, "race")
    at_step = f" at grid step ({', '.join(map(str, step))}{',' if len(step) == 1 else ''})" if step else ""
    dma = f"the DMA started at {site_text(row[SITE])}"
    if kind == 7:
        text = f"the wait at {site_text(point.site)} on a DMA into {region()}{at_step}"
    elif kind in (8, 9, 10):
        text = f"{dma} into {region()}{at_step}"
    else:
        access = {1: "the read", 2: "the write", 3: "the write"}.get(kind, "the DMA")
        text = f"{access} at {site_text(point.site)} and {dma} both touch {region()}{at_step}"
    return what, text
