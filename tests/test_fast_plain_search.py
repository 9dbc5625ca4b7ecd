"""A randomised search for kernels on which the guard's plain interpretation and JAX's plain
interpreter give different bits.

Each example is a Pallas kernel built from an op mix (transcendentals, sums prone to a fused
multiply-add, dots, reductions), a dtype, block and array shapes, and index maps that keep a block
still, move it with the grid, or revisit it; the outputs of the two interpreters are compared byte
for byte (NaN payloads included). XLA compiles a kernel's arithmetic by what it can prove about the
loop around it, so the search varies what the loop looks like to XLA: which operands change from one
step to the next, and how much of each operand a block covers.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from test_fast_plain import _both, needs_exact_xla

DTYPES = ("float16", "bfloat16", "float32", "int32")
BLOCKS = ((8, 128), (16, 128), (8, 256), (8, 8), (4, 16), (2, 4), (1, 8))
MAX_STEPS = 32  # keeps JAX's interpreter, quadratic in the data, quick on the largest arrays


@dataclasses.dataclass(frozen=True)
class Axis:
    """How an input's block index along one array axis follows the grid."""

    kind: str
    """'still' (the same block at every step), 'moving' (the grid index) or 'revisit' (the grid
    index modulo the number of blocks: earlier blocks read again)."""
    blocks: int
    """The input's number of blocks along this axis."""
    at: int = 0
    """For 'still': the block; otherwise the grid axis followed."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    dtype: str
    block: tuple[int, int]
    grid: tuple[int, ...]
    inputs: tuple[tuple[Axis, Axis], ...]
    terms: tuple[str, ...]
    """The output block is their sum, in order; 'a' and 'b' are the blocks of the first and the
    last input."""
    accumulate: bool = False
    """The output block is revisited along the last grid axis and accumulated (zeroed at its first
    step); otherwise it moves with every grid axis."""
    seed: int = 0


def _index(axis: Axis, grid: tuple[Any, ...]) -> Any:
    if axis.kind == "still":
        return axis.at
    if axis.kind == "moving":
        return grid[axis.at]
    return grid[axis.at] % axis.blocks


def _pallas_dot() -> Callable[..., Any] | None:
    """``pl.dot``, which later releases keep (only) in the Triton module."""
    try:
        from jax.experimental.pallas import triton

        return getattr(triton, "dot", None)
    except ImportError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return getattr(pl, "dot", None)


def _pl_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    dot = _pallas_dot()
    if dot is None or jnp.issubdtype(a.dtype, jnp.integer):  # Triton's dot is for floating point
        return jnp.dot(a, b.T) @ b
    return dot(dot(a, b, trans_b=True), b)


TRANSCENDENTAL: dict[str, Callable[[jax.Array], jax.Array]] = {
    "exp": jnp.exp,
    "log1p": lambda v: jnp.log1p(v * v),
    "tanh": jnp.tanh,
    "erf": jax.lax.erf,
}
ALGEBRAIC: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
    "a": lambda a, b, c: a,
    "fma": lambda a, b, c: a * b + a * a - b * c,
    "dot": lambda a, b, c: jnp.dot(jnp.dot(a, b.T), b),
    "pl.dot": lambda a, b, c: _pl_dot(a, b),
    "sum rows": lambda a, b, c: jnp.broadcast_to(jnp.sum(a * b, axis=1, keepdims=True), a.shape),
    "sum columns": lambda a, b, c: jnp.broadcast_to(jnp.sum(a * b, axis=0, keepdims=True), a.shape),
    "first row": lambda a, b, c: jnp.broadcast_to(b[:1] * c, a.shape),
}


TERMS = (*ALGEBRAIC, *TRANSCENDENTAL)


def _term(name: str, a: jax.Array, b: jax.Array, dtype: Any) -> jax.Array:
    exact = jnp.issubdtype(dtype, jnp.integer)
    if name in TRANSCENDENTAL:
        # An integer operand goes through float32 and back, scaled so that the result keeps digits.
        y = TRANSCENDENTAL[name](b.astype(jnp.float32) / 4 if exact else b)
        return (y * 64).astype(dtype) if exact else y
    return ALGEBRAIC[name](a, b, jnp.asarray(3 if exact else 0.5, dtype))


def _run(kernel: Kernel) -> Any:
    dtype = jnp.dtype(kernel.dtype)
    rows, cols = kernel.block
    rng = np.random.default_rng(kernel.seed)
    arrays = []
    for axes in kernel.inputs:
        shape = (axes[0].blocks * rows, axes[1].blocks * cols)
        values = rng.integers(-4, 5, shape) if dtype == jnp.int32 else rng.standard_normal(shape) * 2
        arrays.append(jnp.asarray(values, dtype))

    steps = kernel.grid
    moving_out = steps if not kernel.accumulate else steps[:-1]
    out_blocks = (*moving_out, 1, 1)[:2]

    def out_index(*grid: Any) -> tuple[Any, ...]:
        return (*grid[: len(moving_out)], 0, 0)[:2]

    def body(*refs: Any) -> None:
        *in_refs, o_ref = refs
        a, b = in_refs[0][...], in_refs[-1][...]
        total = _term(kernel.terms[0], a, b, dtype)
        for name in kernel.terms[1:]:
            total = total + _term(name, a, b, dtype)
        if not kernel.accumulate:
            o_ref[...] = total.astype(dtype)
            return

        @pl.when(pl.program_id(len(steps) - 1) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += total.astype(dtype)

    def call(*xs: jax.Array) -> jax.Array:
        return pl.pallas_call(
            body,
            out_shape=jax.ShapeDtypeStruct((out_blocks[0] * rows, out_blocks[1] * cols), dtype),
            grid=steps,
            in_specs=[
                pl.BlockSpec(kernel.block, functools.partial(lambda axes, *g: tuple(_index(x, g) for x in axes), axes))
                for axes in kernel.inputs
            ],
            out_specs=pl.BlockSpec(kernel.block, out_index),
            interpret=True,
        )(*xs)

    return jax.jit(call)(*arrays)


@st.composite
def kernels(draw: st.DrawFn) -> Kernel:
    grid = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=2)))
    if np.prod(grid) > MAX_STEPS:
        grid = (grid[0], MAX_STEPS // grid[0])

    def axis(dimension: int) -> Axis:
        kind = draw(st.sampled_from(("still", "moving", "revisit")))
        follows = draw(st.integers(0, len(grid) - 1)) if len(grid) > 1 else 0
        if kind == "moving":
            return Axis("moving", grid[follows], follows)
        if kind == "revisit":
            return Axis("revisit", draw(st.integers(1, max(1, grid[follows] - 1))), follows)
        blocks = draw(st.integers(1, 8))
        return Axis("still", blocks, draw(st.sampled_from((0, blocks - 1))))

    inputs = tuple((axis(0), axis(1)) for _ in range(draw(st.integers(1, 2))))
    return Kernel(
        dtype=draw(st.sampled_from(DTYPES)),
        block=draw(st.sampled_from(BLOCKS)),
        grid=grid,
        inputs=inputs,
        terms=tuple(draw(st.lists(st.sampled_from(TERMS), min_size=1, max_size=3))),
        accumulate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


MOVING, STILL = Axis("moving", 8), Axis("still", 8)
ONE_STILL = Axis("still", 1)


@needs_exact_xla
@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kernel=kernels(), bounds=st.booleans())
# A weight block at the same index at every step, in an operand larger than the block.
@example(
    kernel=Kernel("float16", (8, 128), (8,), ((MOVING, ONE_STILL), (STILL, ONE_STILL)), ("a", "log1p")), bounds=False
)
@example(kernel=Kernel("float32", (8, 128), (8,), ((MOVING, ONE_STILL), (STILL, ONE_STILL)), ("fma",)), bounds=False)
@example(kernel=Kernel("float32", (8, 128), (8,), ((MOVING, ONE_STILL), (STILL, ONE_STILL)), ("fma",)), bounds=True)
# The same weight as the whole operand: JAX's loop folds its write-back away.
@example(
    kernel=Kernel("float16", (8, 128), (8,), ((MOVING, ONE_STILL), (ONE_STILL, ONE_STILL)), ("a", "log1p")),
    bounds=False,
)
# A block that follows the grid over an operand of one block.
@example(
    kernel=Kernel("float32", (8, 128), (4,), ((MOVING, ONE_STILL), (Axis("revisit", 1), ONE_STILL)), ("fma", "exp")),
    bounds=False,
)
# An output block accumulated along the last grid axis, the matmul pattern.
@example(
    kernel=Kernel(
        "float32",
        (16, 128),
        (2, 4),
        ((Axis("moving", 2), Axis("moving", 4, 1)), (STILL, Axis("moving", 4, 1))),
        ("dot",),
        True,
    ),
    bounds=False,
)
# Steps that move a few hundred bytes: a loop XLA compiles as one small call (another code
# generator) once the write-backs are left out, where JAX's is not.
@example(kernel=Kernel("float16", (8, 8), (1, 2), ((Axis("moving", 1), Axis("still", 2)),), ("log1p",)), bounds=False)
@example(
    kernel=Kernel("float32", (1, 8), (3,), ((Axis("moving", 3), Axis("moving", 3)),), ("fma", "dot")), bounds=False
)
def test_generated_kernel_gives_the_bits_of_jax_plain_interpreter(
    kernel: Kernel, bounds: bool, guard: Callable[..., None]
) -> None:
    fast, shipped = _both(guard, functools.partial(_run, kernel), **({"checks": "bounds"} if bounds else {}))
    assert fast == shipped, kernel


def test_the_search_draws_every_pattern() -> None:
    """The strategy reaches each index-map kind, dtype and term (not only the explicit examples)."""
    seen: set[str] = set()

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(kernel=kernels())
    def collect(kernel: Kernel) -> None:
        seen.update(kernel.terms)
        seen.add(kernel.dtype)
        seen.update(axis.kind for axes in kernel.inputs for axis in axes)
        seen.add("accumulate" if kernel.accumulate else "moving output")

    collect()
    assert seen >= {*TERMS, *DTYPES, "still", "moving", "revisit", "accumulate", "moving output"}
