"""The race check inside the plain interpretation: DMAs in flight, followed as values.

JAX's plain interpreter copies a DMA's data when the DMA starts and treats its wait as a semaphore
count, so a kernel that reads a buffer while a DMA into it is still in flight returns the right
answer on a CPU and a wrong one on a TPU. TPU interpret mode finds such races by simulating every
DMA on the host, at tens of milliseconds a grid step. This check finds them at the plain
interpreter's speed. Where a kernel's DMAs in flight do not depend on its values (started and
waited within a grid step or loop iteration), they are decided while tracing (``_Decided``): only
an access whose overlap with a DMA in flight depends on traced indices gets a check, and a kernel
with none is left as it is. Otherwise, before the kernel is interpreted, its jaxpr is traced again
(``instrument``) with one more scratch buffer, the **table** of the DMAs in flight (``SLOTS`` rows of int32 fields:
state, start order, semaphore, bytes, destination and source buffer and box), which the plain
interpreter carries from grid step to grid step like any scratch buffer. Around each DMA start and
wait, and before each access to a buffer some DMA of the kernel touches, the traced kernel reads
the table and updates it; a ``checkify.check`` there fails on a race, with the facts as one int32
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
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pallas_guard._checks import checked_plain
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state

SLOTS = 64
"""The DMAs the table follows at once (a kernel with more in flight is a finding of its own kind,
said as such: the check cannot follow it)."""

DIMS = 4
"""The buffer dimensions a region is followed in; further dimensions count as overlapping."""

# The table's fields, per row.
_STATE, _ORDER, _SEM, _BYTES, _DST, _SRC, _SITE = range(7)
_DST_BOX = 7
_SRC_BOX = _DST_BOX + 2 * DIMS
FIELDS = _SRC_BOX + 2 * DIMS
_FREE, _IN_FLIGHT, _CREDIT = 0, 1, 2
"""A row's state: free; a DMA in flight; a completed DMA whose bytes a wait has not all used yet."""

# What a finding is, by its code in the payload.
KINDS = {
    1: "read of a DMA's destination before its wait",
    2: "write to a DMA's destination while the DMA is in flight",
    3: "write to a DMA's source while the DMA is in flight",
    4: "a DMA reading a region another DMA in flight writes",
    5: "two DMAs in flight into overlapping regions",
    6: "a DMA writing a region another DMA in flight reads",
    7: "a wait that no started DMA can complete (on a TPU the core waits forever)",
    8: "a DMA still in flight at the end of the kernel",
    9: "a DMA still in flight when the grid step ends and the pipeline copies its block",
    10: f"more than {SLOTS} DMAs in flight at once (the race check cannot follow them)",
}
_MARK = "pallas_guard race"


class Unsupported(Exception):
    """The kernel has a DMA the check cannot follow (the message says why)."""


@dataclasses.dataclass
class Buffer:
    name: str
    shape: tuple[int, ...]
    pipelined: bool = False
    """A block operand the plain interpreter copies in and out at every grid step (not ``ANY``)."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One place the traced kernel checks: the kind of race it finds there, the site and buffer of
    the access (-1: none), its region with the bounds known while tracing (None: traced, recorded with
    the finding), and which box of the DMA rows it is held against (None: its own region)."""

    kind: int
    site: int
    buffer: int
    template: list[tuple[Any, Any]]
    against: int | None


@dataclasses.dataclass
class Instrumented:
    """What the traced kernel's findings refer to by number."""

    buffers: list[Buffer] = dataclasses.field(default_factory=list)
    sites: list[str] = dataclasses.field(default_factory=list)
    points: list[Point] = dataclasses.field(default_factory=list)
    grid_axes: int = 0

    def site(self, eqn: Any) -> int:

        text = checked_plain.site_text(eqn)
        if text not in self.sites:
            self.sites.append(text)
        return self.sites.index(text)


# --- what the kernel's jaxpr holds ----------------------------------------------------------------


def has_dmas(jaxpr: Any) -> bool:
    return any(eqn.primitive.name in ("dma_start", "dma_wait") for eqn in jax_state.jaxpr_equations(jaxpr))


_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call"})
_HANDLED = _CALLS | {"cond", "while", "scan", "run_scoped"}


def unsupported(jaxpr: Any) -> str | None:
    """Why the check cannot follow this kernel's DMAs, or None."""
    for eqn in jax_state.jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "dma_start":
            operands = _unflatten(eqn)
            if operands is None:
                return "its DMAs are laid out as this jax's check does not read them"
            if len(operands) > 4 and operands[4] is not None:
                return "it has a remote DMA (another device): TPU interpret mode simulates the devices"
        elif name not in _HANDLED and any(has_dmas(sub) for sub in _sub_jaxprs(eqn)):
            return f"it has DMAs inside `{name}`, which the check does not follow"
    return None


def _sub_jaxprs(eqn: Any) -> list[Any]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item)
    return found


def _unflatten(eqn: Any, values: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
    """A DMA equation's (source, destination, destination semaphore, source semaphore, device id),
    each a transformed ref (or None), from its atoms or from ``values``."""
    import jax

    tree = eqn.params.get("tree")
    if tree is None:
        return None
    try:
        operands = jax.tree_util.tree_unflatten(tree, list(values if values is not None else eqn.invars))
    except Exception:
        return None
    if not isinstance(operands, tuple) or len(operands) < 3:
        return None
    if len(operands) == 9:  # jax < 0.10: (ref, its transforms) pairs, then the device id
        pairs = [(operands[i], operands[i + 1]) for i in (0, 2, 4, 6)]
        return (*(None if ref is None else _Viewed(ref, tuple(t or ())) for ref, t in pairs), operands[8])
    # A whole ref is passed as itself, a view as a transformed ref (the ref and its transforms).
    return (*(_Viewed.of(item) for item in operands[:4]), *operands[4:])


class _Viewed:
    """A DMA operand: the ref and the transforms that view it (``view``: what the DMA moves)."""

    def __init__(self, ref: Any, transforms: tuple[Any, ...], view: Any = None) -> None:
        self.ref, self.transforms, self._view = ref, transforms, view

    @classmethod
    def of(cls, item: Any) -> _Viewed | None:
        if item is None:
            return None
        if hasattr(item, "ref") and hasattr(item, "transforms"):
            return cls(item.ref, tuple(item.transforms), item)
        return cls(item, ())

    @functools.cached_property
    def view(self) -> Any:
        """Its shape and dtype (of a traced operand: a jaxpr variable's view is not computed)."""
        if self._view is not None:
            return self._view
        if not self.transforms:
            return _aval(self.ref)
        transformed = getattr(jax_lookup.import_optional("jax._src.state.types"), "TransformedRef", None)
        return transformed(self.ref, self.transforms) if transformed is not None else _aval(self.ref)


# --- the check, traced into the kernel ------------------------------------------------------------


def instrument(params: dict[str, Any], instrumented: Instrumented) -> dict[str, Any]:
    """``params`` of a ``pallas_call`` whose kernel checks every DMA and every access to a buffer a
    DMA touches: decided while tracing where it can be (``_Decided``; ``params`` themselves where
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
    evaluator: _Evaluator
    if DECIDE_WHILE_TRACING and not kept:
        evaluator = _Decided(instrumented, involved, ref_type, hoisted_ids)
        try:
            new_jaxpr = _trace_instrumented(jaxpr, grid_mapping, evaluator, kept=[], hoisted=hoisted, table_aval=None)
        except (Unsupported, MemoryError, RecursionError):
            raise
        except Exception:  # _Undecided, or a kernel this way fails on: the table follows it instead
            del instrumented.points[:], instrumented.sites[:]
        else:
            if not instrumented.points:  # no DMA in flight where the kernel touches its buffers
                return params
            return {**params, "jaxpr": new_jaxpr, "grid_mapping": _with_scratch(grid_mapping, (*hoisted.values(),))}
    table_aval = ref_type(jax.core.ShapedArray((SLOTS + 3, FIELDS), jax.numpy.int32))
    evaluator = _Evaluator(instrumented, involved, ref_type, hoisted_ids)
    new_jaxpr = _trace_instrumented(jaxpr, grid_mapping, evaluator, kept=kept, hoisted=hoisted, table_aval=table_aval)
    kept_avals = [jaxpr.invars[position].aval for position in kept]
    new_mapping = _with_scratch(grid_mapping, (*kept_avals, *hoisted.values(), table_aval))
    return {**params, "jaxpr": new_jaxpr, "grid_mapping": new_mapping}


DECIDE_WHILE_TRACING = True
"""Whether the check first tries to decide the DMAs in flight while tracing (``_Decided``), before
it falls back to the table. Off only in tests, which hold both ways against the same corpus."""


def _trace_instrumented(
    jaxpr: Any,
    grid_mapping: Any,
    evaluator: _Evaluator,
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
    scope's body on its own, where no ``checkify`` reaches)."""
    found: set[Any] = set()
    scopes: list[tuple[Any, list[Any]]] = []

    def walk(inner: Any, keys: list[Any]) -> None:
        inner = getattr(inner, "jaxpr", inner)
        env = dict(zip(inner.invars, keys, strict=False))
        for eqn in inner.eqns:
            name = eqn.primitive.name
            if name == "dma_start":
                operands = _unflatten(eqn)
                if operands is not None:
                    for item in operands[:2]:
                        found.add(env.get(item.ref))
            if name == "run_scoped":
                scopes.append((eqn, [env.get(v) for v in eqn.invars if not _is_literal(v)]))
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
    outer = [env.get(v) if not _is_literal(v) else None for v in eqn.invars]
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
        yield _OpenBody(body), [keys.get(v) for v in body.constvars] + [("alloc", id(v)) for v in body.invars]
    elif name in _CALLS:
        for sub in _sub_jaxprs(eqn)[:1]:
            yield sub, outer


class _OpenBody:
    """A run_scoped body seen as one jaxpr whose inputs are its constants, then its allocations."""

    def __init__(self, jaxpr: Any) -> None:
        self.invars = list(jaxpr.constvars) + list(jaxpr.invars)
        self.eqns, self.outvars = jaxpr.eqns, jaxpr.outvars


def _is_literal(atom: Any) -> bool:
    return type(atom).__name__ == "Literal"


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


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """A ``scan``'s constants and carries: named counts, or (jax 0.12) the lengths of the first two
    groups of its operands' flat tree."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params["ft_in"]
    groups = groups.unpack() if callable(getattr(groups, "unpack", None)) else groups
    return len(groups[0]), len(groups[1])


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


class _Evaluator:
    """Evaluates a kernel's jaxpr in the trace of the instrumented kernel, binding each equation again
    and adding the table's reads, updates and checks around DMAs and accesses to DMA'd buffers."""

    def __init__(
        self, instrumented: Instrumented, involved: frozenset[Any], ref_type: type, hoisted_ids: dict[Any, int]
    ) -> None:
        self.instrumented = instrumented
        self.involved = involved
        self.ref_type = ref_type
        self.table: Any = None
        self.step_ids: list[Any] = []
        self.buffer_ids: dict[Any, int] = {k: k for k in range(len(instrumented.buffers))}
        self.buffer_ids.update(hoisted_ids)
        self.hoisted: dict[Any, Any] = {}
        self.accesses = {id(a.primitive): a for a in jax_state.ref_accesses() if a.kind != "copy"}

    # -- evaluation --

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], keys: Sequence[Any]) -> list[Any]:
        from jax._src import source_info_util

        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = list(getattr(jaxpr, "consts", consts))
        env: dict[Any, Any] = {}
        key_of: dict[Any, Any] = {}
        for var, value in zip(getattr(inner, "constvars", ()), consts, strict=False):
            env[var] = value
        for var, value, key in zip(inner.invars, args, keys, strict=True):
            env[var] = value
            if key is not None:
                key_of[var] = key

        def read(atom: Any) -> Any:
            return atom.val if _is_literal(atom) else env[atom]

        for eqn in inner.eqns:
            values = [read(a) for a in eqn.invars]
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
                outs = self.equation(eqn, values, key_of)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for var, value in zip(eqn.outvars, outs, strict=True):
                if type(var).__name__ != "DropVar":
                    env[var] = value
        return [read(a) for a in inner.outvars]

    def equation(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        name = eqn.primitive.name
        params = eqn.params
        if name == "dma_start":
            self.dma_start(eqn, values, key_of)
        elif name == "dma_wait":
            self.dma_wait(eqn, values, key_of)
        elif id(eqn.primitive) in self.accesses and eqn.invars and key_of.get(eqn.invars[0]) in self.involved:
            self.access(eqn, values, key_of, self.accesses[id(eqn.primitive)])
        if name == "cond":
            return self.cond(eqn, values, key_of)
        if name == "while":
            return self.while_loop(eqn, values, key_of)
        if name == "scan":
            return self.scan(eqn, values, key_of)
        if name == "run_scoped":
            return self.run_scoped(eqn, values, key_of)
        if name in _CALLS and _sub_jaxprs(eqn) and self._touches(eqn, key_of):
            sub = _sub_jaxprs(eqn)[0]
            outs = self.run(sub, (), values, self._keys(eqn, key_of))
            return outs if eqn.primitive.multiple_results else outs[0]
        return eqn.primitive.bind(*values, **params)

    def body(self, jaxpr: Any, args: Sequence[Any], keys: Sequence[Any]) -> list[Any]:
        """A branch or loop body (the table is a ref: what the body does to it stays in it)."""
        return self.run(jaxpr, (), args, keys)

    def _keys(self, eqn: Any, key_of: dict[Any, Any]) -> list[Any]:
        return [None if _is_literal(v) else key_of.get(v) for v in eqn.invars]

    def _touches(self, eqn: Any, key_of: dict[Any, Any]) -> bool:
        """Whether a call's jaxpr has a DMA or an access to a DMA'd buffer (else bound as it is)."""
        return self._touches_jaxpr(_sub_jaxprs(eqn)[0], self._keys(eqn, key_of))

    def cond(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        from jax import lax

        if not any(self._touches_jaxpr(b, self._keys(eqn, key_of)[1:]) for b in eqn.params["branches"]):
            return eqn.primitive.bind(*values, **eqn.params)
        keys = self._keys(eqn, key_of)[1:]
        refs = _Split(values[1:], [isinstance(_aval(v), self.ref_type) for v in values[1:]])

        def branch(closed: Any) -> Callable[..., Any]:
            def run(*plain: Any) -> Any:
                return self.body(closed, refs.merge(plain), keys)

            return run

        outs = lax.switch(values[0], [branch(b) for b in eqn.params["branches"]], *refs.plain)
        return list(outs)

    def _touches_jaxpr(self, jaxpr: Any, keys: Sequence[Any]) -> bool:
        return has_dmas(jaxpr) or any(k in self.involved for k in keys if k is not None)

    def while_loop(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        from jax import lax

        p = eqn.params
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        keys = self._keys(eqn, key_of)
        body_keys = keys[n_cond : n_cond + n_body]
        if not self._touches_jaxpr(p["body_jaxpr"], body_keys):
            return eqn.primitive.bind(*values, **p)
        cond_consts, body_consts, init = values[:n_cond], values[n_cond : n_cond + n_body], values[n_cond + n_body :]
        cond_keys = keys[:n_cond]
        n_carry = len(init)

        def cond_fun(carry: Any) -> Any:
            return self.body(p["cond_jaxpr"], [*cond_consts, *carry], [*cond_keys, *([None] * n_carry)])[0]

        def body_fun(carry: Any) -> Any:
            return tuple(self.body(p["body_jaxpr"], [*body_consts, *carry], [*body_keys, *([None] * n_carry)]))

        return list(lax.while_loop(cond_fun, body_fun, tuple(init)))

    def scan(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        from jax import lax

        p = eqn.params
        keys = self._keys(eqn, key_of)
        n_consts, n_carry = _scan_counts(p)
        if not self._touches_jaxpr(p["jaxpr"], keys[:n_consts]):
            return eqn.primitive.bind(*values, **p)
        consts, init, xs = values[:n_consts], values[n_consts : n_consts + n_carry], values[n_consts + n_carry :]
        n_xs = len(xs)

        def body(carry: Any, x: Any) -> Any:
            outs = self.body(p["jaxpr"], [*consts, *carry, *x], [*keys[:n_consts], *([None] * (n_carry + n_xs))])
            return tuple(outs[:n_carry]), tuple(outs[n_carry:])

        carry, ys = lax.scan(
            body, tuple(init), tuple(xs), length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
        )
        return [*carry, *ys]

    def run_scoped(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        body = eqn.params["jaxpr"]
        alloc_keys = [("alloc", id(v)) for v in body.invars]
        if not all(k in self.hoisted for k in alloc_keys):
            return eqn.primitive.bind(*values, **eqn.params)
        # Its buffers are the kernel's scratch operands made for them: the body runs in line.
        allocated = [self.hoisted[k] for k in alloc_keys]
        return self.run(_OpenBody(body), (), [*values, *allocated], [*self._keys(eqn, key_of), *alloc_keys])

    # -- the table --

    def _buffer(self, key: Any) -> int:
        return self.buffer_ids[key]

    def _region(self, key: Any, transforms: Sequence[Any]) -> tuple[tuple[Any, int], ...]:
        """(first, length) per followed dimension of the region an access or DMA touches, each first
        as the kernel gave it (an int, or its traced value: the same index is the same object). A
        strided slice counts its span; an index array, a bitcast or a reshape the whole dimension."""

        shape = self.instrumented.buffers[self._buffer(key)].shape
        indexer_class = jax_state.nd_indexer_class()
        indexers = [t for t in transforms if indexer_class is not None and isinstance(t, indexer_class)]
        region: list[tuple[Any, int]] = [(0, n) for n in shape]
        ranges = checked_plain.compose(indexers) if len(indexers) > 1 and len(indexers) == len(transforms) else None
        if ranges is not None:
            region = [
                (offset, 1 if size is None else stride * (size - 1) + 1 if size else 0)
                for offset, stride, size in ranges
            ]
        elif indexers and len(indexers) == len(transforms):
            region = self._indexed(indexers[0], shape)
        region = region[:DIMS]
        return tuple(region + [(0, 1)] * (DIMS - len(region)))

    @staticmethod
    def _static(index: Any) -> Any:
        """An index as an int where it is one, else as the kernel's traced value (of any integer
        type: the same index is then the same object)."""
        import numpy as np

        return int(index) if isinstance(index, int | np.integer) and not isinstance(index, bool) else index

    def _indexed(self, indexer: Any, shape: tuple[int, ...]) -> list[tuple[Any, int]]:
        slice_class = jax_state.slice_class()
        region: list[tuple[Any, int]] = []
        for index, n in zip(indexer.indices, shape, strict=False):
            size, stride = getattr(index, "size", None), getattr(index, "stride", 1)
            is_slice = slice_class is not None and isinstance(index, slice_class)
            if is_slice and isinstance(size, int):
                region.append((self._static(index.start), stride * (size - 1) + 1 if size else 0))
            elif not is_slice and getattr(index, "shape", ()) == ():
                region.append((self._static(index), 1))
            else:
                region.append((0, n))
        return region

    def _box(self, key: Any, transforms: Sequence[Any]) -> list[tuple[Any, Any]]:
        """(first, end) per followed dimension: the region as the table holds it."""
        return _ends(self._region(key, transforms))

    @staticmethod
    def _accessed(eqn: Any, values: list[Any], how: jax_state.RefAccess) -> tuple[Any, ...] | None:
        """The transforms through which an access reaches its ref (None: this jax does not say)."""
        import jax

        tree = eqn.params.get(how.tree_param)
        if tree is None:
            return None
        if how.leading:
            operands: tuple[Any, ...] = (values[0], jax.tree_util.tree_unflatten(tree, values[how.leading :]))
        else:
            operands = tuple(jax.tree_util.tree_unflatten(tree, values))
        return tuple(next((t for role, _, t in checked_plain.indexed(operands) if role == 0), ()))

    def _load(self) -> Any:
        return self.table[...]

    def _store(self, table: Any) -> None:
        self.table[...] = table

    def begin_step(self) -> None:
        """At the first grid step the table starts empty (a scratch buffer starts undefined)."""
        from jax import lax

        first = functools.reduce(lax.bitwise_and, [lax.eq(i, _i32(0)) for i in self.step_ids], _true())
        table = self._load()
        self._store(lax.select(lax.broadcast(first, table.shape), lax.full_like(table, 0), table))

    def keep_across_steps(self, operand: Any, copy: Any) -> None:
        """``copy`` takes ``operand``'s values at the first grid step and keeps its own after."""
        from jax import lax

        first = functools.reduce(lax.bitwise_and, [lax.eq(i, _i32(0)) for i in self.step_ids], _true())
        now = copy[...]
        copy[...] = lax.select(lax.broadcast(first, now.shape), operand[...], now)

    def end_step(self) -> None:
        """At the end of each grid step: no DMA in flight into a block the pipeline copies; at the
        end of the last, none in flight at all. Then the one check of the step: the first race the
        table recorded, if any, fails it."""
        from jax import lax
        from jax.experimental import pallas as pl

        table = self._load()
        rows = _rows(table)
        in_flight = lax.eq(_field(rows, _STATE), _i32(_IN_FLIGHT))
        pipelined = [i for i, b in enumerate(self.instrumented.buffers) if b.pipelined]
        if pipelined:
            into_block = functools.reduce(lax.bitwise_or, [lax.eq(_field(rows, _DST), _i32(i)) for i in pipelined])
            table = self._record(table, lax.bitwise_and(in_flight, into_block), 9, None)
        last = functools.reduce(
            lax.bitwise_and,
            [lax.eq(i, lax.sub(_i32(pl.num_programs(axis)), _i32(1))) for axis, i in enumerate(self.step_ids)],
            _true(),
        )
        table = self._record(table, lax.bitwise_and(in_flight, lax.broadcast(last, (SLOTS,))), 8, None)
        self._store(table)
        finding = lax.slice_in_dim(table, SLOTS + 1, SLOTS + 3, axis=0)
        values = [lax.index_in_dim(finding, 0, 0, keepdims=False)]
        values = [lax.reshape(finding, (2 * FIELDS,)), *[lax.broadcast(_i32(i), (1,)) for i in self.step_ids]]
        vector = lax.concatenate(values, 0)
        message = _MARK + " " + " ".join("{}" for _ in range(2 * FIELDS + len(self.step_ids)))
        ok = lax.eq(lax.index_in_dim(vector, 0, 0, keepdims=False), _i32(0))
        checked_plain.check_vector(ok, message, vector)

    def _record(
        self, table: Any, hits: Any, kind: int, access: tuple[int, int, list[tuple[Any, Any]], int | None] | None
    ) -> Any:
        """``table`` with its finding rows set, where they hold none yet and any row ``hits``: the
        check point (what was checked where, known while tracing: ``Instrumented.points``) and the
        traced bounds of its region in one row, a copy of the first hit row's DMA in the next."""
        from jax import lax

        rows = _rows(table)
        found = lax.reduce_or(hits, (0,))
        # The first row hit: a min over the row numbers (cheaper to compile than an argmax).
        first = _min(lax.select(hits, lax.iota(_INT, SLOTS), lax.full((SLOTS,), SLOTS - 1, _INT)), 0)
        row = lax.dynamic_index_in_dim(rows, first, 0, keepdims=False)
        template: list[tuple[Any, Any]] = []
        traced: list[Any] = []
        if access is not None:
            for first, end in access[2]:
                template.append(tuple(v if isinstance(v, int) else None for v in (first, end)))  # type: ignore[arg-type]
                traced += [v for v in (first, end) if not isinstance(v, int)]
        self.instrumented.points.append(
            Point(
                kind, access[0] if access else -1, access[1] if access else -1, template, access[3] if access else None
            )
        )
        point = len(self.instrumented.points)
        parts = [lax.broadcast(_i32(v), (1,)) for v in (point, *traced)]
        parts.append(lax.full((FIELDS - len(parts),), 0, _INT))
        held, held_row = (lax.index_in_dim(table, SLOTS + k, 0, keepdims=False) for k in (1, 2))
        take = lax.bitwise_and(found, lax.eq(lax.index_in_dim(held, 0, 0, keepdims=False), _i32(0)))
        take = lax.broadcast(take, (FIELDS,))
        table = lax.dynamic_update_index_in_dim(table, lax.select(take, lax.concatenate(parts, 0), held), SLOTS + 1, 0)
        return lax.dynamic_update_index_in_dim(table, lax.select(take, row, held_row), SLOTS + 2, 0)

    def _hits(self, rows: Any, buffer: int, box: list[tuple[Any, Any]], field: int, box_field: int) -> Any:
        """Which rows hold a DMA in flight whose ``field`` buffer is ``buffer`` and whose box there
        overlaps ``box`` (a dimension the box covers whole, known while tracing, overlaps always)."""
        from jax import lax

        shape = self.instrumented.buffers[buffer].shape
        hit = lax.bitwise_and(lax.eq(_field(rows, _STATE), _i32(_IN_FLIGHT)), lax.eq(_field(rows, field), _i32(buffer)))
        for d, (first, end) in enumerate(box):
            if isinstance(first, int) and isinstance(end, int):
                if end <= first:
                    return lax.full((SLOTS,), False, "bool")
                if d >= len(shape) or (first <= 0 and end >= shape[d]):
                    continue
            their_first, their_end = _field(rows, box_field + 2 * d), _field(rows, box_field + 2 * d + 1)
            overlap = lax.bitwise_and(lax.lt(their_first, _i32(end)), lax.lt(_i32(first), their_end))
            hit = lax.bitwise_and(hit, overlap)
        return hit

    def access(self, eqn: Any, values: list[Any], key_of: dict[Any, Any], how: jax_state.RefAccess) -> None:
        from jax import lax

        key = key_of[eqn.invars[0]]
        transforms = self._accessed(eqn, values, how)
        if transforms is None:
            return
        box = self._box(key, transforms)
        buffer = self._buffer(key)
        site = self.instrumented.site(eqn)
        write = how.kind == "write"
        table = self._load()
        rows = _rows(table)
        hits = self._hits(rows, buffer, box, _DST, _DST_BOX)
        if write:  # its destination or its source: the finding's DMA row tells which
            hits = lax.bitwise_or(hits, self._hits(rows, buffer, box, _SRC, _SRC_BOX))
        self._store(self._record(table, hits, 2 if write else 1, (site, buffer, box, _DST_BOX)))

    def _dma_operands(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> tuple[Any, ...]:
        atoms = _unflatten(eqn)
        traced = _unflatten(eqn, values)
        if atoms is None or traced is None:
            raise Unsupported("a DMA the check cannot read")
        return atoms, traced

    def _sem_key(self, atom: Any, traced: Any, key_of: dict[Any, Any]) -> Any:
        from jax import lax

        key = key_of.get(atom.ref)
        if key is None:
            raise Unsupported("a DMA whose semaphore the check cannot place")
        buffer = self._buffer(key)
        shape = self.instrumented.buffers[buffer].shape
        index: Any = 0
        box = self._box(key, tuple(traced.transforms))
        stride = 1
        for d in reversed(range(min(len(shape), DIMS))):
            index = checked_plain.plus(index, checked_plain.times(box[d][0], stride))
            stride *= shape[d]
        return lax.add(lax.mul(_i32(buffer), _i32(1 << 16)), _i32(index))

    def dma_start(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        from jax import lax

        atoms, traced = self._dma_operands(eqn, values, key_of)
        src_key, dst_key = key_of.get(atoms[0].ref), key_of.get(atoms[1].ref)
        if src_key is None or dst_key is None:
            raise Unsupported("a DMA between buffers the check cannot place")
        src, dst = self._buffer(src_key), self._buffer(dst_key)
        src_box = self._box(src_key, tuple(traced[0].transforms))
        dst_box = self._box(dst_key, tuple(traced[1].transforms))
        site = self.instrumented.site(eqn)
        table = self._load()
        rows = _rows(table)
        # The DMA reads its source and writes its destination, concurrently with those in flight.
        reads_in_flight = self._hits(rows, src, src_box, _DST, _DST_BOX)
        table = self._record(table, reads_in_flight, 4, (site, src, src_box, _DST_BOX))
        # Into a region another DMA in flight writes or reads: the finding's DMA row tells which.
        writes = lax.bitwise_or(
            self._hits(rows, dst, dst_box, _DST, _DST_BOX), self._hits(rows, dst, dst_box, _SRC, _SRC_BOX)
        )
        table = self._record(table, writes, 5, (site, dst, dst_box, _DST_BOX))
        free = lax.eq(_field(rows, _STATE), _i32(_FREE))
        full = lax.bitwise_not(lax.reduce_or(free, (0,)))
        table = self._record(table, lax.broadcast(full, (SLOTS,)), 10, None)
        slot = lax.argmax(free, 0, _INT)
        counters = lax.index_in_dim(table, SLOTS, 0, keepdims=False)
        order = lax.index_in_dim(counters, 0, 0, keepdims=False)
        fields = [
            _IN_FLIGHT,
            order,
            self._sem_key(atoms[2], traced[2], key_of),
            _bytes(traced[1]),
            dst,
            src,
            site,
        ]
        for first, end in (*dst_box, *src_box):
            fields += [first, end]
        row = lax.concatenate([lax.broadcast(_i32(f), (1,)) for f in fields], 0)
        # A full table keeps its rows (the finding says the check could not follow the kernel).
        row = lax.select(lax.broadcast(full, (FIELDS,)), lax.dynamic_index_in_dim(rows, slot, 0, keepdims=False), row)
        table = lax.dynamic_update_index_in_dim(table, row, slot, 0)
        counters = lax.dynamic_update_index_in_dim(counters, lax.add(order, _i32(1)), 0, 0)
        self._store(lax.dynamic_update_index_in_dim(table, counters, SLOTS, 0))

    def dma_wait(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        from jax import lax

        atoms, traced = self._dma_operands(eqn, values, key_of)
        sem = self._sem_key(atoms[2], traced[2], key_of)
        wanted = _i32(_bytes(traced[1]))
        table = self._load()
        rows = _rows(table)
        state, order, amount = _field(rows, _STATE), _field(rows, _ORDER), _field(rows, _BYTES)
        zeros = lax.full((SLOTS,), 0, _INT)
        eligible = lax.bitwise_and(lax.ne(state, _i32(_FREE)), lax.eq(_field(rows, _SEM), sem))
        # The bytes of the eligible rows started before each row, in start order: a wait completes
        # the DMAs on its semaphore oldest first, as many as its byte count covers.
        earlier = lax.bitwise_and(
            lax.broadcast_in_dim(eligible, (SLOTS, SLOTS), (1,)),
            lax.lt(
                lax.broadcast_in_dim(order, (SLOTS, SLOTS), (1,)), lax.broadcast_in_dim(order, (SLOTS, SLOTS), (0,))
            ),
        )
        matrix_amount = lax.broadcast_in_dim(amount, (SLOTS, SLOTS), (1,))
        before = _sum(lax.select(earlier, matrix_amount, lax.full_like(matrix_amount, 0)), 1)
        used_here = lax.bitwise_and(eligible, lax.lt(before, lax.broadcast(wanted, (SLOTS,))))
        taken = lax.min(amount, lax.sub(lax.broadcast(wanted, (SLOTS,)), before))
        left = lax.select(used_here, lax.sub(amount, taken), amount)
        total = _sum(lax.select(eligible, amount, zeros), 0)
        site = self.instrumented.site(eqn)
        table = self._record_wait(table, lax.lt(total, wanted), site=site, traced=traced, atoms=atoms, key_of=key_of)
        new_state = lax.select(
            used_here, lax.select(lax.gt(left, zeros), lax.full((SLOTS,), _CREDIT, _INT), zeros), state
        )
        rows = _set_field(_set_field(rows, _STATE, new_state), _BYTES, left)
        self._store(lax.dynamic_update_slice_in_dim(table, rows, 0, 0))

    def _record_wait(
        self, table: Any, stuck: Any, *, site: int, traced: Any, atoms: Any, key_of: dict[Any, Any]
    ) -> Any:
        key = key_of.get(atoms[1].ref)
        if key is None:
            raise Unsupported("a DMA wait whose buffer the check cannot place")
        buffer = self._buffer(key)
        box = self._box(key, tuple(traced[1].transforms))
        from jax import lax

        return self._record(table, lax.broadcast(stuck, (SLOTS,)), 7, (site, buffer, box, None))


class _Undecided(Exception):
    """The DMAs in flight depend on values the trace does not know: the table follows them."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Row:
    """A DMA in flight (or, ``credit``, completed with bytes a wait has not used), known while tracing:
    its buffers and bytes, and its regions as (first, length) per followed dimension, each first an
    int or the traced index the kernel gave (compared by identity before by value)."""

    site: int
    dst: int
    src: int
    sem: tuple[int, tuple[Any, ...]]
    bytes: int
    dst_box: tuple[tuple[Any, int], ...]
    src_box: tuple[tuple[Any, int], ...]
    credit: bool = False


class _Decided(_Evaluator):
    """The check decided while tracing, for kernels whose DMAs in flight are the same whichever way
    the kernel runs: every branch and loop body leaves the DMAs in flight as it found them, every
    wait's semaphore is known while tracing, and no DMA crosses a grid step. Then what is in flight
    at each access is known, and only an access whose region overlaps a DMA's by traced indices
    gets a check, of those indices alone; a kernel that races for certain gets a check that fails
    there. Anything else raises ``_Undecided``, and the table follows the kernel instead."""

    rows: list[_Row]

    def begin_step(self) -> None:
        self.rows = []

    def keep_across_steps(self, operand: Any, copy: Any) -> None:
        raise _Undecided

    def end_step(self) -> None:
        if self.rows:
            raise _Undecided  # a DMA crosses the grid step (or a kernel leaves one in flight)

    def _overlap(self, buffer: int, a: tuple[tuple[Any, int], ...], b: tuple[tuple[Any, int], ...]) -> Any:
        """Whether two regions of ``buffer`` overlap: True, False or a traced bool."""
        from jax import lax

        shape = self.instrumented.buffers[buffer].shape
        traced: list[Any] = []
        for d, ((first_a, len_a), (first_b, len_b)) in enumerate(zip(a, b, strict=True)):
            if len_a <= 0 or len_b <= 0:
                return False
            if isinstance(first_a, int) and isinstance(first_b, int):
                if not (first_a < first_b + len_b and first_b < first_a + len_a):
                    return False
            elif first_a is first_b or (d < len(shape) and (_covers(a[d], shape[d]) or _covers(b[d], shape[d]))):
                continue
            else:
                ends_after = lax.lt(_i32(first_b), lax.add(_i32(first_a), _i32(len_a)))
                traced.append(lax.bitwise_and(lax.lt(_i32(first_a), lax.add(_i32(first_b), _i32(len_b))), ends_after))
        return functools.reduce(lax.bitwise_and, traced) if traced else True

    def _check(
        self, hit: Any, kind: int, *, site: int, buffer: int, region: Any, row: _Row | None, against: int | None
    ) -> None:
        """A check that fails where ``hit`` (True: wherever the kernel gets here), with the finding's
        facts laid out as the table's (``describe`` reads both)."""
        from jax import lax

        box = _ends(region)
        template = [tuple(v if isinstance(v, int) else None for v in pair) for pair in box]
        traced = [v for pair in box for v in pair if not isinstance(v, int)]
        self.instrumented.points.append(Point(kind, site, buffer, template, against))  # type: ignore[arg-type]
        recorded: list[Any] = [len(self.instrumented.points), *traced]
        recorded += [0] * (FIELDS - len(recorded))
        fields: list[Any] = [0] * FIELDS
        if row is not None:
            fields[_STATE], fields[_BYTES], fields[_DST], fields[_SRC], fields[_SITE] = (
                _IN_FLIGHT,
                row.bytes,
                row.dst,
                row.src,
                row.site,
            )
            for field, row_box in ((_DST_BOX, row.dst_box), (_SRC_BOX, row.src_box)):
                for d, (first, end) in enumerate(_ends(row_box)):
                    fields[field + 2 * d], fields[field + 2 * d + 1] = first, end
        values = [*recorded, *fields, *self.step_ids]
        vector = lax.concatenate([lax.broadcast(_i32(v), (1,)) for v in values], 0)
        ok = lax.full((), False, "bool") if hit is True else lax.bitwise_not(hit)
        message = _MARK + " " + " ".join("{}" for _ in values)
        checked_plain.check_vector(ok, message, vector)

    def _against_rows(self, kind: int, site: int, buffer: int, region: Any, *, dst: bool, src: bool) -> None:
        for row in self.rows:
            if row.credit:
                continue
            for touches, box in ((dst and row.dst == buffer, row.dst_box), (src and row.src == buffer, row.src_box)):
                if touches:
                    hit = self._overlap(buffer, region, box)
                    if hit is not False:
                        self._check(hit, kind, site=site, buffer=buffer, region=region, row=row, against=_DST_BOX)

    def access(self, eqn: Any, values: list[Any], key_of: dict[Any, Any], how: jax_state.RefAccess) -> None:
        transforms = self._accessed(eqn, values, how) if self.rows else None
        if transforms is None:
            return
        key = key_of[eqn.invars[0]]
        buffer, region = self._buffer(key), self._region(key, transforms)
        write = how.kind == "write"
        self._against_rows(2 if write else 1, self.instrumented.site(eqn), buffer, region, dst=True, src=write)

    def _sem(self, atom: Any, traced: Any, key_of: dict[Any, Any]) -> tuple[int, tuple[Any, ...]]:
        key = key_of.get(atom.ref)
        if key is None:
            raise Unsupported("a DMA whose semaphore the check cannot place")
        return self._buffer(key), tuple(first for first, _ in self._region(key, tuple(traced.transforms)))

    def dma_start(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        atoms, traced = self._dma_operands(eqn, values, key_of)
        src_key, dst_key = key_of.get(atoms[0].ref), key_of.get(atoms[1].ref)
        if src_key is None or dst_key is None:
            raise Unsupported("a DMA between buffers the check cannot place")
        if len(self.rows) >= SLOTS:
            raise _Undecided
        src, dst = self._buffer(src_key), self._buffer(dst_key)
        src_box = self._region(src_key, tuple(traced[0].transforms))
        dst_box = self._region(dst_key, tuple(traced[1].transforms))
        site = self.instrumented.site(eqn)
        self._against_rows(4, site, src, src_box, dst=True, src=False)
        self._against_rows(5, site, dst, dst_box, dst=True, src=True)
        sem = self._sem(atoms[2], traced[2], key_of)
        self.rows.append(_Row(site, dst, src, sem, _bytes(traced[1]), dst_box, src_box))

    def dma_wait(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        atoms, traced = self._dma_operands(eqn, values, key_of)
        sem = self._sem(atoms[2], traced[2], key_of)
        wanted = _bytes(traced[1])
        eligible = [row for row in self.rows if _same_sem(row.sem, sem)]
        # A wait completes the DMAs on its semaphore oldest first, as many as its byte count covers.
        before, rows = 0, []
        for row in self.rows:
            if row in eligible and before < wanted:
                left = row.bytes - min(row.bytes, wanted - before)
                before += row.bytes
                if left > 0:
                    rows.append(dataclasses.replace(row, bytes=left, credit=True))
            else:
                before += row.bytes if row in eligible else 0
                rows.append(row)
        if before < wanted:
            key = key_of.get(atoms[1].ref)
            if key is None:
                raise Unsupported("a DMA wait whose buffer the check cannot place")
            region = self._region(key, tuple(traced[1].transforms))
            self._check(
                True,
                7,
                site=self.instrumented.site(eqn),
                buffer=self._buffer(key),
                region=region,
                row=None,
                against=None,
            )
        self.rows = rows

    def body(self, jaxpr: Any, args: Sequence[Any], keys: Sequence[Any]) -> list[Any]:
        """A branch or loop body, which must leave the DMAs in flight as it found them."""
        rows = list(self.rows)
        outs = self.run(jaxpr, (), args, keys)
        if len(self.rows) != len(rows) or any(a is not b for a, b in zip(self.rows, rows, strict=True)):
            raise _Undecided
        return outs


def _covers(extent: tuple[Any, int], n: int) -> bool:
    first, length = extent
    return isinstance(first, int) and first <= 0 and first + length >= n


def _same_sem(a: tuple[int, tuple[Any, ...]], b: tuple[int, tuple[Any, ...]]) -> bool:
    """Whether two semaphores are the same one; ``_Undecided`` where only their traced indices tell."""
    if a[0] != b[0]:
        return False
    unknown = False
    for x, y in zip(a[1], b[1], strict=True):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif x is not y:
            unknown = True
    if unknown:
        raise _Undecided
    return True


_INT = "int32"


def _i32(value: Any) -> Any:
    import numpy as np
    from jax import lax

    if isinstance(value, int):
        return np.int32(value)
    return value if getattr(value, "dtype", None) == np.int32 else lax.convert_element_type(value, np.int32)


def _ends(region: Sequence[tuple[Any, int]]) -> list[tuple[Any, Any]]:
    """(first, end) of each (first, length), an index as int or int32."""

    return [
        (checked_plain.as_index(first), checked_plain.plus(checked_plain.as_index(first), length))
        for first, length in region
    ]


def _true() -> Any:
    import numpy as np

    return np.bool_(True)


def _rows(table: Any) -> Any:
    from jax import lax

    return lax.slice_in_dim(table, 0, SLOTS, axis=0)


def _field(rows: Any, field: int) -> Any:
    from jax import lax

    return lax.index_in_dim(rows, field, 1, keepdims=False)


def _set_field(rows: Any, field: int, column: Any) -> Any:
    from jax import lax

    return lax.dynamic_update_index_in_dim(rows, lax.broadcast_in_dim(column, (SLOTS, 1), (0,)), field, 1)


def _at(row: Any, field: int) -> Any:
    from jax import lax

    return lax.index_in_dim(row, field, 0, keepdims=False)


def _min(values: Any, axis: int) -> Any:
    import numpy as np
    from jax import lax

    return lax.reduce(values, np.int32(np.iinfo(np.int32).max), lax.min, (axis,))


def _sum(values: Any, axis: int) -> Any:
    import numpy as np
    from jax import lax

    return lax.reduce(values, np.int32(0), lax.add, (axis,))


class _Split:
    """Operands split into refs (closed over by a nested function) and values (passed to it)."""

    def __init__(self, values: Sequence[Any], is_ref: Sequence[bool]) -> None:
        self.values, self.is_ref = list(values), list(is_ref)
        self.plain = [v for v, r in zip(self.values, self.is_ref, strict=True) if not r]

    def merge(self, plain: Sequence[Any]) -> list[Any]:
        given = iter(plain)
        return [v if r else next(given) for v, r in zip(self.values, self.is_ref, strict=True)]


def _aval(value: Any) -> Any:
    import jax

    typeof = getattr(jax, "typeof", None) or getattr(jax.core, "get_aval", None)
    try:
        return typeof(value) if typeof is not None else getattr(value, "aval", None)
    except Exception:  # a jaxpr variable, not a value
        return getattr(value, "aval", None)


def _bytes(operand: _Viewed) -> int:
    """What a DMA moves, in bytes (a semaphore counts bytes on a TPU)."""
    import math

    import numpy as np

    shape = tuple(getattr(operand.view, "shape", ()) or ())
    try:
        itemsize = np.dtype(getattr(operand.view, "dtype", None)).itemsize
    except TypeError:
        itemsize = 4
    return int(math.prod(shape)) * int(itemsize)


# --- the finding ----------------------------------------------------------------------------------


def is_race(finding: str) -> bool:
    return finding.startswith(_MARK)


def describe(finding: str, instrumented: Instrumented) -> tuple[str, str]:
    """(what, the finding in words) from the check's message and its numbers."""
    numbers = [int(n) for n in finding[len(_MARK) :].split()]
    recorded, row, step = numbers[:FIELDS], numbers[FIELDS : 2 * FIELDS], numbers[2 * FIELDS :]
    point = instrumented.points[recorded[0] - 1]
    kind, against = point.kind, point.against
    if kind in (2, 5) and row[_DST] != point.buffer:  # the DMA's source it shares, not its destination
        kind, against = kind + 1, _SRC_BOX
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
        buffer = row[_DST]
        box = [(row[_DST_BOX + 2 * d], row[_DST_BOX + 2 * d + 1]) for d in range(DIMS)]

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
    dma = f"the DMA started at {site_text(row[_SITE])}"
    if kind == 7:
        text = f"the wait at {site_text(point.site)} on a DMA into {region()}{at_step}"
    elif kind in (8, 9, 10):
        text = f"{dma} into {region()}{at_step}"
    else:
        access = {1: "the read", 2: "the write", 3: "the write"}.get(kind, "the DMA")
        text = f"{access} at {site_text(point.site)} and {dma} both touch {region()}{at_step}"
    return what, text
