"""The guard's plain interpretation: blocks of operands a kernel never writes are not written back
at each grid step, and every output is bit for bit what JAX's plain interpreter gives."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from ops_corpus import Case, cases

import pallas_guard


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _both(guard: Callable[..., None], run: Callable[[], Any], **settings: Any) -> tuple[list[bytes], list[bytes]]:
    """(the guard's plain interpretation, JAX's plain interpreter as it ships), each compiled afresh."""
    found = {}
    for fast in (True, False):
        guard("interpret", fast_plain=fast, **settings)
        jax.clear_caches()
        found[fast] = _bits(jax.block_until_ready(run()))
    return found[True], found[False]


# --- kernels of our own, written with interpret=True or for a GPU/TPU ----------------------------


def elementwise(x: jax.Array, y: jax.Array, *, interpret: bool = True) -> jax.Array:
    def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = 2 * x_ref[...] + y_ref[...]

    spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8,),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=interpret,
    )(x, y)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """The output block is revisited along k, accumulated in place."""

    def kernel(a_ref, b_ref, o_ref):  # type: ignore[no-untyped-def]
        @pl.when(pl.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    m, k = a.shape
    n = b.shape[1]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // 16, n // 16, k // 16),
        in_specs=[pl.BlockSpec((16, 16), lambda i, j, kk: (i, kk)), pl.BlockSpec((16, 16), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((16, 16), lambda i, j, kk: (i, j)),
    )(a, b)


def row_reduction(x: jax.Array, w: jax.Array) -> jax.Array:
    """Every step reads the same weight block; the rows are summed in a loop over the block."""

    def kernel(x_ref, w_ref, o_ref):  # type: ignore[no-untyped-def]
        def body(c, acc):  # type: ignore[no-untyped-def]
            return acc + x_ref[:, pl.ds(c * 8, 8)] * w_ref[:, pl.ds(c * 8, 8)]

        acc = jax.lax.fori_loop(0, x.shape[1] // 8, body, jnp.zeros((4, 8), x.dtype))
        o_ref[...] = jnp.sum(acc, axis=1, keepdims=True)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), x.dtype),
        grid=(x.shape[0] // 4,),
        in_specs=[pl.BlockSpec((4, x.shape[1]), lambda i: (i, 0)), pl.BlockSpec((1, w.shape[1]), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((4, 1), lambda i: (i, 0)),
    )(x, w)


def gather(indices: jax.Array, table: jax.Array) -> jax.Array:
    """Scalar prefetch: each step copies in the table row its index names."""

    def kernel(idx_ref, t_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = t_ref[...] * 3

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(indices.shape[0],),
        in_specs=[pl.BlockSpec((1, table.shape[1]), lambda i, idx: (idx[i], 0))],
        out_specs=pl.BlockSpec((1, table.shape[1]), lambda i, idx: (i, 0)),
    )
    return pl.pallas_call(
        kernel,
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((indices.shape[0], table.shape[1]), table.dtype),
        interpret=True,
    )(indices, table)


def in_place(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x`` aliased to the output and updated block by block; ``y`` only read."""

    def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] * y_ref[...] + 1

    spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8,),
        in_specs=[spec, spec],
        out_specs=spec,
        input_output_aliases={0: 0},
    )(x, y)


def aliased_reading_back(x: jax.Array, *, writes: str) -> jax.Array:
    """``x`` aliased to the output; step ``i`` reads the block step ``i - 1`` wrote, so whether a
    write through one ref of the pair is seen through the other shows in the result. ``writes``
    names the refs the kernel writes: the output, the input, or both."""
    steps = x.shape[0] // 8

    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        previous = x_ref[...] * 2 + 1
        if writes in ("output", "both"):
            o_ref[...] = previous
        if writes in ("input", "both"):
            x_ref[...] = previous - 3

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(steps,),
        in_specs=[pl.BlockSpec((8, x.shape[1]), lambda i: ((i + steps - 1) % steps, 0))],
        out_specs=pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0)),
        input_output_aliases={0: 0},
    )(x)


def ragged(x: jax.Array) -> jax.Array:
    """A last block that overhangs the array: the interpreter pads it."""

    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] - 1

    spec = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(x.shape[0], 8),),
        in_specs=[spec],
        out_specs=spec,
    )(x)


def _rand(seed: int, *shape: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


OWN: dict[str, Callable[[], Any]] = {
    "elementwise": lambda: elementwise(_rand(0, 64, 128), _rand(1, 64, 128)),
    "elementwise under jit": lambda: jax.jit(elementwise)(_rand(0, 64, 128), _rand(1, 64, 128)),
    "matmul": lambda: matmul(_rand(2, 32, 48), _rand(3, 48, 32)),
    "row reduction": lambda: row_reduction(_rand(4, 16, 32), _rand(5, 1, 32)),
    "scalar-prefetch gather": lambda: gather(jnp.array([3, 0, 3, 1, 2], jnp.int32), _rand(6, 4, 128)),
    "aliased in place": lambda: jax.jit(in_place)(_rand(7, 32, 128), _rand(8, 32, 128)),
    "aliased in place, eager": lambda: in_place(_rand(7, 32, 128), _rand(8, 32, 128)),
    "ragged last block": lambda: ragged(_rand(9, 29, 128)),
    **{
        f"aliased, {writes} written, read back": functools.partial(
            lambda writes: jax.jit(functools.partial(aliased_reading_back, writes=writes))(_rand(10, 32, 128)), writes
        )
        for writes in ("output", "input", "both")
    },
    "aliased, output written, read back, eager": lambda: aliased_reading_back(_rand(10, 32, 128), writes="output"),
}


@pytest.mark.parametrize("name", list(OWN))
def test_own_kernel_gives_the_bits_of_jax_plain_interpreter(name: str, guard: Callable[..., None]) -> None:
    fast, shipped = _both(guard, OWN[name])
    assert fast == shipped


@pytest.mark.parametrize("name", ["elementwise", "matmul", "aliased in place", "ragged last block"])
def test_own_kernel_under_the_bounds_check_gives_the_same_bits(name: str, guard: Callable[..., None]) -> None:
    fast, shipped = _both(guard, OWN[name], checks="bounds")
    assert fast == shipped


def _exact_here() -> bool:
    from pallas_guard._jax import lookup as jax_lookup
    from pallas_guard._running import plain as _plain

    return jax_lookup.jax_release() >= _plain.EXACT_FROM


needs_exact_xla = pytest.mark.skipif(
    not _exact_here(), reason="below the release the fast path applies from, the plain interpreter runs as shipped"
)


def _plain_corpus() -> list[Any]:
    return [pytest.param(c, id=c.name) for c in cases() if not c.xfail and c.expected == "plain"]


@pytest.mark.parametrize("case", _plain_corpus())
def test_shipped_kernel_gives_the_bits_of_jax_plain_interpreter(case: Case, guard: Callable[..., None]) -> None:
    if case.skip_reason() or case.devices > len(jax.devices("cpu")):
        pytest.skip(case.skip_reason() or "needs more CPU devices")
    fast, shipped = _both(guard, case.run, device=case.device)
    assert fast == shipped


def _write_backs(guard: Callable[..., None], fast: bool) -> int:
    guard("interpret", fast_plain=fast)
    jax.clear_caches()
    x = jnp.zeros((64, 128), jnp.float32)
    text = jax.jit(functools.partial(elementwise, interpret=False)).lower(x, x).as_text()
    return text.count("dynamic_update_slice")


@needs_exact_xla
def test_read_only_blocks_are_not_written_back(guard: Callable[..., None]) -> None:
    """JAX's interpreter writes back the blocks of both inputs and the output; the guard's, the
    output's alone."""
    shipped, fast = _write_backs(guard, False), _write_backs(guard, True)
    assert shipped >= 3
    assert fast == shipped - 2


def _whole_array_copies(guard: Callable[..., None], fast: bool) -> int:
    guard("interpret", fast_plain=fast)
    jax.clear_caches()
    x = jnp.zeros((64, 128), jnp.float32)
    compiled = jax.jit(in_place).lower(x, x).compile().as_text()
    return compiled.count("f32[64,128]{1,0} copy(")


@needs_exact_xla
def test_an_aliased_pair_is_not_copied_whole_at_every_step(guard: Callable[..., None]) -> None:
    """Where JAX's loop keeps an aliased input and output in step by assigning one carried array to
    the other, XLA copies the array at every step; the guard's loop carries it once (one copy at
    most, on entry, where the loop starts from the caller's array)."""
    shipped, fast = _whole_array_copies(guard, False), _whole_array_copies(guard, True)
    assert fast <= 1 < shipped


@needs_exact_xla
def test_by_hand_interpret_gets_the_fast_path_and_the_way_back(guard: Callable[..., None]) -> None:
    x = jnp.zeros((64, 128), jnp.float32)
    counts = {}
    for fast in (True, False):
        guard("warn", fast_plain=fast)
        jax.clear_caches()  # JAX keeps a lowering per function, whatever the guard's settings
        counts[fast] = jax.jit(elementwise).lower(x, x).as_text().count("dynamic_update_slice")
    pallas_guard.uninstall()
    jax.clear_caches()
    untouched = jax.jit(elementwise).lower(x, x).as_text().count("dynamic_update_slice")
    assert counts[False] == untouched
    assert counts[True] == untouched - 2


def test_bounds_finding_still_found_with_the_fast_path(guard: Callable[..., None]) -> None:
    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[pl.ds(4 + pl.program_id(0) * 0, 8), :]  # past the 8 rows of the block

    guard("interpret", checks="bounds", fast_plain=True)
    x = jnp.ones((16, 128), jnp.float32)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
    )
    with pytest.raises(pallas_guard.PallasGuardError, match=r"out-of-bounds read"):
        jax.block_until_ready(call(x))


def _weighted(x: jax.Array, w: jax.Array) -> jax.Array:
    """``w`` read through one block of ``x``'s size at the same index at every step."""

    def kernel(x_ref, w_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] * w_ref[...]

    block = (8, x.shape[1])
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8,),
        in_specs=[pl.BlockSpec(block, lambda i: (i, 0)), pl.BlockSpec(block, lambda i: (0, 0))],
        out_specs=pl.BlockSpec(block, lambda i: (i, 0)),
        interpret=True,
    )(x, w)


def _lowered(guard: Callable[..., None], fast: bool, function: Callable[..., Any], *args: jax.Array) -> str:
    guard("interpret", fast_plain=fast)
    jax.clear_caches()
    return str(jax.jit(function).lower(*args).as_text())


@needs_exact_xla
@pytest.mark.parametrize(("weight_rows", "barriers"), [(8, 1), (64, 2)])
def test_a_block_left_out_is_bare_only_where_it_is_the_whole_operand(
    guard: Callable[..., None], weight_rows: int, barriers: int
) -> None:
    """The write-back left out is presented to XLA as in JAX's loop, where XLA folds it away only
    for a block that is the whole operand (loop-invariant there): bare for it; behind a barrier
    (loop-variant) for any other block, a weight block at the same index at every step included."""
    x, w = jnp.zeros((64, 128), jnp.float32), jnp.zeros((weight_rows, 128), jnp.float32)
    assert _lowered(guard, True, _weighted, x, w).count("optimization_barrier") == barriers
    assert _lowered(guard, False, _weighted, x, w).count("optimization_barrier") == 0


@needs_exact_xla
def test_a_step_below_the_small_loop_threshold_runs_as_shipped(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 8 x 8 float32 (256 bytes a step written back): a loop XLA would compile as one small
    call once the read-only write-backs are left out, and JAX's not, so the guard leaves them in,
    except where this XLA compiles every loop so (or the threshold is set to 0: none)."""
    from pallas_guard._jax import lookup as jax_lookup
    from pallas_guard._running import plain as _plain

    x = jnp.zeros((64, 8), jnp.float32)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    shipped = _lowered(guard, False, elementwise, x, x).count("dynamic_update_slice")
    fast = _lowered(guard, True, elementwise, x, x).count("dynamic_update_slice")
    every_loop_small = jax_lookup.jax_release() >= _plain.EVERY_LOOP_SMALL_FROM
    assert fast == (shipped - 2 if every_loop_small else shipped)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_extra_options=xla_cpu_small_while_loop_byte_threshold=0")
    assert _lowered(guard, True, elementwise, x, x).count("dynamic_update_slice") == shipped - 2
