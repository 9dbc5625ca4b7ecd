"""The race check decided while tracing: where a kernel's DMAs in flight do not depend on its
values (started and waited within a grid step or loop iteration), the evaluator follows them as
rows known while tracing, and only an access whose overlap with a DMA in flight depends on traced
indices gets a check. A kernel this way cannot follow (``Undecided``) is followed grid step by grid
step (``dma_stepped``, on these rows), else gets the table."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from pallas_guard._checks.dma_table import (
    BYTES,
    DST,
    DST_BOX,
    FIELDS,
    IN_FLIGHT,
    SITE,
    SLOTS,
    SRC,
    SRC_BOX,
    STATE,
    Evaluator,
    Unsupported,
    bytes,
    ends,
    i32,
)
from pallas_guard._jax import state as jax_state


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


class Decided(Evaluator):
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
                ends_after = lax.lt(i32(first_b), lax.add(i32(first_a), i32(len_a)))
                traced.append(lax.bitwise_and(lax.lt(i32(first_a), lax.add(i32(first_b), i32(len_b))), ends_after))
        return functools.reduce(lax.bitwise_and, traced) if traced else True

    def _check(
        self, hit: Any, kind: int, *, site: int, buffer: int, region: Any, row: _Row | None, against: int | None
    ) -> None:
        """A check that fails where ``hit`` (True: wherever the kernel gets here), with the finding's
        facts laid out as the table's (``describe`` reads both)."""
        from jax import lax

        fields: list[Any] = [0] * FIELDS
        if row is not None:
            fields[STATE], fields[BYTES], fields[DST], fields[SRC], fields[SITE] = (
                IN_FLIGHT,
                row.bytes,
                row.dst,
                row.src,
                row.site,
            )
            for field, row_box in ((DST_BOX, row.dst_box), (SRC_BOX, row.src_box)):
                for d, (first, end) in enumerate(ends(row_box)):
                    fields[field + 2 * d], fields[field + 2 * d + 1] = first, end
        point = self._point(kind, site, buffer, ends(region), against)
        dma = lax.concatenate([lax.broadcast(i32(v), (1,)) for v in fields], 0)
        self._fail_where(lax.full((), True, "bool") if hit is True else hit, lax.concatenate([point, dma], 0))

    def _against_rows(self, kind: int, site: int, buffer: int, region: Any, *, dst: bool, src: bool) -> None:
        for row in self.rows:
            if row.credit:
                continue
            for touches, box in ((dst and row.dst == buffer, row.dst_box), (src and row.src == buffer, row.src_box)):
                if touches:
                    hit = self._overlap(buffer, region, box)
                    if hit is not False:
                        self._check(hit, kind, site=site, buffer=buffer, region=region, row=row, against=DST_BOX)

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
        self.rows.append(_Row(site, dst, src, sem, bytes(traced[1]), dst_box, src_box))

    def dma_wait(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        atoms, traced = self._dma_operands(eqn, values, key_of)
        sem = self._sem(atoms[2], traced[2], key_of)
        wanted = bytes(traced[1])
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
