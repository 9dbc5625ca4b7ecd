"""Mosaic-TPU kernels for the TPU compile check: each one built as a user builds it (no
``interpret=``), with inputs from a fixed seed, recorded on a real TPU v5e
(``benchmarks/tpu_record.py``, ``tests/data/tpu_v5e_records.json``) and compiled here with libtpu's
own compiler for a TPU this host lacks (``pallas_guard._running.tpu_compile``).

The cases cover what a TPU accepts and refuses, at each of its three gates: JAX's Python lowering
(block tiling, 1-D blocks, primitives without a TPU rule), libtpu's compiler (VMEM and SMEM
exhaustion, vector types a generation cannot load, unproven alignment) and the run (block indices
past an array halt the core: ``halts=True``, recorded last, one process each). JAX's shipped TPU
kernels come from ``tests/ops_corpus.py``, called as that corpus calls them.

Inputs are numpy arrays (the same bits on every machine). Each kernel written here runs in a CPU
interpreter in well under a second (first call, measured 0.04-0.6 s), JAX's shipped ones in 0.4-4 s,
except where ``interpretable`` says why not. Importable from ``tests/`` and ``benchmarks/``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Callable[..., Any]]
    """The callable as a user builds it: a ``pallas_call``, or host code around one or several."""
    inputs: Callable[[], tuple[Any, ...]]
    """Concrete inputs (numpy), from a fixed seed."""
    about: str
    """What the case exercises."""
    halts: bool = False
    """Whether running it on a TPU halts the core (every later kernel of that process fails)."""
    skip: Callable[[], str | None] | None = None
    """Why this jax cannot build the case (an API it lacks); None where it can."""
    interpretable: str | None = None
    """Why no CPU interpreter runs it; None where one does."""
    tolerance: float | None = 1e-6
    """How far an interpreted output may be from the TPU's, relative to the largest TPU value; None
    where they cannot be compared (the interpreters' PRNG is not the TPU's)."""

    def skip_reason(self) -> str | None:
        return None if self.skip is None else self.skip()


# --- inputs ----------------------------------------------------------------------------------------


def _normal(seed: int, *shape: int, dtype: Any = F32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype)


def _ints(seed: int, *shape: int, dtype: Any = np.int32, low: int = -100, high: int = 100) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, shape).astype(dtype)


def _one(*arrays: np.ndarray) -> Callable[[], tuple[np.ndarray, ...]]:
    return lambda: arrays


# --- kernels ---------------------------------------------------------------------------------------


def _twice_plus_one(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] * 2 + 1


def _add_self(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + x_ref[...]


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def _elementwise(
    shape: tuple[int, ...], block: tuple[int | None, ...] | None, dtype: Any = F32, kernel: Any = _twice_plus_one
) -> Callable[[], Any]:
    """A kernel over blocks of ``block`` (None: the whole array, no grid)."""

    def build() -> Any:
        out = jax.ShapeDtypeStruct(shape, dtype)
        if block is None:
            return pl.pallas_call(kernel, out_shape=out)
        # A squeezed (None) block dim steps through the array's elements one at a time.
        grid = tuple(s if b is None else pl.cdiv(s, b) for s, b in zip(shape, block, strict=True))
        spec = pl.BlockSpec(block, lambda *i: i)
        return pl.pallas_call(kernel, out_shape=out, grid=grid, in_specs=[spec], out_specs=spec)

    return build


def _unary(fn: Callable[[Any], Any], out_shape: tuple[int, ...], out_dtype: Any) -> Callable[[], Any]:
    """A whole-array kernel computing ``fn`` of its input."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = fn(x_ref[...])

    return lambda: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype))


def _binary(fn: Callable[[Any, Any], Any], out_shape: tuple[int, ...], out_dtype: Any) -> Callable[[], Any]:
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = fn(x_ref[...], y_ref[...])

    return lambda: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype))


# matmuls


def _dot(precision: Any = None, preferred: Any = None) -> Callable[[Any, Any], Any]:
    return lambda a, b: jnp.dot(a, b, precision=precision, preferred_element_type=preferred)


def _matmul_revisited() -> Any:
    """C = A @ B over a (m, n, k) grid, the output block revisited along k and accumulated in place."""

    def kernel(a_ref: Any, b_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=F32)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((256, 256), F32),
        grid=(2, 2, 2),
        in_specs=[pl.BlockSpec((128, 128), lambda i, j, k: (i, k)), pl.BlockSpec((128, 128), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
    )


def _matmul_scratch() -> Any:
    """The same with a VMEM scratch accumulator, bfloat16 operands, parallel/arbitrary semantics."""

    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, acc_ref: Any) -> None:
        @pl.when(pl.program_id(2) == 0)
        def _() -> None:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=F32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _() -> None:
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
        grid=(2, 2, 2),
        in_specs=[pl.BlockSpec((128, 128), lambda i, j, k: (i, k)), pl.BlockSpec((128, 128), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((128, 128), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )


# VMEM


def _blocks(rows: int, cols: int, block_rows: int, limit: int | None = None, dtype: Any = F32) -> Callable[[], Any]:
    """An elementwise kernel over (block_rows, cols) blocks: in and out double-buffered."""

    def build() -> Any:
        spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
        params = pltpu.CompilerParams(vmem_limit_bytes=limit) if limit is not None else None
        return pl.pallas_call(
            _twice_plus_one,
            out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
            grid=(rows // block_rows,),
            in_specs=[spec],
            out_specs=spec,
            compiler_params=params,
        )

    return build


def _scratch(rows: int) -> Callable[[], Any]:
    """A VMEM scratch of (rows, 1024) float32 the kernel fills and reads back."""

    def kernel(x_ref: Any, o_ref: Any, scratch_ref: Any) -> None:
        def fill(i: Any, carry: Any) -> Any:
            scratch_ref[pl.ds(pl.multiple_of(i * 8, 8), 8), :] = x_ref[...] + i.astype(F32)
            return carry

        jax.lax.fori_loop(0, rows // 8, fill, 0)
        o_ref[...] = scratch_ref[pl.ds(rows - 8, 8), :]

    return lambda: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 1024), F32), scratch_shapes=[pltpu.VMEM((rows, 1024), F32)]
    )


# SMEM


def _smem_scalars(fn: Callable[[Any, Any], Any], dtype: Any, n: int = 16) -> Callable[[], Any]:
    """SMEM in and out: ``out[i] = fn(x[i], y[i])`` one scalar at a time."""

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        for i in range(n):
            o_ref[i] = fn(x_ref[i], y_ref[i])

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    return lambda: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n,), dtype), in_specs=[smem, smem], out_specs=smem
    )


def _smem_scratch(words: int) -> Callable[[], Any]:
    def kernel(x_ref: Any, o_ref: Any, table_ref: Any) -> None:
        def fill(i: Any, carry: Any) -> Any:
            table_ref[i] = i * 3
            return carry

        jax.lax.fori_loop(0, 64, fill, 0)
        o_ref[...] = x_ref[...] + table_ref[63].astype(F32)

    return lambda: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), F32), scratch_shapes=[pltpu.SMEM((words,), jnp.int32)]
    )


def _smem_broadcast() -> Any:
    def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * s_ref[0] + s_ref[1]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((16, 128), F32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
    )


# alignment


def _lane_window(aligned: bool, axis: int) -> Callable[[], Any]:
    """A (8, 128) window at an offset read from scalar prefetch, along lanes (axis 1) or sublanes
    (axis 0); ``aligned`` tells the compiler it is a multiple of 128 (or 8) with ``pl.multiple_of``."""

    def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
        start = s_ref[0]
        if aligned:
            start = pl.multiple_of(start, 128 if axis == 1 else 8)
        window = x_ref[:, pl.ds(start, 128)] if axis == 1 else x_ref[pl.ds(start, 8), :]
        o_ref[...] = window * 2

    def build() -> Any:
        shape = (8, 512) if axis == 1 else (64, 128)
        spec = pl.BlockSpec(shape, lambda i, s: (0, 0))
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), F32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(1,),
                in_specs=[spec],
                out_specs=pl.BlockSpec((8, 128), lambda i, s: (0, 0)),
            ),
        )

    return build


def _static_unaligned_slice() -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[:, 3:131]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), F32))


# index maps


def _prefetch_kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] * 2 + idx_ref[pl.program_id(0)].astype(F32)


def _gather() -> Callable[[], Any]:
    def build() -> Any:
        return pl.pallas_call(
            _prefetch_kernel,
            out_shape=jax.ShapeDtypeStruct((32, 128), F32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(4,),
                in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0)),
            ),
        )

    return build


def _shifted(in_shift: int, out_shift: int) -> Callable[[], Any]:
    """Four (8, 128) blocks of a (32, 128) array, read at block ``i + in_shift``, written at
    ``i + out_shift``: a shift of one points the last step past the array."""
    return lambda: pl.pallas_call(
        _twice_plus_one,
        out_shape=jax.ShapeDtypeStruct((32, 128), F32),
        grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i + in_shift, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i + out_shift, 0)),
    )


def _reversed() -> Any:
    return pl.pallas_call(
        _twice_plus_one,
        out_shape=jax.ShapeDtypeStruct((32, 128), F32),
        grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (3 - i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
    )


# DMAs


def _dma_whole() -> Any:
    """An input left in HBM (``pl.ANY``), copied into a VMEM scratch by a DMA with a semaphore."""

    def kernel(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...] * 2

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((64, 128), F32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((64, 128), F32), pltpu.SemaphoreType.DMA(())],
    )


def _dma_rows(start: int | None) -> Callable[[], Any]:
    """A DMA of 8 rows of an HBM input per grid step: at row ``8 * i`` (None) or at a fixed row."""

    def kernel(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
        row = pl.multiple_of(pl.program_id(0) * 8, 8) if start is None else start
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(row, 8), :], buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...] + 1

    return lambda: pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((32, 128), F32),
        grid=(4,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), F32), pltpu.SemaphoreType.DMA(())],
    )


def _dma_to_hbm() -> Any:
    """The output left in HBM: the kernel writes it with a DMA from its VMEM input block."""

    def kernel(x_ref: Any, o_hbm: Any, sem: Any) -> None:
        copy = pltpu.make_async_copy(x_ref, o_hbm.at[pl.ds(pl.multiple_of(pl.program_id(0) * 8, 8), 8), :], sem)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((32, 128), F32),
        grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )


def _dma_hbm_to_hbm() -> Any:
    def kernel(x_hbm: Any, o_hbm: Any, sem: Any) -> None:
        copy = pltpu.make_async_copy(x_hbm, o_hbm, sem)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((64, 256), F32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )


def _dma_double_buffer() -> Any:
    """Two VMEM slots and two semaphores: the next rows' DMA runs while the current ones are summed."""

    def kernel(x_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
        def copy(step: Any, slot: Any) -> Any:
            return pltpu.make_async_copy(
                x_hbm.at[pl.ds(pl.multiple_of(step * 8, 8), 8), :], buf.at[slot], sems.at[slot]
            )

        copy(0, 0).start()

        def body(step: Any, acc: Any) -> Any:
            slot = step % 2

            @pl.when(step + 1 < 8)
            def _() -> None:
                copy(step + 1, 1 - slot).start()

            copy(step, slot).wait()
            return acc + buf[slot]

        o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros((8, 128), F32))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), F32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, 8, 128), F32), pltpu.SemaphoreType.DMA((2,))],
    )


def _dma_shape_mismatch() -> Any:
    def kernel(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[:8, :]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), F32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((16, 128), F32), pltpu.SemaphoreType.DMA(())],
    )


# aliasing


def _inplace() -> Any:
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        _twice_plus_one,
        out_shape=jax.ShapeDtypeStruct((32, 128), F32),
        grid=(4,),
        in_specs=[spec],
        out_specs=spec,
        input_output_aliases={0: 0},
    )


def _inplace_rows() -> Any:
    """An aliased buffer of which only the rows scalar prefetch names are rewritten."""

    def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 100

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((64, 128), F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(2,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0)),
        ),
        input_output_aliases={1: 0},
    )


# PRNG


def _prng(per_block: bool) -> Callable[[], Any]:
    def kernel(seed_ref: Any, o_ref: Any) -> None:
        if per_block:
            pltpu.prng_seed(seed_ref[0], pl.program_id(0))
        else:
            pltpu.prng_seed(seed_ref[0])
        o_ref[...] = pltpu.prng_random_bits(o_ref.shape)

    def build() -> Any:
        grid = (4,) if per_block else (1,)
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8 * grid[0], 128), jnp.int32),
            grid=grid,
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        )

    return build


# control flow


def _fori(unroll: bool) -> Callable[[], Any]:
    """A running sum over the 8-row slices of the block, row offsets from the loop variable."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        def body(i: Any, acc: Any) -> Any:
            return acc + x_ref[pl.ds(pl.multiple_of(i * 8, 8), 8), :]

        o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros((8, 128), F32), unroll=unroll)

    return lambda: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), F32))


def _while() -> Any:
    """A scalar while loop in SMEM: Collatz steps of each input."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        for i in range(8):

            def cond(state: Any) -> Any:
                return state[0] != 1

            def body(state: Any) -> Any:
                n, steps = state
                return jnp.where(n % 2 == 0, n // 2, 3 * n + 1), steps + 1

            o_ref[i] = jax.lax.while_loop(cond, body, (x_ref[i], jnp.int32(0)))[1]

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), in_specs=[smem], out_specs=smem)


def _cond() -> Any:
    def kernel(s_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jax.lax.cond(s_ref[0] > 0, lambda v: v * 2, lambda v: v - 1, x_ref[...])

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), F32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
    )


def _when_edges() -> Any:
    """First and last grid steps write a marker, the others the data."""

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            o_ref[...] = jnp.full_like(o_ref, -1.0)

        @pl.when(pl.program_id(0) == pl.num_programs(0) - 1)
        def _() -> None:
            o_ref[...] = jnp.full_like(o_ref, 7.0)

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((32, 128), F32), grid=(4,), in_specs=[spec], out_specs=spec
    )


def _semantics(kind: Any) -> Callable[[], Any]:
    def build() -> Any:
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            _twice_plus_one,
            out_shape=jax.ShapeDtypeStruct((32, 128), F32),
            grid=(4,),
            in_specs=[spec],
            out_specs=spec,
            compiler_params=pltpu.CompilerParams(dimension_semantics=(kind,)),
        )

    return build


# primitives


def _argmax(x: Any) -> Any:
    return jnp.argmax(x, axis=-1, keepdims=True).astype(jnp.int32)


def _reduce_lanes(x: Any) -> Any:
    return jnp.sum(x, axis=-1, keepdims=True)


def _reduce_sublanes(x: Any) -> Any:
    return jnp.max(x, axis=0, keepdims=True)


def _iota(x: Any) -> Any:
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return x + (rows * 1000 + cols).astype(F32)


def _transcendental(x: Any) -> Any:
    return jnp.exp(x * 0.5) + jnp.log(jnp.abs(x) + 1) + jnp.tanh(x) + jax.nn.sigmoid(x)


def _int_div_rem(x: Any) -> Any:
    return x // 7 + x % 7


# --- shipped kernels -----------------------------------------------------------------------------------

_SHIPPED = (
    "tpu.matmul",
    "tpu.flash_attention",
    "tpu.flash_attention_grad",
    "tpu.megablox.gmm",
    "tpu.megablox.tgmm",
    "tpu.megablox.gmm_grad",
    "tpu.paged_attention",
    "tpu.ragged_paged_attention",
    "tpu.splash_attention",
    "tpu.random.threefry",
    "tpu.random.philox",
)


def _cpu() -> Any:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # a process limited to its accelerator (JAX_PLATFORMS=tpu)
        return None


def _shipped() -> list[Case]:
    import ops_corpus

    found = {case.name: case for case in ops_corpus.cases()}
    cases = []
    for name in _SHIPPED:
        case = found.get(name)
        if case is None:  # an op this jax does not ship
            continue

        def build(case: Any = case) -> Any:
            return functools.partial(case.call, case.op_module())

        def inputs(case: Any = case) -> tuple[Any, ...]:
            with jax.default_device(_cpu()):  # the same bits wherever it is recorded
                return tuple(jax.tree_util.tree_map(np.asarray, case.inputs()))

        def skip(case: Any = case) -> str | None:
            return case.skip_reason()

        cases.append(
            Case(
                f"ops.{name.removeprefix('tpu.')}",
                build,
                inputs,
                f"JAX's shipped {name} (jax.experimental.pallas.ops), called as tests/ops_corpus.py calls it",
                skip=skip,
                interpretable=case.xfail,
                # JAX's attention kernels round to bfloat16 on the TPU (1e-2 to 3e-2 measured there).
                tolerance=3e-2,
            )
        )
    return cases


# Packing: TPU primitives with no rule in any JAX interpreter on a CPU; the guard's own rules run them.

_WORDS = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def _width(dtype: Any) -> int:
    return int(np.dtype(dtype).itemsize * 8) if np.dtype(dtype).itemsize else 4


def _packing(unpacked: Any, packed: Any) -> int:
    return _width(unpacked) // (4 if packed == jnp.int4 else _width(packed))


def _pack(unpacked: Any, packed: Any, rows: int) -> Callable[[], Any]:
    sources = _packing(unpacked, packed)

    def kernel(xs_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.pack_elementwise([xs_ref[i] for i in range(sources)], packed_dtype=packed)

    def build() -> Any:
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, 128), _WORDS[_width(unpacked)]))

    return build


def _unpack(unpacked: Any, packed: Any, index: int, rows: int) -> Callable[[], Any]:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.unpack_elementwise(x_ref[...], index=index, packed_dtype=packed, unpacked_dtype=unpacked)

    def build() -> Any:
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, 128), unpacked))

    return build


def _pack_sources(seed: int, unpacked: Any, packed: Any, rows: int) -> Callable[[], tuple[np.ndarray, ...]]:
    shape = (_packing(unpacked, packed), rows, 128)
    if np.issubdtype(unpacked, np.floating):
        return _one(_normal(seed, *shape, dtype=unpacked))
    info = np.iinfo(unpacked)  # the whole range: narrowing keeps the low bits
    return _one(np.random.default_rng(seed).integers(info.min, info.max, shape, dtype=unpacked, endpoint=True))


def _words(seed: int, width: int, rows: int) -> Callable[[], tuple[np.ndarray, ...]]:
    return _one(np.random.default_rng(seed).integers(0, 1 << width, (rows, 128), dtype=np.uint64).astype(_WORDS[width]))


def _pack_edges() -> tuple[np.ndarray, ...]:
    """float32 sources at bfloat16's edges: subnormals of both, ties, overflow to inf, NaN, -0."""
    edges = np.array(
        [1e-40, -1e-40, 1e-39, 5e-39, 1.1754944e-38, -1.1754942e-38, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
         3.3961776e38, 3.4028235e38, np.inf, -np.inf, np.nan, -0.0, 0.0, 65504.0],
        np.float32,
    )  # fmt: skip
    bits = np.random.default_rng(180).integers(0, 1 << 32, (2, 8, 128), dtype=np.uint64).astype(np.uint32)
    sources = bits.view(np.float32).copy()
    sources[:, 0, : edges.size] = edges
    return (sources,)


def _no_unpacking(unpacked: Any, packed: Any) -> str | None:
    """Why this jax cannot unpack ``packed`` fields from words of ``unpacked``'s width, or None
    (jax 0.9 unpacks 32-bit words only)."""
    why = _no_packing()
    if why is not None:
        return why
    words = jax.ShapeDtypeStruct((8, 128), _WORDS[_width(unpacked)])
    try:
        jax.eval_shape(
            lambda w: pltpu.unpack_elementwise(w, index=0, packed_dtype=packed, unpacked_dtype=unpacked), words
        )
    except ValueError as error:
        return f"this jax's unpack_elementwise refuses {words.dtype} words: {error}"
    return None


def _no_packing() -> str | None:
    if not (hasattr(pltpu, "pack_elementwise") and hasattr(pltpu, "unpack_elementwise")):
        return "this jax has no pltpu.pack_elementwise"
    source = jax.ShapeDtypeStruct((8, 128), jnp.int8)
    packed = jax.eval_shape(lambda a, b: pltpu.pack_elementwise([a, b], packed_dtype=jnp.int4), source, source)
    if packed.dtype != jnp.uint8:  # the TPU records were made with words as wide as the sources
        return f"this jax packs int8 sources into {packed.dtype} words (from 0.10: uint8) and unpacks only uint32"
    return None


_PACKINGS = (
    ("f32_bf16", np.float32, jnp.bfloat16, 8),
    ("i32_i16", np.int32, jnp.int16, 8),
    ("i32_i8", np.int32, jnp.int8, 8),
    ("i32_i4", np.int32, jnp.int4, 8),
    ("i16_i8", np.int16, jnp.int8, 16),
    ("i8_i4", np.int8, jnp.int4, 32),
)


def _packing_cases() -> list[Case]:
    cases = []
    for seed, (name, unpacked, packed, rows) in enumerate(_PACKINGS, start=160):
        cases.append(
            Case(
                f"pack.{name}",
                _pack(unpacked, packed, rows),
                _pack_sources(seed, unpacked, packed, rows),
                f"pltpu.pack_elementwise of full-range {np.dtype(unpacked).name} sources",
                skip=_no_packing,
                tolerance=0.0,
            )
        )
        for index in sorted({0, _packing(unpacked, packed) - 1}):
            cases.append(
                Case(
                    f"unpack.{name}_{index}",
                    _unpack(unpacked, packed, index, rows),
                    _words(seed + 20, _width(unpacked), rows),
                    f"pltpu.unpack_elementwise field {index} of random words",
                    skip=functools.partial(_no_unpacking, unpacked, packed),
                    tolerance=0.0,
                )
            )
    cases.append(
        Case(
            "pack.f32_bf16_edges",
            _pack(np.float32, jnp.bfloat16, 8),
            _pack_edges,
            "pltpu.pack_elementwise of random float32 bit patterns and bfloat16's edges",
            skip=_no_packing,
            tolerance=0.0,
        )
    )
    return cases


# --- the corpus ----------------------------------------------------------------------------------------

_MIB = 1 << 20


def _all() -> list[Case]:
    c = Case
    x64x256 = _normal(1, 64, 256)
    cases = [
        # Block tiling: JAX's lowering asks for (8, 128) multiples unless a block dim is the array's.
        c("tiling.f32_8x128", _elementwise((64, 256), (8, 128)), _one(x64x256), "(8, 128) blocks: the native tile"),
        c("tiling.f32_16x256", _elementwise((64, 512), (16, 256)), _one(_normal(2, 64, 512)), "(16, 256) blocks"),
        c("tiling.f32_3x100", _elementwise((9, 300), (3, 100)), _one(_normal(3, 9, 300)), "(3, 100) blocks"),
        c("tiling.f32_8x100", _elementwise((16, 300), (8, 100)), _one(_normal(4, 16, 300)), "lanes not 128s"),
        c("tiling.f32_4x128", _elementwise((16, 256), (4, 128)), _one(_normal(5, 16, 256)), "sublanes not 8s"),
        c("tiling.f32_full_3x100", _elementwise((3, 100), None), _one(_normal(6, 3, 100)), "a (3, 100) array whole"),
        c("tiling.f32_full_5x7x33", _elementwise((5, 7, 33), None), _one(_normal(7, 5, 7, 33)), "odd 3-D, whole"),
        c(
            "tiling.f32_partial_last",
            _elementwise((20, 128), (8, 128)),
            _one(_normal(8, 20, 128)),
            "last block partial",
        ),
        c("tiling.f32_3d", _elementwise((4, 16, 256), (2, 8, 128)), _one(_normal(9, 4, 16, 256)), "3-D blocks"),
        c(
            "tiling.f32_squeezed",
            _elementwise((4, 16, 128), (None, 16, 128)),
            _one(_normal(10, 4, 16, 128)),
            "a squeezed (None) leading block dim",
        ),
        c("tiling.1d_1024", _elementwise((4096,), (1024,)), _one(_normal(11, 4096)), "1-D blocks of 1024"),
        c("tiling.1d_128", _elementwise((1024,), (128,)), _one(_normal(12, 1024)), "1-D blocks of 128"),
        c("tiling.1d_full", _elementwise((1000,), None), _one(_normal(13, 1000)), "a 1-D array whole"),
        c(
            "tiling.bf16_8x128",
            _elementwise((64, 256), (8, 128), jnp.bfloat16),
            _one(_normal(14, 64, 256, dtype=jnp.bfloat16)),
            "bfloat16 in (8, 128) blocks (its tile is (16, 128))",
        ),
        c(
            "tiling.bf16_16x128",
            _elementwise((64, 256), (16, 128), jnp.bfloat16),
            _one(_normal(15, 64, 256, dtype=jnp.bfloat16)),
            "bfloat16 in (16, 128) blocks",
        ),
        c(
            "tiling.int8_8x128",
            _elementwise((64, 256), (8, 128), jnp.int8, _copy),
            _one(_ints(16, 64, 256, dtype=np.int8)),
            "int8 copied in (8, 128) blocks (its tile is (32, 128))",
        ),
        c(
            "tiling.int8_32x128",
            _elementwise((64, 256), (32, 128), jnp.int8, _copy),
            _one(_ints(17, 64, 256, dtype=np.int8)),
            "int8 copied in (32, 128) blocks",
        ),
        # Types: loads, stores and arithmetic a v5e has or lacks.
        c("dtype.f32_add", _elementwise((16, 128), None, F32, _add_self), _one(_normal(20, 16, 128)), "float32 add"),
        c(
            "dtype.bf16_add",
            _elementwise((16, 128), None, jnp.bfloat16, _add_self),
            _one(_normal(21, 16, 128, dtype=jnp.bfloat16)),
            "bfloat16 add",
        ),
        c(
            "dtype.f16_copy",
            _elementwise((16, 128), None, jnp.float16, _copy),
            _one(_normal(22, 16, 128, dtype=np.float16)),
            "float16 load and store",
        ),
        c(
            "dtype.f16_add",
            _elementwise((16, 128), None, jnp.float16, _add_self),
            _one(_normal(23, 16, 128, dtype=np.float16)),
            "float16 add",
        ),
        c(
            "dtype.int8_copy",
            _elementwise((32, 128), None, jnp.int8, _copy),
            _one(_ints(24, 32, 128, dtype=np.int8)),
            "int8 load and store",
        ),
        c(
            "dtype.int8_add",
            _elementwise((32, 128), None, jnp.int8, _add_self),
            _one(_ints(25, 32, 128, dtype=np.int8)),
            "int8 add",
        ),
        c(
            "dtype.uint8_copy",
            _elementwise((32, 128), None, jnp.uint8, _copy),
            _one(_ints(26, 32, 128, dtype=np.uint8, low=0, high=255)),
            "uint8 load and store",
        ),
        c(
            "dtype.uint8_add",
            _elementwise((32, 128), None, jnp.uint8, _add_self),
            _one(_ints(27, 32, 128, dtype=np.uint8, low=0, high=255)),
            "uint8 add",
        ),
        c(
            "dtype.int16_add",
            _elementwise((16, 128), None, jnp.int16, _add_self),
            _one(_ints(28, 16, 128, dtype=np.int16)),
            "int16 add",
        ),
        c(
            "dtype.int32_add",
            _elementwise((8, 128), None, jnp.int32, _add_self),
            _one(_ints(29, 8, 128)),
            "int32 add",
        ),
        c(
            "dtype.uint32_xor",
            _binary(jnp.bitwise_xor, (8, 128), jnp.uint32),
            _one(_ints(30, 8, 128, dtype=np.uint32, low=0, high=1 << 30), _ints(31, 8, 128, dtype=np.uint32, low=0)),
            "uint32 xor",
        ),
        c(
            "dtype.bool_select",
            _binary(lambda x, y: jnp.where(x > y, x, -y), (8, 128), F32),
            _one(_normal(32, 8, 128), _normal(33, 8, 128)),
            "a comparison mask and a select",
        ),
        c(
            "dtype.f32_to_bf16",
            _unary(lambda x: x.astype(jnp.bfloat16), (16, 128), jnp.bfloat16),
            _one(_normal(34, 16, 128)),
            "float32 -> bfloat16",
        ),
        c(
            "dtype.f32_to_int32",
            _unary(lambda x: (x * 100).astype(jnp.int32), (8, 128), jnp.int32),
            _one(_normal(35, 8, 128)),
            "float32 -> int32",
        ),
        c(
            "dtype.int8_to_f32",
            _unary(lambda x: x.astype(F32), (32, 128), F32),
            _one(_ints(36, 32, 128, dtype=np.int8)),
            "int8 -> float32",
        ),
        c(
            "dtype.fp8_to_f32",
            _unary(lambda x: x.astype(F32), (32, 128), F32),
            _one(_normal(37, 32, 128, dtype=jnp.float8_e4m3fn)),
            "float8_e4m3fn -> float32",
        ),
        # Matmuls.
        c(
            "matmul.f32",
            _binary(_dot(jax.lax.Precision.HIGHEST), (128, 128), F32),
            _one(_normal(40, 128, 128), _normal(41, 128, 128)),
            "float32 (128, 128) @ (128, 128), highest precision",
        ),
        c(
            "matmul.bf16_f32_acc",
            _binary(_dot(preferred=F32), (128, 256), F32),
            _one(_normal(42, 128, 128, dtype=jnp.bfloat16), _normal(43, 128, 256, dtype=jnp.bfloat16)),
            "bfloat16 operands, float32 accumulation",
        ),
        c(
            "matmul.int8_int32_acc",
            _binary(_dot(preferred=jnp.int32), (128, 128), jnp.int32),
            _one(_ints(44, 128, 128, dtype=np.int8), _ints(45, 128, 128, dtype=np.int8)),
            "int8 operands, int32 accumulation (the v5e MXU has int8)",
        ),
        c(
            "matmul.f16",
            _binary(_dot(preferred=F32), (128, 128), F32),
            _one(_normal(46, 128, 128, dtype=np.float16), _normal(47, 128, 128, dtype=np.float16)),
            "float16 operands",
        ),
        c(
            "matmul.int32",
            _binary(_dot(), (128, 128), jnp.int32),
            _one(_ints(48, 128, 128, low=-8, high=8), _ints(49, 128, 128, low=-8, high=8)),
            "int32 operands",
        ),
        c(
            "matmul.trans_b",
            _binary(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))), (128, 256), F32),
            _one(_normal(50, 128, 128), _normal(51, 256, 128)),
            "A @ B.T as a dot_general",
        ),
        c(
            "matmul.batched",
            _binary(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), (2, 128, 128), F32),
            _one(_normal(52, 2, 128, 128), _normal(53, 2, 128, 128)),
            "a batched (3-D) einsum",
        ),
        c(
            "matmul.small_8x8",
            _binary(_dot(), (8, 8), F32),
            _one(_normal(54, 8, 8), _normal(55, 8, 8)),
            "(8, 8) @ (8, 8) whole arrays",
            tolerance=1e-2,  # default precision: the TPU's MXU takes one bfloat16 pass
        ),
        c(
            "matmul.revisited_output",
            _matmul_revisited,
            _one(_normal(56, 256, 256), _normal(57, 256, 256)),
            "an output block revisited along k, accumulated in place under pl.when",
        ),
        c(
            "matmul.scratch_accumulator",
            _matmul_scratch,
            _one(_normal(58, 256, 256, dtype=jnp.bfloat16), _normal(59, 256, 256, dtype=jnp.bfloat16)),
            "a VMEM scratch accumulator, parallel/arbitrary dimension semantics",
        ),
        # Primitives.
        c("prim.sort", _unary(lambda x: jnp.sort(x, axis=-1), (8, 128), F32), _one(_normal(60, 8, 128)), "jnp.sort"),
        c(
            "prim.cumsum",
            _unary(lambda x: jnp.cumsum(x, axis=-1), (8, 128), F32),
            _one(_normal(61, 8, 128)),
            "jnp.cumsum",
        ),
        c(
            "prim.transcendental",
            _unary(_transcendental, (8, 128), F32),
            _one(_normal(62, 8, 128)),
            "exp, log, tanh, sigmoid",
            tolerance=1e-4,  # the TPU's own approximations
        ),
        c("prim.reduce_lanes", _unary(_reduce_lanes, (8, 1), F32), _one(_normal(63, 8, 128)), "a sum over lanes"),
        c(
            "prim.reduce_sublanes",
            _unary(_reduce_sublanes, (1, 128), F32),
            _one(_normal(64, 8, 128)),
            "a max over sublanes",
        ),
        c("prim.argmax", _unary(_argmax, (8, 1), jnp.int32), _one(_normal(65, 8, 128)), "argmax over lanes"),
        c("prim.iota", _unary(_iota, (16, 256), F32), _one(_normal(66, 16, 256)), "2-D broadcasted_iota"),
        c("prim.transpose", _unary(jnp.transpose, (128, 128), F32), _one(_normal(67, 128, 128)), "a 128x128 transpose"),
        c(
            "prim.transpose_8x128",
            _unary(jnp.transpose, (128, 8), F32),
            _one(_normal(68, 8, 128)),
            "(8,128) -> (128,8)",
        ),
        c(
            "prim.reshape_flat",
            _unary(lambda x: x.reshape(-1), (1024,), F32),
            _one(_normal(69, 8, 128)),
            "(8, 128) reshaped to (1024,)",
        ),
        c(
            "prim.concat_lanes",
            _binary(lambda x, y: jnp.concatenate([x, y], axis=1), (8, 256), F32),
            _one(_normal(70, 8, 128), _normal(71, 8, 128)),
            "two (8, 128) side by side",
        ),
        c(
            "prim.roll",
            _unary(lambda x: pltpu.roll(x, 3, 1), (8, 128), F32),
            _one(_normal(72, 8, 128)),
            "pltpu.roll along lanes",
        ),
        c(
            "prim.int_div_rem",
            _unary(_int_div_rem, (8, 128), jnp.int32),
            _one(_ints(73, 8, 128, low=-1000, high=1000)),
            "int32 // and %",
        ),
        c("prim.sign", _unary(jnp.sign, (8, 128), F32), _one(_normal(74, 8, 128)), "sign (its lowering asks the TPU)"),
        c(
            "prim.erf_inv",
            _unary(jax.lax.erf_inv, (8, 128), F32),
            _one(np.clip(_normal(75, 8, 128) * 0.3, -0.9, 0.9)),
            "erf_inv",
            tolerance=1e-4,
        ),
        # VMEM: the compiler's scoped allocation against the generation's limit.
        c(
            "vmem.block_256mib",
            _elementwise((8192, 8192), None, F32, _copy),
            (lambda: (np.ones((8192, 8192), np.float32),)),
            "one 256 MiB block (in and out 512 MiB of VMEM)",
            interpretable="its 256 MiB input takes seconds to interpret",
        ),
        c(
            "vmem.pair_24mib",
            _blocks(3072, 1024, 1536),
            (lambda: (_normal(80, 3072, 1024),)),
            "6 MiB blocks in and out, double-buffered: 24 MiB (a v6e's 32 MiB default, over a v5e's 16)",
        ),
        c(
            "vmem.pair_24mib_limit_48mib",
            _blocks(3072, 1024, 1536, limit=48 * _MIB),
            (lambda: (_normal(81, 3072, 1024),)),
            "the same with vmem_limit_bytes=48 MiB (over a v4's 16 MiB of VMEM)",
        ),
        c(
            "vmem.limit_1mib",
            _blocks(1024, 1024, 256, limit=_MIB),
            (lambda: (_normal(82, 1024, 1024),)),
            "1 MiB blocks under vmem_limit_bytes=1 MiB",
        ),
        c("vmem.scratch_8mib", _scratch(2048), _one(_normal(83, 8, 1024)), "an 8 MiB VMEM scratch"),
        c("vmem.scratch_20mib", _scratch(5120), _one(_normal(84, 8, 1024)), "a 20 MiB VMEM scratch"),
        # SMEM.
        c(
            "smem.int32_add",
            _smem_scalars(jnp.add, jnp.int32),
            _one(_ints(90, 16), _ints(91, 16)),
            "int32 scalars in and out of SMEM",
        ),
        c(
            "smem.f32_mul",
            _smem_scalars(jnp.multiply, F32),
            _one(_normal(92, 16), _normal(93, 16)),
            "float32 scalar multiply in SMEM",
        ),
        c(
            "smem.int16_add",
            _smem_scalars(jnp.add, jnp.int16),
            _one(_ints(94, 16, dtype=np.int16), _ints(95, 16, dtype=np.int16)),
            "int16 scalars in SMEM",
        ),
        c(
            "smem.broadcast",
            _smem_broadcast,
            _one(np.array([2.0, 0.5], np.float32), _normal(96, 16, 128)),
            "SMEM scalars over a block",
        ),
        c("smem.scratch_4kib", _smem_scratch(1024), _one(_normal(97, 8, 128)), "a 4 KiB SMEM scratch table"),
        c("smem.scratch_4mib", _smem_scratch(1 << 20), _one(_normal(98, 8, 128)), "a 4 MiB SMEM scratch"),
        # Alignment the compiler must prove.
        c(
            "align.dynamic_lanes",
            _lane_window(aligned=False, axis=1),
            _one(np.array([256], np.int32), _normal(100, 8, 512)),
            "a lane offset from SMEM, not provably a multiple of 128",
        ),
        c(
            "align.dynamic_lanes_multiple_of",
            _lane_window(aligned=True, axis=1),
            _one(np.array([256], np.int32), _normal(101, 8, 512)),
            "the same offset with pl.multiple_of(.., 128)",
        ),
        c(
            "align.dynamic_sublanes",
            _lane_window(aligned=False, axis=0),
            _one(np.array([13], np.int32), _normal(102, 64, 128)),
            "a sublane offset from SMEM (13)",
        ),
        c(
            "align.dynamic_sublanes_multiple_of",
            _lane_window(aligned=True, axis=0),
            _one(np.array([16], np.int32), _normal(103, 64, 128)),
            "a sublane offset with pl.multiple_of(.., 8)",
        ),
        c("align.static_lanes_3", _static_unaligned_slice, _one(_normal(104, 8, 256)), "lanes 3:131, static"),
        # Index maps.
        c(
            "index.prefetch_gather",
            _gather(),
            _one(np.array([3, 0, 2, 1], np.int32), _normal(110, 32, 128)),
            "row blocks chosen by scalar prefetch (PrefetchScalarGridSpec)",
        ),
        c("index.reversed", _reversed, _one(_normal(111, 32, 128)), "blocks read in reverse"),
        # DMAs.
        c("dma.whole", _dma_whole, _one(_normal(120, 64, 128)), "pl.ANY input, make_async_copy into VMEM, wait"),
        c("dma.rows_dynamic", _dma_rows(None), _one(_normal(121, 32, 128)), "a DMA of rows 8*i per grid step"),
        c("dma.rows_unaligned", _dma_rows(3), _one(_normal(122, 32, 128)), "a DMA of rows 3..10 of HBM"),
        c("dma.to_hbm", _dma_to_hbm, _one(_normal(123, 32, 128)), "the output in HBM, written by DMAs"),
        c("dma.hbm_to_hbm", _dma_hbm_to_hbm, _one(_normal(124, 64, 256)), "a DMA from HBM to HBM"),
        c("dma.double_buffer", _dma_double_buffer, _one(_normal(125, 64, 128)), "two slots, two semaphores"),
        c(
            "dma.shape_mismatch",
            _dma_shape_mismatch,
            _one(_normal(126, 8, 128)),
            "a DMA between unequal shapes",
            interpretable="the kernel is wrong: its DMA copies an (8, 128) array into a (16, 128) buffer",
        ),
        # Aliasing.
        c("alias.inplace", _inplace, _one(_normal(130, 32, 128)), "input_output_aliases={0: 0}"),
        c(
            "alias.inplace_rows",
            _inplace_rows,
            _one(np.array([5, 1], np.int32), _normal(131, 64, 128)),
            "an aliased buffer, two of its row blocks rewritten",
        ),
        # PRNG.
        c(
            "prng.bits",
            _prng(per_block=False),
            _one(np.array([42], np.int32)),
            "prng_seed, prng_random_bits",
            tolerance=None,
        ),
        c(
            "prng.per_block",
            _prng(per_block=True),
            _one(np.array([7], np.int32)),
            "a seed per grid step",
            tolerance=None,
        ),
        # Control flow.
        c("control.fori_loop", _fori(unroll=False), _one(_normal(140, 64, 128)), "fori_loop, dynamic row offsets"),
        c("control.fori_unrolled", _fori(unroll=True), _one(_normal(141, 64, 128)), "the same loop unrolled"),
        c("control.while_loop", _while, _one(np.arange(3, 11, dtype=np.int32)), "a scalar while_loop in SMEM"),
        c("control.cond", _cond, _one(np.array([1], np.int32), _normal(142, 8, 128)), "lax.cond on an SMEM scalar"),
        c("control.when", _when_edges, _one(_normal(143, 32, 128)), "pl.when on the first and last grid steps"),
        c("control.parallel", _semantics("parallel"), _one(_normal(144, 32, 128)), "a parallel grid dimension"),
        c(
            "control.core_parallel",
            _semantics(pltpu.CORE_PARALLEL),
            _one(_normal(145, 32, 128)),
            "a core_parallel grid dimension (one TensorCore on a v5e)",
        ),
    ]
    cases += _packing_cases()
    cases += _shipped()
    # Last, one process each on a TPU: block indices past the array halt the core.
    cases += [
        c(
            "index.past_end_input",
            _shifted(1, 0),
            _one(_normal(150, 32, 128)),
            "an input index map one block past the array at the last step",
            halts=True,
        ),
        c(
            "index.past_end_output",
            _shifted(0, 1),
            _one(_normal(151, 32, 128)),
            "an output index map one block past the array at the last step",
            halts=True,
        ),
        c(
            "index.prefetch_out_of_range",
            _gather(),
            _one(np.array([0, 1, 9, 2], np.int32), _normal(152, 32, 128)),
            "a prefetched block index (9) past a 4-block array",
            halts=True,
        ),
    ]
    return cases


@functools.cache
def cases() -> tuple[Case, ...]:
    """Every case this jax can build, halting ones last."""
    every = [case for case in _all() if case.skip_reason() is None]
    return tuple([case for case in every if not case.halts] + [case for case in every if case.halts])


def by_name(name: str) -> Case:
    return next(case for case in cases() if case.name == name)


_VOLATILE = (
    (re.compile(r" with MLIR module name `[^`]*` HLO name `[^`]*`"), ""),  # jax >= 0.11 names the module
    (re.compile(r"%[\w.\-]+"), "%"),  # HLO instruction names
    (re.compile(r"(?<![\w.])(/[\w.\-]+)+(:\d+)?"), "PATH"),  # files and lines
    (re.compile(r"#allocation\d+"), "#allocation"),
    (re.compile(r"\s+"), " "),
)
SIGNATURE_CHARS = 72


def signature(message: str | None) -> str | None:
    """What of a refusal's message should match between the TPU and the deviceless compile (and
    between jax versions): its start, without instruction and module names, paths, allocation
    numbers."""
    if message is None:
        return None
    for pattern, replacement in _VOLATILE:
        message = pattern.sub(replacement, message)
    return message.strip()[:SIGNATURE_CHARS]
