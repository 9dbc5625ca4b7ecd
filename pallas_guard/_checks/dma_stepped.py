"""The race check decided by following the grid step by step, while lowering: for kernels whose
DMAs cross grid steps (a block prefetched at one step and waited at the next) but whose DMAs,
waits, branches and loops depend only on program ids, loop counters and constants.

``Decided`` follows one grid step symbolically, with the program ids traced, and gives up where a
DMA is in flight when the step ends. Here the kernel's jaxpr is evaluated once per grid point in
the plain interpreter's order, the program ids given as numbers: index arithmetic is computed, the
branch taken and the loop trip counts are known, and the DMAs in flight are carried from step to
step as ``Decided``'s rows. A value the kernel loads from a buffer is unknown. Where every grid step
is followed to the end and no access, DMA or wait ever meets a DMA in flight, no step of the
kernel races on its core: it needs no check at all (a race across cores is decided from the index
maps, apart). Anything else (an unknown value deciding a branch, a loop, a
DMA's region or an access that meets a DMA in flight; a possible race; too long a kernel to follow)
raises ``_Undecided``, and the table follows the kernel at run time, as it did: a race is always
found and described by the table."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from pallas_guard._checks.dma_decided import Decided, _Undecided
from pallas_guard._checks.dma_jaxpr import CALLS, OpenBody, scan_counts, sub_jaxprs
from pallas_guard._checks.dma_table import Instrumented
from pallas_guard._checks.on_numbers import UNKNOWN, in_numpy

BUDGET = 20_000
"""Equations evaluated over the whole grid, at most (about 10-20 us each): past it the table
follows the kernel, whose cost does not grow with the grid. A first step that, repeated, would pass
it stops there."""

_LARGEST = 64
"""A known value with more elements is not computed (unknown): the check needs indices, not data
(a kernel's zero-filled accumulator is not worth an eager computation of its own)."""


def race_free(
    jaxpr: Any,
    grid: Sequence[int],
    *,
    instrumented: Instrumented,
    involved: frozenset[Any],
    ref_type: type,
    hoisted_ids: dict[Any, int],
) -> bool:
    """Whether following every grid step shows the kernel's DMAs never race (True), or the table
    must follow it (False: undecided, or a kernel this evaluation fails on)."""
    stepped = Stepped(instrumented, involved, ref_type, hoisted_ids)
    sites = len(instrumented.sites)
    try:
        stepped.follow(jaxpr, grid)
    except (MemoryError, RecursionError):
        raise
    except Exception:  # _Undecided, or a kernel this evaluation cannot take
        return False
    finally:
        del instrumented.sites[sites:]
    return True


class Stepped(Decided):
    """``Decided``'s rows, carried across grid steps, with the kernel evaluated on numbers."""

    def follow(self, jaxpr: Any, grid: Sequence[int]) -> None:
        self.rows = []
        self.left = BUDGET
        self.grid = tuple(int(n) for n in grid)
        steps = math.prod(self.grid)
        if steps > BUDGET:  # every step evaluates an equation at least
            raise _Undecided
        refs = [v.aval for v in jaxpr.invars]  # a ref is its type here: it has no value
        for index, point in enumerate(itertools.product(*(range(n) for n in self.grid))):
            self.point = point
            self.run(jaxpr, (), refs, list(range(len(refs))))
            if index == 0 and (BUDGET - self.left) * steps > BUDGET:
                raise _Undecided  # as long a step each time would not fit: the table, without the wait
            self._end_of_step(last=index == steps - 1)

    def _end_of_step(self, *, last: bool) -> None:
        for row in self.rows:
            if row.credit:
                continue
            if last or self.instrumented.buffers[row.dst].pipelined:
                raise _Undecided  # in flight when the kernel ends, or when the pipeline copies its block

    # -- evaluation, on numbers --

    def constant(self, value: Any) -> Any:
        return _known(value)

    def literal(self, atom: Any) -> Any:
        return _literal(atom)

    def each(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _Undecided
        return self.equation(eqn, values, key_of)

    def equation(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        name = eqn.primitive.name
        if name in ("dma_start", "dma_wait") or (id(eqn.primitive) in self.accesses and eqn.invars):
            self._event(eqn, [_index(v) for v in values], key_of)  # indices as ints, as regions hold them
            return _unknowns(eqn)
        if name in ("program_id", "num_programs"):
            return _typed((self.point if name == "program_id" else self.grid)[eqn.params["axis"]], eqn)
        followed = _FOLLOWED.get(name)
        if followed is not None:
            return followed(self, eqn, values, key_of)
        if name in CALLS and sub_jaxprs(eqn):
            outs = self.run(sub_jaxprs(eqn)[0], (), values, self._keys(eqn, key_of))
            return outs if eqn.primitive.multiple_results else outs[0]
        if sub_jaxprs(eqn) and self._touches(eqn, key_of):
            raise _Undecided  # control flow this evaluation does not follow, around DMAs or their buffers
        return _evaluate(eqn, values)

    def _event(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> None:
        """A DMA's start or wait, or an access to a buffer a DMA touches, against the DMAs in flight."""
        name = eqn.primitive.name
        if name not in ("dma_start", "dma_wait"):
            if key_of.get(eqn.invars[0]) in self.involved:
                self.access(eqn, values, key_of, self.accesses[id(eqn.primitive)])
            return
        if any(v is UNKNOWN for v in values):
            raise _Undecided  # a region or semaphore known only when the kernel runs
        if not self._moves_nothing(eqn, values, key_of):
            (self.dma_start if name == "dma_start" else self.dma_wait)(eqn, values, key_of)

    def cond(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        branches = eqn.params["branches"]
        keys = self._keys(eqn, key_of)[1:]
        if values[0] is UNKNOWN:
            if any(self._touches_jaxpr(b, keys) for b in branches):
                raise _Undecided  # which branch runs is known only when the kernel runs
            return _unknowns(eqn)
        index = min(max(int(values[0]), 0), len(branches) - 1)
        return self.run(branches[index], (), values[1:], keys)

    def while_loop(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        p = eqn.params
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        keys = self._keys(eqn, key_of)
        cond_consts, body_consts, carry = values[:n_cond], values[n_cond : n_cond + n_body], values[n_cond + n_body :]
        cond_keys, body_keys = keys[:n_cond], keys[n_cond : n_cond + n_body]
        touches = self._touches_jaxpr(p["body_jaxpr"], body_keys)
        blank = [None] * len(carry)
        while True:
            go = self.run(p["cond_jaxpr"], (), [*cond_consts, *carry], [*cond_keys, *blank])[0]
            if go is UNKNOWN:
                if touches:
                    raise _Undecided  # how many times the loop runs is known only when the kernel runs
                return [UNKNOWN] * len(carry)
            if not bool(go):
                return carry
            carry = self.run(p["body_jaxpr"], (), [*body_consts, *carry], [*body_keys, *blank])

    def scan(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        p = eqn.params
        keys = self._keys(eqn, key_of)
        n_consts, n_carry = scan_counts(p)
        consts, carry, xs = values[:n_consts], values[n_consts : n_consts + n_carry], values[n_consts + n_carry :]
        length = int(p["length"])
        ys: list[list[Any]] = []
        blank = [None] * (len(carry) + len(xs))
        for step in range(length):
            i = length - 1 - step if p["reverse"] else step
            x = [UNKNOWN if v is UNKNOWN else _known(v[i]) for v in xs]
            outs = self.run(p["jaxpr"], (), [*consts, *carry, *x], [*keys[:n_consts], *blank])
            carry, y = outs[:n_carry], outs[n_carry:]
            ys.append(y)
        stacked = [UNKNOWN] * (len(eqn.outvars) - n_carry)
        if ys and all(all(v is not UNKNOWN for v in column) for column in zip(*ys, strict=True)):
            import numpy as np

            stacked = [_known(np.stack(column[::-1] if p["reverse"] else column)) for column in zip(*ys, strict=True)]
        return [*carry, *stacked]

    def run_scoped(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        body = eqn.params["jaxpr"]
        alloc_keys = [("alloc", id(v)) for v in body.invars]
        allocated = [v.aval for v in body.invars]
        return self.run(OpenBody(body), (), [*values, *allocated], [*self._keys(eqn, key_of), *alloc_keys])

    # -- what Decided checks: here, anything short of certain is left to the table --

    def _check(self, hit: Any, kind: int, **_: Any) -> None:
        raise _Undecided  # an access or DMA that meets a DMA in flight: the table says what it is

    def _overlap(self, buffer: int, a: tuple[tuple[Any, int], ...], b: tuple[tuple[Any, int], ...]) -> Any:
        if all(isinstance(first, int) for first, _ in (*a, *b)):
            return super()._overlap(buffer, a, b)
        raise _Undecided  # a region known only when the kernel runs, beside a DMA in flight

    def _sem(self, atom: Any, traced: Any, key_of: dict[Any, Any]) -> tuple[int, tuple[Any, ...]]:
        buffer, firsts = super()._sem(atom, traced, key_of)
        if not all(isinstance(first, int) for first in firsts):
            raise _Undecided
        return buffer, firsts


def _literal(atom: Any) -> Any:
    import numpy as np

    dtype = getattr(getattr(atom, "aval", None), "dtype", None)
    value = _known(atom.val)
    return value if value is UNKNOWN or dtype is None else np.asarray(value, dtype=dtype)


def _typed(number: int, eqn: Any) -> Any:
    import numpy as np

    return np.asarray(number, dtype=getattr(eqn.outvars[0].aval, "dtype", np.int32))


def _index(value: Any) -> Any:
    """A known integer scalar as an int (what a region holds); anything else as it is."""
    import numpy as np

    if isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
        return int(value)
    return value


_FOLLOWED = {
    "cond": Stepped.cond,
    "while": Stepped.while_loop,
    "scan": Stepped.scan,
    "run_scoped": Stepped.run_scoped,
}
"""Control flow followed on numbers: the branch taken, each iteration of a loop."""


def _unknowns(eqn: Any) -> Any:
    return [UNKNOWN] * len(eqn.outvars) if eqn.primitive.multiple_results else UNKNOWN


def _evaluate(eqn: Any, values: list[Any]) -> Any:
    """The equation's outputs where all its inputs are known and small, else unknown."""
    import numpy as np

    outs = eqn.outvars
    if not all(isinstance(v, np.ndarray) and v.size <= _LARGEST for v in values) or any(
        getattr(getattr(v, "aval", None), "size", _LARGEST + 1) > _LARGEST for v in outs
    ):
        return _unknowns(eqn)  # a value loaded from a buffer, a ref, or data
    computed = in_numpy(eqn, values)
    if computed is not None:
        return computed
    if eqn.primitive.name in ("pjit", "closed_call") or eqn.effects:
        return _unknowns(eqn)
    try:
        result = eqn.primitive.bind(*values, **eqn.params)
    except Exception:  # a primitive that only lowers inside a kernel
        return _unknowns(eqn)
    if eqn.primitive.multiple_results:
        return [_known(np.asarray(r)) for r in result]
    return _known(np.asarray(result))


def _known(value: Any) -> Any:
    """A value known while lowering, as a numpy array; unknown where it is not one (a tracer, a ref)."""
    import jax
    import numpy as np

    if value is UNKNOWN:
        return value
    if isinstance(value, int | float | bool | np.generic | np.ndarray):
        return np.asarray(value)
    if hasattr(value, "__array__") and not isinstance(value, jax.core.Tracer):
        if getattr(value, "size", _LARGEST + 1) > _LARGEST:
            return UNKNOWN  # data, not an index: not copied to the host
        return np.asarray(value)  # a constant: a jax array, or a literal's own array type
    return UNKNOWN
