"""The table of DMAs in flight, and the evaluator that traces its reads and updates into a kernel.

The table is one more scratch buffer of the kernel (``SLOTS`` rows of int32 fields: state, start
order, semaphore, bytes, destination and source buffer and box), carried from grid step to grid
step. The evaluator replays the kernel's jaxpr equation by equation; around each DMA start and wait,
and before each access to a buffer some DMA touches, it reads the table, updates it, and adds a
check (``checked_plain.check_vector``) that fails on a race, with the facts as one int32 vector.
What those facts refer to by number (buffers, sites, points) is :class:`Instrumented`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from pallas_guard._checks import checked_plain
from pallas_guard._checks.dma_jaxpr import (
    CALLS,
    OpenBody,
    Viewed,
    Walk,
    aval,
    has_dmas,
    is_literal,
    scan_counts,
    sub_jaxprs,
    unflatten,
)
from pallas_guard._jax import state as jax_state

SLOTS = 64
"""The DMAs the table follows at once (a kernel with more in flight is a finding of its own kind,
said as such: the check cannot follow it)."""


DIMS = 4
"""The buffer dimensions a region is followed in; further dimensions count as overlapping."""


# The table's fields, per row.
STATE, _ORDER, _SEM, BYTES, DST, SRC, SITE = range(7)


DST_BOX = 7


SRC_BOX = DST_BOX + 2 * DIMS


FIELDS = SRC_BOX + 2 * DIMS


_FREE, IN_FLIGHT, _CREDIT = 0, 1, 2
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


MARK = "pallas_guard race"


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


class Evaluator(Walk):
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

    def each(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        """One equation, bound again in the kernel's trace at its own source line."""
        from jax._src import source_info_util

        with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
            return self.equation(eqn, values, key_of)

    def equation(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        name = eqn.primitive.name
        params = eqn.params
        if name in ("dma_start", "dma_wait") and self._moves_nothing(eqn, values, key_of):
            pass  # an empty copy completes as it starts (a TPU signals its zero bytes at once): nothing in flight
        elif name == "dma_start":
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
        if name in CALLS and sub_jaxprs(eqn) and self._touches(eqn, key_of):
            sub = sub_jaxprs(eqn)[0]
            outs = self.run(sub, (), values, self._keys(eqn, key_of))
            return outs if eqn.primitive.multiple_results else outs[0]
        return eqn.primitive.bind(*values, **params)

    def body(self, jaxpr: Any, args: Sequence[Any], keys: Sequence[Any]) -> list[Any]:
        """A branch or loop body (the table is a ref: what the body does to it stays in it)."""
        return self.run(jaxpr, (), args, keys)

    def _keys(self, eqn: Any, key_of: dict[Any, Any]) -> list[Any]:
        return [None if is_literal(v) else key_of.get(v) for v in eqn.invars]

    def _touches(self, eqn: Any, key_of: dict[Any, Any]) -> bool:
        """Whether a call's jaxpr has a DMA or an access to a DMA'd buffer (else bound as it is)."""
        return self._touches_jaxpr(sub_jaxprs(eqn)[0], self._keys(eqn, key_of))

    def cond(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        from jax import lax

        if not any(self._touches_jaxpr(b, self._keys(eqn, key_of)[1:]) for b in eqn.params["branches"]):
            return eqn.primitive.bind(*values, **eqn.params)
        keys = self._keys(eqn, key_of)[1:]
        refs = _Split(values[1:], [isinstance(aval(v), self.ref_type) for v in values[1:]])

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
        n_consts, n_carry = scan_counts(p)
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
        return self.run(OpenBody(body), (), [*values, *allocated], [*self._keys(eqn, key_of), *alloc_keys])

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
        return ends(self._region(key, transforms))

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

        first = functools.reduce(lax.bitwise_and, [lax.eq(i, i32(0)) for i in self.step_ids], _true())
        table = self._load()
        self._store(lax.select(lax.broadcast(first, table.shape), lax.full_like(table, 0), table))

    def keep_across_steps(self, operand: Any, copy: Any) -> None:
        """``copy`` takes ``operand``'s values at the first grid step and keeps its own after."""
        from jax import lax

        first = functools.reduce(lax.bitwise_and, [lax.eq(i, i32(0)) for i in self.step_ids], _true())
        now = copy[...]
        copy[...] = lax.select(lax.broadcast(first, now.shape), operand[...], now)

    def end_step(self) -> None:
        """At the end of each grid step: no DMA in flight into a block the pipeline copies; at the
        end of the last, none in flight at all."""
        from jax import lax
        from jax.experimental import pallas as pl

        rows = _rows(self._load())
        in_flight = lax.eq(_field(rows, STATE), i32(IN_FLIGHT))
        findings = []
        pipelined = [i for i, b in enumerate(self.instrumented.buffers) if b.pipelined]
        if pipelined:
            into_block = functools.reduce(lax.bitwise_or, [lax.eq(_field(rows, DST), i32(i)) for i in pipelined])
            findings.append(self._finding(rows, lax.bitwise_and(in_flight, into_block), 9, None))
        last = functools.reduce(
            lax.bitwise_and,
            [lax.eq(i, lax.sub(i32(pl.num_programs(axis)), i32(1))) for axis, i in enumerate(self.step_ids)],
            _true(),
        )
        findings.append(self._finding(rows, lax.bitwise_and(in_flight, lax.broadcast(last, (SLOTS,))), 8, None))
        self._check_first(findings)

    def _finding(
        self, rows: Any, hits: Any, kind: int, access: tuple[int, int, list[tuple[Any, Any]], int | None] | None
    ) -> tuple[Any, Any]:
        """(whether any row ``hits``, the finding's facts: its check point, then the first hit row's
        DMA)."""
        from jax import lax

        found = lax.reduce_or(hits, (0,))
        # The first row hit: a min over the row numbers (cheaper to compile than an argmax).
        first = _min(lax.select(hits, lax.iota(_INT, SLOTS), lax.full((SLOTS,), SLOTS - 1, _INT)), 0)
        site, buffer, box, against = access if access is not None else (-1, -1, [], None)
        return found, lax.concatenate([self._point(kind, site, buffer, box, against), _row(rows, first)], 0)

    def _point(self, kind: int, site: int, buffer: int, box: Sequence[tuple[Any, Any]], against: int | None) -> Any:
        """A finding's first ``FIELDS`` values, as int32: the number of its check point (what was
        checked where, known while tracing: ``Instrumented.points``), then the traced bounds of its
        region."""
        from jax import lax

        template = [(v if isinstance(v, int) else None, w if isinstance(w, int) else None) for v, w in box]
        traced = [v for pair in box for v in pair if not isinstance(v, int)]
        self.instrumented.points.append(Point(kind, site, buffer, template, against))
        parts = [lax.broadcast(i32(v), (1,)) for v in (len(self.instrumented.points), *traced)]
        parts.append(lax.full((FIELDS - len(parts),), 0, _INT))
        return lax.concatenate(parts, 0)

    def _check_first(self, findings: Sequence[tuple[Any, Any]]) -> None:
        """One check of an event (an access, a DMA's start or wait, a step's end) that fails with
        the first of its ``findings`` found, in the order given."""
        from jax import lax

        found, facts = findings[-1]
        for earlier, its_facts in reversed(findings[:-1]):
            facts = lax.select(lax.broadcast(earlier, facts.shape), its_facts, facts)
            found = lax.bitwise_or(earlier, found)
        self._fail_where(found, facts)

    def _fail_where(self, found: Any, facts: Any) -> None:
        """The check that fails where ``found``, with ``facts`` and the grid step as its values (what
        ``dma_races.describe`` reads)."""
        from jax import lax

        vector = lax.concatenate([facts, *[lax.broadcast(i32(i), (1,)) for i in self.step_ids]], 0)
        message = MARK + " " + " ".join("{}" for _ in range(vector.shape[0]))
        checked_plain.check_vector(lax.bitwise_not(found), message, vector)

    def _hits(self, rows: Any, buffer: int, box: list[tuple[Any, Any]], field: int, box_field: int) -> Any:
        """Which rows hold a DMA in flight whose ``field`` buffer is ``buffer`` and whose box there
        overlaps ``box`` (a dimension the box covers whole, known while tracing, overlaps always)."""
        from jax import lax

        shape = self.instrumented.buffers[buffer].shape
        hit = lax.bitwise_and(lax.eq(_field(rows, STATE), i32(IN_FLIGHT)), lax.eq(_field(rows, field), i32(buffer)))
        for d, (first, end) in enumerate(box):
            if isinstance(first, int) and isinstance(end, int):
                if end <= first:
                    return lax.full((SLOTS,), False, "bool")
                if d >= len(shape) or (first <= 0 and end >= shape[d]):
                    continue
            their_first, their_end = _field(rows, box_field + 2 * d), _field(rows, box_field + 2 * d + 1)
            overlap = lax.bitwise_and(lax.lt(their_first, i32(end)), lax.lt(i32(first), their_end))
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
        rows = _rows(self._load())
        hits = self._hits(rows, buffer, box, DST, DST_BOX)
        if write:  # its destination or its source: the finding's DMA row tells which
            hits = lax.bitwise_or(hits, self._hits(rows, buffer, box, SRC, SRC_BOX))
        self._check_first([self._finding(rows, hits, 2 if write else 1, (site, buffer, box, DST_BOX))])

    def _dma_operands(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> tuple[Any, ...]:
        atoms = unflatten(eqn)
        traced = unflatten(eqn, values)
        if atoms is None or traced is None:
            raise Unsupported("a DMA the check cannot read")
        return atoms, traced

    def _moves_nothing(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> bool:
        return bytes(self._dma_operands(eqn, values, key_of)[1][1]) == 0

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
        return lax.add(lax.mul(i32(buffer), i32(1 << 16)), i32(index))

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
        reads_in_flight = self._hits(rows, src, src_box, DST, DST_BOX)
        # Into a region another DMA in flight writes or reads: the finding's DMA row tells which.
        writes = lax.bitwise_or(
            self._hits(rows, dst, dst_box, DST, DST_BOX), self._hits(rows, dst, dst_box, SRC, SRC_BOX)
        )
        free = lax.eq(_field(rows, STATE), i32(_FREE))
        full = lax.bitwise_not(lax.reduce_or(free, (0,)))
        self._check_first(
            [
                self._finding(rows, reads_in_flight, 4, (site, src, src_box, DST_BOX)),
                self._finding(rows, writes, 5, (site, dst, dst_box, DST_BOX)),
                self._finding(rows, lax.broadcast(full, (SLOTS,)), 10, None),
            ]
        )
        slot = lax.argmax(free, 0, _INT)
        counters = lax.index_in_dim(table, SLOTS, 0, keepdims=False)
        order = lax.index_in_dim(counters, 0, 0, keepdims=False)
        fields = [
            IN_FLIGHT,
            order,
            self._sem_key(atoms[2], traced[2], key_of),
            bytes(traced[1]),
            dst,
            src,
            site,
        ]
        for first, end in (*dst_box, *src_box):
            fields += [first, end]
        row = lax.concatenate([lax.broadcast(i32(f), (1,)) for f in fields], 0)
        # A full table keeps its rows (the finding says the check could not follow the kernel).
        row = lax.select(lax.broadcast(full, (FIELDS,)), _row(rows, slot), row)
        table = _with_row(table, row, slot)
        counters = lax.dynamic_update_slice(counters, lax.broadcast(lax.add(order, i32(1)), (1,)), (i32(0),))
        self._store(_with_row(table, counters, SLOTS))

    def dma_wait(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        from jax import lax

        atoms, traced = self._dma_operands(eqn, values, key_of)
        sem = self._sem_key(atoms[2], traced[2], key_of)
        wanted = i32(bytes(traced[1]))
        table = self._load()
        rows = _rows(table)
        state, order, amount = _field(rows, STATE), _field(rows, _ORDER), _field(rows, BYTES)
        zeros = lax.full((SLOTS,), 0, _INT)
        eligible = lax.bitwise_and(lax.ne(state, i32(_FREE)), lax.eq(_field(rows, _SEM), sem))
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
        self._check_wait(rows, lax.lt(total, wanted), site=site, traced=traced, atoms=atoms, key_of=key_of)
        new_state = lax.select(
            used_here, lax.select(lax.gt(left, zeros), lax.full((SLOTS,), _CREDIT, _INT), zeros), state
        )
        rows = _set_field(_set_field(rows, STATE, new_state), BYTES, left)
        self._store(lax.dynamic_update_slice_in_dim(table, rows, 0, 0))

    def _check_wait(self, rows: Any, stuck: Any, *, site: int, traced: Any, atoms: Any, key_of: dict[Any, Any]) -> None:
        key = key_of.get(atoms[1].ref)
        if key is None:
            raise Unsupported("a DMA wait whose buffer the check cannot place")
        buffer = self._buffer(key)
        box = self._box(key, tuple(traced[1].transforms))
        from jax import lax

        self._check_first([self._finding(rows, lax.broadcast(stuck, (SLOTS,)), 7, (site, buffer, box, None))])


_INT = "int32"


def i32(value: Any) -> Any:
    import numpy as np
    from jax import lax

    if isinstance(value, int):
        return np.int32(value)
    return value if getattr(value, "dtype", None) == np.int32 else lax.convert_element_type(value, np.int32)


def ends(region: Sequence[tuple[Any, int]]) -> list[tuple[Any, Any]]:
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

    return lax.dynamic_update_slice(rows, lax.broadcast_in_dim(column, (SLOTS, 1), (0,)), (i32(0), i32(field)))


# Rows read and written with lax.dynamic_slice and dynamic_update_slice themselves: lax's
# *_index_in_dim helpers wrap each in a jitted call of its own (hundreds in a kernel's trace).


def _row(rows: Any, index: Any) -> Any:
    from jax import lax

    return lax.reshape(lax.dynamic_slice(rows, (i32(index), i32(0)), (1, FIELDS)), (FIELDS,))


def _with_row(table: Any, row: Any, index: Any) -> Any:
    from jax import lax

    return lax.dynamic_update_slice(table, lax.broadcast_in_dim(row, (1, FIELDS), (1,)), (i32(index), i32(0)))


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


def bytes(operand: Viewed) -> int:
    """What a DMA moves, in bytes (a semaphore counts bytes on a TPU)."""
    import math

    import numpy as np

    shape = tuple(getattr(operand.view, "shape", ()) or ())
    try:
        itemsize = np.dtype(getattr(operand.view, "dtype", None)).itemsize
    except TypeError:
        itemsize = 4
    return int(math.prod(shape)) * int(itemsize)
