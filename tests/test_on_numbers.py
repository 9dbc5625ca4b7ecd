"""Index arithmetic computed on numbers while lowering, held to lax's primitives bit for bit.

The race check follows grid steps on numbers and the bounds check computes where every block
starts at every grid step at once; both skip a check only where these numbers say it cannot fail,
so each must be what lax computes: on int32's edges (INT_MIN, -1, 0, INT_MAX ...), one value at a
time and a whole grid at once, and an index map evaluated over its grid against JAX's own.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_guard._checks import on_numbers

_EDGES = np.array([-(2**31), -(2**31) + 1, -7, -3, -1, 0, 1, 2, 3, 7, 2**31 - 1], np.int32)
_BINARY = ["add", "sub", "mul", "div", "rem", "max", "min", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor"]


def _defined(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where lax defines the operation (division by 0 and INT_MIN / -1 are left to the primitive)."""
    if op not in ("div", "rem"):
        return np.ones(np.broadcast(a, b).shape, bool)
    return (b != 0) & ~((a == -(2**31)) & (b == -1))


@pytest.mark.parametrize("op", _BINARY)
def test_binary_index_arithmetic_is_lax_s_bit_for_bit(op: str) -> None:
    function = getattr(lax, {"and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor"}.get(op, op))
    [eqn] = jax.make_jaxpr(function)(np.int32(0), np.int32(1)).jaxpr.eqns
    for a, b in itertools.product(_EDGES, _EDGES):
        if not _defined(op, a, b):
            continue
        values = [np.asarray(a), np.asarray(b)]
        mine = on_numbers.in_numpy(eqn, values)
        assert mine is not None, op
        want = np.asarray(eqn.primitive.bind(*values, **eqn.params))
        assert mine.dtype == want.dtype and mine.tobytes() == want.tobytes(), (op, a, b, mine, want)
    # Every pair at once, as the bounds check computes a whole grid.
    a, b = np.repeat(_EDGES, len(_EDGES)), np.tile(_EDGES, len(_EDGES))
    a, b = a[_defined(op, a, b)], b[_defined(op, a, b)]
    [eqn] = jax.make_jaxpr(function)(a, b).jaxpr.eqns
    mine = on_numbers.in_numpy(eqn, [a, b])
    want = np.asarray(eqn.primitive.bind(a, b, **eqn.params))
    assert mine.dtype == want.dtype and mine.tobytes() == want.tobytes(), op


def test_select_clamp_convert_and_unary_index_arithmetic_is_lax_s_bit_for_bit() -> None:
    edges = _EDGES
    cases = [
        (lax.select, (edges % 2 == 0, edges, ~edges)),
        (lax.clamp, (np.int32(-3), edges, np.int32(7))),
        (lax.clamp, (edges, edges[::-1], np.full_like(edges, 7))),
        (lambda x: lax.convert_element_type(x, np.int8), (edges,)),
        (lambda x: lax.convert_element_type(x, np.uint32), (edges,)),
        (lax.neg, (edges,)),
        (lax.abs, (edges,)),
        (lax.sign, (edges,)),
        (lax.bitwise_not, (edges,)),
    ]
    for function, example in cases:
        [eqn] = jax.make_jaxpr(function)(*example).jaxpr.eqns
        arrays = [np.asarray(v) for v in example]
        for one in range(len(edges)):  # one value at a time, then all at once
            values = [v[one] if v.ndim else v for v in arrays]
            mine = on_numbers.in_numpy(eqn, values)
            assert mine is not None, eqn
            want = np.asarray(eqn.primitive.bind(*values, **eqn.params))
            assert mine.dtype == want.dtype and mine.tobytes() == want.tobytes(), (eqn, values, mine, want)
        mine = on_numbers.in_numpy(eqn, arrays)
        want = np.asarray(eqn.primitive.bind(*arrays, **eqn.params))
        assert mine.dtype == want.dtype and mine.tobytes() == want.tobytes(), eqn


def _index_maps() -> list[tuple[str, object]]:
    return [
        ("identity", lambda i, j: (i, j)),
        ("constant", lambda i, j: (0, 3)),
        ("jnp arithmetic", lambda i, j: (jnp.minimum(i + 1, 4) // 2, (j * 3 - 5) % 4)),
        ("where", lambda i, j: (jnp.where(i < j, i, j), jnp.maximum(j - i, 0))),
        ("lax", lambda i, j: (lax.div(i - 7, 3), lax.rem(j - 2, 3))),
        ("clamp", lambda i, j: (lax.clamp(1, i * j, 9), j)),
    ]


@pytest.mark.parametrize("name,index_map", _index_maps(), ids=[n for n, _ in _index_maps()])
def test_an_index_map_over_a_whole_grid_at_once_is_jax_s_at_each_step(name: str, index_map: object) -> None:
    grid = (5, 7)
    closed = jax.make_jaxpr(index_map)(np.int32(0), np.int32(0))
    steps = [np.arange(n, dtype=np.int32).reshape([n if a == k else 1 for a in range(2)]) for k, n in enumerate(grid)]
    computed = on_numbers.evaluate(closed, steps)
    assert all(value is not on_numbers.UNKNOWN for value in computed), name
    for i, j in itertools.product(range(grid[0]), range(grid[1])):
        want = jax.jit(index_map)(np.int32(i), np.int32(j))
        for value, expected in zip(computed, want, strict=True):
            at = np.broadcast_to(value, grid)[i, j]
            assert at == int(expected), (name, i, j, at, expected)


def test_an_index_map_that_reads_a_prefetched_value_is_unknown_while_lowering() -> None:
    def index_map(i, ref):  # type: ignore[no-untyped-def]
        return (ref[i], i)

    from jax._src.state.types import AbstractRef  # what an index map's scalar-prefetch operand is

    ref = AbstractRef(jax.core.ShapedArray((4,), jnp.int32))
    closed = jax.make_jaxpr(index_map)(np.int32(0), ref)
    first, second = on_numbers.evaluate(closed, [np.arange(4, dtype=np.int32), on_numbers.UNKNOWN])
    assert first is on_numbers.UNKNOWN
    assert np.array_equal(second, np.arange(4))


@pytest.mark.parametrize("name,index_map", [*_index_maps(), ("float", lambda i, j: ((i / 2).astype(jnp.int32), j))])
def test_an_index_map_at_every_step_is_jax_s_whichever_evaluation_takes_it(name: str, index_map: object) -> None:
    """Numpy where it takes the map; JAX's own evaluation where it does not (float arithmetic)."""
    grid = (3, 5)
    closed = jax.make_jaxpr(index_map)(np.int32(0), np.int32(0))
    at_steps = on_numbers.at_every_step(closed, grid)
    assert at_steps is not None and all(a.shape == grid for a in at_steps)
    in_numpy = on_numbers.evaluate(closed, [np.int32(1), np.int32(2)])
    assert (on_numbers.UNKNOWN in in_numpy) == (name == "float"), name  # JAX's evaluation only for that one
    for i, j in itertools.product(range(grid[0]), range(grid[1])):
        want = jax.jit(index_map)(np.int32(i), np.int32(j))
        assert [int(a[i, j]) for a in at_steps] == [int(w) for w in want], (name, i, j)


def test_no_index_map_is_computed_over_a_grid_sized_at_run_time_or_too_long() -> None:
    closed = jax.make_jaxpr(lambda i: (i,))(np.int32(0))
    assert on_numbers.at_every_step(closed, (on_numbers.GRID_POINTS + 1,)) is None
    assert on_numbers.at_every_step(closed, (object(),)) is None
    assert on_numbers.at_every_step(closed, (4,)) is not None
