"""Index arithmetic on numbers, while lowering, as lax computes it.

What the checks decide before a kernel runs, they decide by computing its index arithmetic on
numbers: the race check follows the grid step by step (``dma_stepped``), the bounds check computes
where each block starts at every grid step at once (an index map's arithmetic on arrays of program
ids). Integer operations are computed in numpy with lax's results bit for bit (C's division and
remainder, wrapping on overflow); anything else is unknown here, and left to the check at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pallas_guard._checks.dma_jaxpr import CALLS, Walk, sub_jaxprs


class _Unknown:
    def __repr__(self) -> str:
        return "unknown"


UNKNOWN: Any = _Unknown()
"""A value known only when the kernel runs (loaded from a buffer, a ref, data)."""


GRID_POINTS = 1 << 20
"""The most grid points an index map is computed at while lowering (a few int32 arrays this long):
a longer grid is left to the checks made as the kernel runs, or not judged."""


def at_every_step(index_map: Any, grid: Any) -> list[Any] | None:
    """The block indices ``index_map`` (a closed jaxpr: program ids in, then any scalar-prefetch
    operands) gives at every point of ``grid``, each an integer array of the grid's shape: its
    arithmetic in numpy, every point at once, or JAX's own evaluation where numpy does not take a
    map of program ids alone. None where the grid is sized when the kernel runs or is longer than
    ``GRID_POINTS``, or a block index depends on what the kernel is given (a scalar-prefetch value)."""
    import math

    import numpy as np

    grid = tuple(grid) if isinstance(grid, tuple | list) else None
    invars = getattr(getattr(index_map, "jaxpr", index_map), "invars", None)
    if grid is None or invars is None or not all(isinstance(n, int) for n in grid) or len(invars) < len(grid):
        return None
    if math.prod(grid) > GRID_POINTS:
        return None
    rank = len(grid)
    steps = [
        np.arange(n, dtype=np.int32).reshape([n if a == axis else 1 for a in range(rank)])
        for axis, n in enumerate(grid)
    ]
    try:
        indices = evaluate(index_map, [*steps, *[UNKNOWN] * (len(invars) - rank)])
        if any(index is UNKNOWN for index in indices) and len(invars) == rank:
            indices = _in_jax(index_map, grid)
    except Exception:  # a map neither evaluation takes: left to the check as the kernel runs
        return None
    if not all(isinstance(i, np.ndarray) and np.issubdtype(i.dtype, np.integer) for i in indices):
        return None
    return [np.broadcast_to(index, grid) for index in indices]


def _in_jax(index_map: Any, grid: tuple[int, ...]) -> list[Any]:
    import functools

    import jax
    import numpy as np

    points = np.indices(grid, dtype=np.int32).reshape(len(grid), -1)
    with jax.ensure_compile_time_eval():  # numbers, also where a kernel is being traced
        evaluated = jax.vmap(functools.partial(jax.core.eval_jaxpr, index_map.jaxpr, index_map.consts))(*points)
    return [np.asarray(index).reshape(grid) for index in evaluated]


def evaluate(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    """The outputs of a jaxpr of integer arithmetic (an index map) on numpy arrays, which may hold
    every grid step at once (they broadcast); UNKNOWN where an output is not computed here."""
    import numpy as np

    given = [np.asarray(a) if isinstance(a, np.generic) else a for a in args]
    return _OnNumbers().run(jaxpr, (), given, [None] * len(given))


class _OnNumbers(Walk):
    def constant(self, value: Any) -> Any:
        import numpy as np

        return np.asarray(value) if isinstance(value, np.ndarray | np.generic | int) else UNKNOWN

    def literal(self, atom: Any) -> Any:
        import numpy as np

        dtype = getattr(getattr(atom, "aval", None), "dtype", None)
        return UNKNOWN if dtype is None else np.asarray(atom.val, dtype=dtype)

    def each(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        import numpy as np

        outs: Any = None
        if eqn.primitive.name in CALLS and sub_jaxprs(eqn):
            outs = evaluate(sub_jaxprs(eqn)[0], values)
        elif all(isinstance(v, np.ndarray) for v in values) and not eqn.primitive.multiple_results:
            outs = in_numpy(eqn, values)
        if outs is None:
            return [UNKNOWN] * len(eqn.outvars) if eqn.primitive.multiple_results else UNKNOWN
        return outs


# Integer index arithmetic in numpy, as lax computes it (numpy wraps on overflow, as lax does).
_NUMPY = {
    "add": "add",
    "sub": "subtract",
    "mul": "multiply",
    "neg": "negative",
    "max": "maximum",
    "min": "minimum",
    "eq": "equal",
    "ne": "not_equal",
    "lt": "less",
    "le": "less_equal",
    "gt": "greater",
    "ge": "greater_equal",
    "and": "bitwise_and",
    "or": "bitwise_or",
    "not": "invert",
    "xor": "bitwise_xor",
    "abs": "abs",
    "sign": "sign",
}

_SAME = frozenset({"multiple_of"})
"""Primitives whose output is their input (a hint to the compiler)."""


def in_numpy(eqn: Any, values: list[Any]) -> Any:
    """Integer index arithmetic computed in numpy, as lax computes it; None for anything else."""
    import numpy as np

    name = eqn.primitive.name
    dtype = getattr(getattr(eqn.outvars[0], "aval", None), "dtype", None) if eqn.outvars else None
    if dtype is None or not all(np.issubdtype(v.dtype, np.integer) or v.dtype == np.bool_ for v in values):
        return None
    if name in _NUMPY or name in _SAME:
        return values[0] if name in _SAME else np.asarray(getattr(np, _NUMPY[name])(*values), dtype=dtype)
    if name in ("rem", "div") and np.all(values[1] != 0) and all(v.dtype.itemsize <= 4 for v in values):
        # lax's integer division and remainder truncate toward zero (C's), not numpy's floor; in 64
        # bits, where no absolute value of 32 overflows.
        a, b = values[0].astype(np.int64), values[1].astype(np.int64)
        quotient = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))
        return np.asarray(quotient if name == "div" else a - quotient * b).astype(dtype)
    if name in ("select_n", "clamp"):
        if name == "clamp":  # lax.clamp(low, x, high)
            chosen = np.minimum(np.maximum(values[1], values[0]), values[2])
        else:
            chosen = np.choose(values[0].astype(np.int32), values[1:])
        return np.asarray(chosen, dtype=dtype)
    if name == "convert_element_type" and np.issubdtype(np.dtype(eqn.params["new_dtype"]), np.integer):
        return values[0].astype(eqn.params["new_dtype"])
    return None
