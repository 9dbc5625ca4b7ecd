"""Mosaic-TPU-style Pallas kernels with manual DMAs, each with or without one data race: a corpus for
comparing a race check against TPU interpret mode's race detector
(``interpret=pltpu.InterpretParams(detect_races=True)``).

Every case builds its kernel for a given ``interpret=`` value (``None``: the argument is not passed at
all, as a user builds it) and returns the callable and small concrete numpy inputs. ``kind`` is the race
the kernel has (one of ``KINDS``) or None for a valid kernel; ``detector`` is what TPU interpret mode's
detector did with it, measured on jax 0.10.2 and 0.12.0.1 (the same on both unless ``note`` says
otherwise): "race", "no race", "hangs" (no return within 60 s) or "error: ...".

TPU interpret mode executes a DMA lazily, when a wait needs it (``dma_execution_mode="on_wait"``), and
checks the DMA's reads and writes against the kernel's with vector clocks. From jax 0.12 a detected
race raises by default (``InterpretParams(on_race="raise")``): pass ``on_race="warn"`` there to let
the kernel finish and read ``races_found`` afterwards (a raised race leaves it False).

JAX's shipped kernels (paged attention, ragged paged attention) take no ``interpret=``: their builders
pass it to ``pl.pallas_call`` while the op is traced, by swapping ``jax.experimental.pallas.pallas_call``
for the call (not thread-safe), in a fresh ``jax.jit`` of the op's function so no trace is reused.

Sizes are tiny ((8, 128) float32 blocks, grids of 1-4 steps): each hand-written kernel runs in a CPU
interpreter in about a second.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

KINDS = (
    "read_before_wait",
    "write_dst_in_flight",
    "write_src_in_flight",
    "wait_without_start",
    "left_in_flight",
    "overlapping_dmas",
)

F32 = jnp.float32
R, C = 8, 128  # one (8, 128) float32 tile


@dataclasses.dataclass(frozen=True)
class RaceCase:
    name: str
    """``<kind>.<variant>``, or ``valid.<variant>`` for a kernel without a race."""
    kind: str | None
    """One of ``KINDS``, or None for a valid kernel (no race)."""
    build: Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]
    """``build(interpret) -> (fn, args)``: ``fn(*args)`` runs the kernel through ``pl.pallas_call(...,
    interpret=interpret)``; ``interpret=None`` means the argument is not passed at all."""
    detector: str
    """What TPU interpret mode's ``detect_races`` did, measured: "race", "no race", "hangs", "error: ..."."""
    note: str = ""
    """Why, where the detector's verdict differs from ``kind``; also any version differences."""
    min_jax: tuple[int, ...] = (0, 0)
    """Skip below this jax version (an API the case needs is missing there)."""


# --- building blocks ---------------------------------------------------------------------------------


def _rows(n: int, seed: int = 0) -> np.ndarray:
    """``n`` rows of 128 float32 values, the same on every machine."""
    return np.random.default_rng(seed).standard_normal((n, C)).astype(np.float32)


ANY_SPEC = pl.BlockSpec(memory_space=pl.ANY)


def _block(rows: int = R, *, stepped: bool = False) -> pl.BlockSpec:
    """A VMEM block of ``rows`` x 128: the whole array, or the grid step's own rows when ``stepped``."""
    if stepped:
        return pl.BlockSpec((rows, C), lambda i, *_: (i, 0))
    return pl.BlockSpec((rows, C), lambda i, *_: (0, 0))


def _vmem(rows: int = R, *lead: int) -> Any:
    return pltpu.VMEM((*lead, rows, C), F32)


DMA = pltpu.SemaphoreType.DMA


def _call(
    kernel: Callable[..., None],
    interpret: Any,
    *,
    out_rows: int | tuple[int, ...] = R,
    in_specs: tuple[Any, ...],
    out_specs: Any,
    scratch: tuple[Any, ...] = (),
    grid: int = 1,
    num_scalar_prefetch: int = 0,
) -> Callable[..., Any]:
    """``pl.pallas_call`` of ``kernel`` over a 1-D ``grid`` of sequential ("arbitrary") steps."""
    kwargs: dict[str, Any] = {}
    if interpret is not None:
        kwargs["interpret"] = interpret
    if isinstance(out_rows, int):
        out_shape: Any = jax.ShapeDtypeStruct((out_rows, C), F32)
    else:
        out_shape = tuple(jax.ShapeDtypeStruct((rows, C), F32) for rows in out_rows)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalar_prefetch,
            grid=(grid,),
            in_specs=list(in_specs),
            out_specs=out_specs,
            scratch_shapes=list(scratch),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        **kwargs,
    )


def _at(i: Any, rows: int = R) -> Any:
    """Rows ``[i * rows, (i + 1) * rows)``, ``i`` static or traced."""
    return pl.ds(pl.multiple_of(i * rows, rows), rows)


def _hbm_to_vmem(x: np.ndarray, kernel: Callable[..., None], scratch: tuple[Any, ...], out_rows: int = R) -> Any:
    """A builder for the common shape: ``x`` in HBM, one VMEM output block, ``scratch``."""

    def build(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        fn = _call(
            kernel, interpret, out_rows=out_rows, in_specs=(ANY_SPEC,), out_specs=_block(out_rows), scratch=scratch
        )
        return fn, (x,)

    return build


# --- read_before_wait --------------------------------------------------------------------------------


def _read_before_wait_whole(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    o_ref[...] = buf[...] + 1.0  # the DMA may not have landed yet
    copy.wait()


def _read_before_wait_part(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    buf[pl.ds(R, R)] = jnp.zeros((R, C), F32)  # rows 8-15: disjoint from the DMA, no race
    copy = pltpu.make_async_copy(x_hbm, buf.at[pl.ds(0, R)], sem)  # rows 0-7
    copy.start()
    o_ref[...] = buf[pl.ds(R // 2, R)]  # rows 4-11: overlaps the DMA's rows 4-7
    copy.wait()


def _read_before_wait_loop(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    def body(i: Any, acc: Any) -> Any:
        copy = pltpu.make_async_copy(x_hbm.at[_at(i)], buf, sem)
        copy.start()
        acc = acc + buf[...]  # reads the buffer the DMA of this iteration is writing
        copy.wait()
        return acc

    o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((R, C), F32))


def _read_before_wait_next_step(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    # Step i's block was prefetched by step i - 1 (step 0 fetches its own), but is read before its wait.
    i, n = pl.program_id(0), pl.num_programs(0)

    @pl.when(i == 0)
    def _() -> None:
        pltpu.async_copy(x_hbm.at[_at(0)], buf, sem)

    o_ref[...] = buf[...] * 2.0  # too early: the wait is below
    pltpu.make_async_copy(x_hbm.at[_at(i)], buf, sem).wait()

    @pl.when(i + 1 < n)
    def _() -> None:
        pltpu.async_copy(x_hbm.at[_at(i + 1)], buf, sem)


def _build_next_step(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    fn = _call(
        _read_before_wait_next_step,
        interpret,
        out_rows=2 * R,
        in_specs=(ANY_SPEC,),
        out_specs=_block(stepped=True),
        scratch=(_vmem(), DMA),
        grid=2,
    )
    return fn, (_rows(2 * R),)


def _cond_kernel(racy: bool) -> Callable[..., None]:
    def kernel(flag_ref: Any, x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
        copy = pltpu.make_async_copy(x_hbm, buf, sem)

        def branch_with_dma() -> None:
            copy.start()
            if racy:
                o_ref[...] = buf[...]  # read before the wait, inside the branch taken
                copy.wait()
            else:
                copy.wait()
                o_ref[...] = buf[...]

        def branch_without() -> None:
            o_ref[...] = jnp.zeros((R, C), F32)

        lax.cond(flag_ref[0] == 1, branch_with_dma, branch_without)

    return kernel


def _build_cond(racy: bool) -> Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]:
    def build(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        fn = _call(
            _cond_kernel(racy),
            interpret,
            in_specs=(ANY_SPEC,),
            out_specs=_block(),
            scratch=(_vmem(), DMA),
            num_scalar_prefetch=1,
        )
        return fn, (np.array([1], np.int32), _rows(R))

    return build


# --- write_dst_in_flight -----------------------------------------------------------------------------


def _write_dst_whole(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    buf[...] = jnp.zeros((R, C), F32)  # races with the DMA's write
    copy.wait()
    o_ref[...] = buf[...]


def _write_dst_part(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    copy = pltpu.make_async_copy(x_hbm, buf.at[pl.ds(0, R)], sem)  # rows 0-7
    copy.start()
    buf[pl.ds(R // 2, R)] = jnp.ones((R, C), F32)  # rows 4-11: overlaps rows 4-7
    copy.wait()
    o_ref[...] = buf[pl.ds(0, R)]


def _run_scoped_kernel(racy: bool) -> Callable[..., None]:
    def kernel(x_hbm: Any, o_ref: Any) -> None:
        def scoped(buf: Any, sem: Any) -> None:
            copy = pltpu.make_async_copy(x_hbm, buf, sem)
            copy.start()
            if racy:
                buf[pl.ds(0, 1)] = jnp.zeros((1, C), F32)  # one row of the DMA's destination
                copy.wait()
            else:
                copy.wait()
                buf[pl.ds(0, 1)] = jnp.zeros((1, C), F32)
            o_ref[...] = buf[...]

        pl.run_scoped(scoped, _vmem(), DMA)

    return kernel


# --- write_src_in_flight -----------------------------------------------------------------------------


def _write_src_whole(x_ref: Any, o_hbm: Any, stage: Any, sem: Any) -> None:
    stage[...] = x_ref[...] * 2.0
    copy = pltpu.make_async_copy(stage, o_hbm, sem)
    copy.start()
    stage[...] = jnp.zeros((R, C), F32)  # the DMA may still be reading it
    copy.wait()


def _write_src_part(x_ref: Any, o_hbm: Any, stage: Any, sem: Any) -> None:
    stage[pl.ds(0, R)] = x_ref[...]
    stage[pl.ds(R, R)] = x_ref[...] * 2.0
    copy = pltpu.make_async_copy(stage.at[pl.ds(0, R)], o_hbm, sem)  # reads rows 0-7
    copy.start()
    stage[pl.ds(R // 2, R)] = jnp.zeros((R, C), F32)  # rows 4-11: overlaps rows 4-7
    copy.wait()


def _write_src_loop(x_ref: Any, o_hbm: Any, stage: Any, sem: Any) -> None:
    # One staging buffer for four outgoing DMAs, all waited at the end: iteration i + 1 overwrites
    # the buffer DMA i is still reading.
    def copy(i: Any) -> Any:
        return pltpu.make_async_copy(stage, o_hbm.at[_at(i)], sem)

    def issue(i: Any, carry: None) -> None:
        stage[...] = x_ref[_at(i), :] * 2.0
        copy(i).start()
        return carry

    def drain(i: Any, carry: None) -> None:
        copy(i).wait()
        return carry

    lax.fori_loop(0, 4, issue, None)
    lax.fori_loop(0, 4, drain, None)


def _vmem_to_hbm(
    kernel: Callable[..., None], *, in_rows: int = R, out_rows: int = R, stage_rows: int = R
) -> Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]:
    def build(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        fn = _call(
            kernel,
            interpret,
            out_rows=out_rows,
            in_specs=(_block(in_rows),),
            out_specs=ANY_SPEC,
            scratch=(_vmem(stage_rows), DMA),
        )
        return fn, (_rows(in_rows),)

    return build


# --- wait_without_start ------------------------------------------------------------------------------


def _wait_never_started(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    pltpu.make_async_copy(x_hbm, buf, sem).wait()  # no start: nothing will ever signal sem
    o_ref[...] = buf[...]


def _wait_twice(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...]
    copy.wait()  # a second wait for one start


def _wait_wrong_slot(x_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
    pltpu.make_async_copy(x_hbm, buf.at[0], sems.at[0]).start()
    pltpu.make_async_copy(x_hbm, buf.at[1], sems.at[1]).wait()  # slot 1 was never started
    o_ref[...] = buf[0]


# --- left_in_flight ----------------------------------------------------------------------------------


def _left_output_dma(x_ref: Any, o_hbm: Any, stage: Any, sem: Any) -> None:
    stage[...] = x_ref[...] + 1.0
    pltpu.make_async_copy(stage, o_hbm, sem).start()  # never waited: the kernel ends with it in flight


def _left_input_dma(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    pltpu.make_async_copy(x_hbm, buf, sem).start()  # never waited, never read
    o_ref[...] = jnp.zeros((R, C), F32)


def _prefetch_kernel(guarded: bool) -> Callable[..., None]:
    """A two-slot prefetch across grid steps: step i starts the DMA of block i + 1, then waits for
    block i (started by step i - 1; step 0 starts its own). Unguarded, the last step still prefetches
    (a clamped, repeated block) that nothing waits for."""

    def kernel(x_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
        i, n = pl.program_id(0), pl.num_programs(0)

        def fetch(block: Any, slot: Any) -> Any:
            return pltpu.make_async_copy(x_hbm.at[_at(block)], buf.at[slot], sems.at[slot])

        @pl.when(i == 0)
        def _() -> None:
            fetch(0, 0).start()

        nxt = (i + 1) % 2
        if guarded:

            @pl.when(i + 1 < n)
            def _() -> None:
                fetch(i + 1, nxt).start()

        else:
            fetch(jnp.minimum(i + 1, n - 1), nxt).start()
        slot = i % 2
        fetch(i, slot).wait()
        o_ref[...] = buf[slot] * 2.0

    return kernel


def _build_prefetch(guarded: bool, steps: int = 3) -> Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]:
    def build(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        fn = _call(
            _prefetch_kernel(guarded),
            interpret,
            out_rows=steps * R,
            in_specs=(ANY_SPEC,),
            out_specs=_block(stepped=True),
            scratch=(_vmem(R, 2), DMA((2,))),
            grid=steps,
        )
        return fn, (_rows(steps * R),)

    return build


# --- overlapping_dmas --------------------------------------------------------------------------------


def _overlap_same_dst(x_hbm: Any, y_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
    a = pltpu.make_async_copy(x_hbm, buf, sems.at[0])
    b = pltpu.make_async_copy(y_hbm, buf, sems.at[1])
    a.start()
    b.start()  # both write all of buf, in no defined order
    a.wait()
    b.wait()
    o_ref[...] = buf[...]


def _overlap_rows(x_hbm: Any, y_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
    a = pltpu.make_async_copy(x_hbm, buf.at[pl.ds(0, R)], sems.at[0])  # rows 0-7
    b = pltpu.make_async_copy(y_hbm, buf.at[pl.ds(R // 2, R)], sems.at[1])  # rows 4-11
    a.start()
    b.start()
    a.wait()
    b.wait()
    o_ref[...] = buf[pl.ds(0, R)]


def _overlap_hbm_output(x_ref: Any, o_hbm: Any, stage: Any, sems: Any) -> None:
    stage[0] = x_ref[...]
    stage[1] = x_ref[...] * 2.0
    a = pltpu.make_async_copy(stage.at[0], o_hbm.at[pl.ds(0, R)], sems.at[0])  # output rows 0-7
    b = pltpu.make_async_copy(stage.at[1], o_hbm.at[pl.ds(R // 2, R)], sems.at[1])  # output rows 4-11
    a.start()
    b.start()
    a.wait()
    b.wait()


def _two_inputs(
    kernel: Callable[..., None], *, buf_rows: int, out_rows: int = R
) -> Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]:
    def build(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        fn = _call(
            kernel,
            interpret,
            out_rows=out_rows,
            in_specs=(ANY_SPEC, ANY_SPEC),
            out_specs=_block(out_rows),
            scratch=(_vmem(buf_rows), DMA((2,))),
        )
        return fn, (_rows(R, 1), _rows(R, 2))

    return build


def _build_overlap_hbm_output(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    fn = _call(
        _overlap_hbm_output,
        interpret,
        out_rows=2 * R,
        in_specs=(_block(),),
        out_specs=ANY_SPEC,
        scratch=(_vmem(R, 2), DMA((2,))),
    )
    return fn, (_rows(R),)


# --- valid kernels -----------------------------------------------------------------------------------


def _valid_dma_wait_read(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...] + 1.0


def _valid_sync_copy(x_hbm: Any, o_ref: Any, buf: Any) -> None:
    pltpu.sync_copy(x_hbm, buf)
    o_ref[...] = buf[...] * 3.0


def _valid_double_buffer(x_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
    n = 4

    def fetch(i: Any, slot: Any) -> Any:
        return pltpu.make_async_copy(x_hbm.at[_at(i)], buf.at[slot], sems.at[slot])

    fetch(0, 0).start()

    def body(i: Any, acc: Any) -> Any:
        slot = i % 2

        @pl.when(i + 1 < n)
        def _() -> None:
            fetch(i + 1, 1 - slot).start()  # the other slot: its last reader was iteration i - 1

        fetch(i, slot).wait()
        return acc + buf[slot]

    o_ref[...] = lax.fori_loop(0, n, body, jnp.zeros((R, C), F32))


def _valid_reuse_after_wait(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    def body(i: Any, acc: Any) -> Any:
        copy = pltpu.make_async_copy(x_hbm.at[_at(i)], buf, sem)
        copy.start()
        copy.wait()
        return acc + buf[...]

    o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((R, C), F32))


def _valid_staging_waited(x_ref: Any, o_hbm: Any, stage: Any, sem: Any) -> None:
    def body(i: Any, carry: None) -> None:
        stage[...] = x_ref[_at(i), :] * 2.0
        copy = pltpu.make_async_copy(stage, o_hbm.at[_at(i)], sem)
        copy.start()
        copy.wait()  # before the next iteration overwrites stage
        return carry

    lax.fori_loop(0, 4, body, None)


def _valid_disjoint_halves(x_hbm: Any, o_ref: Any, buf: Any, sems: Any) -> None:
    a = pltpu.make_async_copy(x_hbm.at[pl.ds(0, R)], buf.at[pl.ds(0, R)], sems.at[0])
    b = pltpu.make_async_copy(x_hbm.at[pl.ds(R, R)], buf.at[pl.ds(R, R)], sems.at[1])
    a.start()
    b.start()
    a.wait()
    b.wait()
    o_ref[...] = buf[...]


def _valid_disjoint_access(x_hbm: Any, o_ref: Any, buf: Any, sem: Any) -> None:
    copy = pltpu.make_async_copy(x_hbm, buf.at[pl.ds(0, R)], sem)  # rows 0-7
    copy.start()
    buf[pl.ds(R, R)] = jnp.full((R, C), 2.0, F32)  # rows 8-15, while the DMA is in flight
    other = buf[pl.ds(R, R)] * 3.0
    copy.wait()
    o_ref[...] = buf[pl.ds(0, R)] + other


def _valid_read_src(x_ref: Any, o_hbm: Any, o2_ref: Any, stage: Any, sem: Any) -> None:
    stage[...] = x_ref[...] * 2.0
    copy = pltpu.make_async_copy(stage, o_hbm, sem)
    copy.start()
    o2_ref[...] = stage[...] + 1.0  # reads the DMA's source: read-read, no race
    copy.wait()


def _build_read_src(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    fn = _call(
        _valid_read_src,
        interpret,
        out_rows=(R, R),
        in_specs=(_block(),),
        out_specs=(ANY_SPEC, _block()),
        scratch=(_vmem(), DMA),
    )
    return fn, (_rows(R),)


def _valid_same_source(x_hbm: Any, o_ref: Any, bufs: Any, sems: Any) -> None:
    a = pltpu.make_async_copy(x_hbm, bufs.at[0], sems.at[0])
    b = pltpu.make_async_copy(x_hbm, bufs.at[1], sems.at[1])
    a.start()
    b.start()  # two DMAs reading one source at once
    a.wait()
    b.wait()
    o_ref[...] = bufs[0] + bufs[1]


def _valid_emit_pipeline(x_hbm: Any, o_hbm: Any) -> None:
    def body(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    block = pl.BlockSpec((R, C), lambda i: (i, 0))
    pltpu.emit_pipeline(body, grid=(4,), in_specs=[block], out_specs=[block])(x_hbm, o_hbm)


def _tpu_abstract_mesh() -> Any:
    """An abstract mesh whose device is a TPU v5e: emit_pipeline reads the TPU's tiling at trace time
    (``get_tpu_info``), which fails on a CPU ("Unsupported TPU device kind: cpu") without one."""
    kind = "TPU v5 lite"
    try:
        device = jax.sharding.AbstractDevice(kind, 1, "tpu")
    except TypeError:
        device = jax.sharding.AbstractDevice(kind, 1)  # type: ignore[call-arg]
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def _build_emit_pipeline(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    call = _call(_valid_emit_pipeline, interpret, out_rows=4 * R, in_specs=(ANY_SPEC,), out_specs=ANY_SPEC)
    if interpret is None:
        return call, (_rows(4 * R),)  # as a user builds it: on a TPU the device itself answers

    def fn(*args: Any) -> Any:
        with _tpu_abstract_mesh():
            return call(*args)

    return fn, (_rows(4 * R),)


# --- JAX's shipped kernels ---------------------------------------------------------------------------


@contextmanager
def _pallas_call_interpreting(interpret: Any) -> Iterator[None]:
    """While tracing a shipped op (which takes no ``interpret=``), pass ``interpret`` to its pallas_calls."""
    original = pl.pallas_call

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        kwargs["interpret"] = interpret
        return original(*args, **kwargs)

    pl.pallas_call = patched
    try:
        yield
    finally:
        pl.pallas_call = original


def _shipped(op: Any, interpret: Any, **static: Any) -> Callable[..., Any]:
    """``op`` (a jitted shipped kernel) with ``static`` options, traced afresh for this ``interpret``
    (a new jit of the function it wraps: no trace cached for another interpret value is reused)."""
    jitted = jax.jit(functools.partial(op.__wrapped__, **static))
    if interpret is None:
        return jitted

    def fn(*args: Any) -> Any:
        with _pallas_call_interpreting(interpret):
            return jitted(*args)

    return fn


def _build_paged_attention(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    rng = np.random.default_rng(7)
    batch, heads, kv_heads, d, page, pages_per_seq = 2, 4, 2, 128, 16, 4
    total = batch * pages_per_seq
    q = rng.standard_normal((batch, heads, d)).astype(np.float32)
    k_pages = rng.standard_normal((kv_heads, total, page, d)).astype(np.float32)
    v_pages = rng.standard_normal((kv_heads, total, page, d)).astype(np.float32)
    lengths = np.array([page * pages_per_seq - 5, page * 2 + 3], np.int32)
    page_indices = rng.permutation(total).reshape(batch, pages_per_seq).astype(np.int32)
    fn = _shipped(paged_attention, interpret, pages_per_compute_block=2)
    return fn, (q, k_pages, v_pages, lengths, page_indices)


def _build_ragged_paged_attention(interpret: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    # Two sequences: a prefill of 5 tokens over 20 kv tokens, a decode token over 9 kv tokens.
    rng = np.random.default_rng(8)
    heads, kv_heads, d, page = 4, 2, 128, 16
    q = rng.standard_normal((8, heads, d)).astype(np.float32)
    kv_pages = rng.standard_normal((6, page, 2 * kv_heads, d)).astype(np.float32)
    kv_lens = np.array([20, 9, 0], np.int32)
    page_indices = np.array([[1, 3], [4, 0], [0, 0]], np.int32)
    cu_q_lens = np.array([0, 5, 6, 6], np.int32)
    num_seqs = np.array([2], np.int32)
    fn = _shipped(
        ragged_paged_attention,
        interpret,
        sm_scale=0.1,
        num_kv_pages_per_block=1,
        num_queries_per_block=8,
    )
    return fn, (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)


# --- the corpus --------------------------------------------------------------------------------------

_LAZY_DMA = (
    "TPU interpret mode runs a DMA only when a wait needs it (dma_execution_mode='on_wait'): one never "
    "waited never runs, so neither its reads nor its writes reach the race detector; the plain interpreter "
    "runs the kernel without complaint too"
)
_HANGS = (
    "TPU interpret mode never returns: the wait spins in the interpreter's Semaphore.wait (no pending DMA "
    "can signal the semaphore), with no error or timeout, detect_races or not; the plain interpreter "
    "(interpret=True) runs it without an error"
)
_CLOCKS = (
    "a race the detector misses: with one core its vector clocks have 2 entries (vector_clock_size defaults "
    "to 2 x cores), so every DMA shares the one 'virtual DMA device' entry, and the DMA waited second is "
    "ordered after the first; with InterpretParams(vector_clock_size=16) it reports the race whenever the "
    "two DMAs draw different virtual ids (measured on 0.10.2: 3 or 4 of 4 random_seed values)"
)
_RAISES = (
    "jax 0.12 raises it by default (InterpretParams(on_race='raise'): an INTERNAL CpuCallback error whose "
    "text holds 'RACE DETECTED', with races_found left False); with on_race='warn' it is reported as on 0.10.2"
)


def _race(name: str, build: Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]) -> RaceCase:
    """A racy case the detector reports (same kind as the name's prefix)."""
    return RaceCase(name, name.partition(".")[0], build, detector="race", note=_RAISES)


CASES: tuple[RaceCase, ...] = (
    # read_before_wait
    _race("read_before_wait.whole_buffer", _hbm_to_vmem(_rows(R), _read_before_wait_whole, (_vmem(), DMA))),
    _race("read_before_wait.overlapping_rows", _hbm_to_vmem(_rows(R), _read_before_wait_part, (_vmem(2 * R), DMA))),
    _race("read_before_wait.fori_loop", _hbm_to_vmem(_rows(4 * R), _read_before_wait_loop, (_vmem(), DMA))),
    _race("read_before_wait.next_grid_step", _build_next_step),
    _race("read_before_wait.in_cond_branch", _build_cond(racy=True)),
    # write_dst_in_flight
    _race("write_dst_in_flight.whole_buffer", _hbm_to_vmem(_rows(R), _write_dst_whole, (_vmem(), DMA))),
    _race("write_dst_in_flight.overlapping_rows", _hbm_to_vmem(_rows(R), _write_dst_part, (_vmem(2 * R), DMA))),
    _race("write_dst_in_flight.run_scoped", _hbm_to_vmem(_rows(R), _run_scoped_kernel(racy=True), ())),
    # write_src_in_flight
    _race("write_src_in_flight.whole_buffer", _vmem_to_hbm(_write_src_whole)),
    _race("write_src_in_flight.overlapping_rows", _vmem_to_hbm(_write_src_part, stage_rows=2 * R)),
    _race("write_src_in_flight.staging_loop", _vmem_to_hbm(_write_src_loop, in_rows=4 * R, out_rows=4 * R)),
    # wait_without_start
    RaceCase(
        "wait_without_start.never_started",
        "wait_without_start",
        _hbm_to_vmem(_rows(R), _wait_never_started, (_vmem(), DMA)),
        detector="hangs",
        note=_HANGS,
    ),
    RaceCase(
        "wait_without_start.double_wait",
        "wait_without_start",
        _hbm_to_vmem(_rows(R), _wait_twice, (_vmem(), DMA)),
        detector="hangs",
        note=_HANGS,
    ),
    RaceCase(
        "wait_without_start.wrong_slot",
        "wait_without_start",
        _hbm_to_vmem(_rows(R), _wait_wrong_slot, (_vmem(R, 2), DMA((2,)))),
        detector="hangs",
        note=_HANGS,
    ),
    # left_in_flight
    RaceCase(
        "left_in_flight.output_dma",
        "left_in_flight",
        _vmem_to_hbm(_left_output_dma),
        detector="no race",
        note=_LAZY_DMA,
    ),
    RaceCase(
        "left_in_flight.input_dma",
        "left_in_flight",
        _hbm_to_vmem(_rows(R), _left_input_dma, (_vmem(), DMA)),
        detector="no race",
        note=_LAZY_DMA,
    ),
    RaceCase(
        "left_in_flight.unguarded_prefetch",
        "left_in_flight",
        _build_prefetch(guarded=False),
        detector="no race",
        note=_LAZY_DMA,
    ),
    # overlapping_dmas
    RaceCase(
        "overlapping_dmas.same_destination",
        "overlapping_dmas",
        _two_inputs(_overlap_same_dst, buf_rows=R),
        detector="no race",
        note=_CLOCKS,
    ),
    RaceCase(
        "overlapping_dmas.overlapping_rows",
        "overlapping_dmas",
        _two_inputs(_overlap_rows, buf_rows=2 * R),
        detector="no race",
        note=_CLOCKS,
    ),
    RaceCase(
        "overlapping_dmas.hbm_output",
        "overlapping_dmas",
        _build_overlap_hbm_output,
        detector="no race",
        note=_CLOCKS,
    ),
    # valid
    RaceCase(
        "valid.dma_wait_read", None, _hbm_to_vmem(_rows(R), _valid_dma_wait_read, (_vmem(), DMA)), detector="no race"
    ),
    RaceCase("valid.sync_copy", None, _hbm_to_vmem(_rows(R), _valid_sync_copy, (_vmem(),)), detector="no race"),
    RaceCase(
        "valid.double_buffer_fori",
        None,
        _hbm_to_vmem(_rows(4 * R), _valid_double_buffer, (_vmem(R, 2), DMA((2,)))),
        detector="no race",
    ),
    RaceCase(
        "valid.reuse_after_wait",
        None,
        _hbm_to_vmem(_rows(4 * R), _valid_reuse_after_wait, (_vmem(), DMA)),
        detector="no race",
    ),
    RaceCase(
        "valid.staging_loop_waited",
        None,
        _vmem_to_hbm(_valid_staging_waited, in_rows=4 * R, out_rows=4 * R),
        detector="no race",
    ),
    RaceCase("valid.cross_step_prefetch", None, _build_prefetch(guarded=True), detector="no race"),
    RaceCase(
        "valid.disjoint_halves",
        None,
        _hbm_to_vmem(_rows(2 * R), _valid_disjoint_halves, (_vmem(2 * R), DMA((2,))), out_rows=2 * R),
        detector="no race",
    ),
    RaceCase(
        "valid.disjoint_region_access",
        None,
        _hbm_to_vmem(_rows(R), _valid_disjoint_access, (_vmem(2 * R), DMA)),
        detector="no race",
    ),
    RaceCase("valid.read_src_in_flight", None, _build_read_src, detector="no race"),
    RaceCase(
        "valid.two_dmas_same_source",
        None,
        _hbm_to_vmem(_rows(R), _valid_same_source, (_vmem(R, 2), DMA((2,)))),
        detector="no race",
    ),
    RaceCase("valid.cond_branch", None, _build_cond(racy=False), detector="no race"),
    RaceCase("valid.run_scoped", None, _hbm_to_vmem(_rows(R), _run_scoped_kernel(racy=False), ()), detector="no race"),
    RaceCase(
        "valid.emit_pipeline",
        None,
        _build_emit_pipeline,
        detector="no race",
        note="with interpret= given, traced under a TPU v5e abstract mesh: emit_pipeline asks for the TPU's tiling",
    ),
    RaceCase("valid.paged_attention", None, _build_paged_attention, detector="no race"),
    RaceCase(
        "valid.ragged_paged_attention",
        None,
        _build_ragged_paged_attention,
        detector="error: AttributeError: 'ReshapeTransform' object has no attribute 'indices'",
        note=(
            "TPU interpret mode fails inside an io_callback (an INTERNAL CpuCallback error; the text above is its "
            "last line): it cannot read through the kernel's reshaped refs. The plain interpreter fails too "
            "(\"'TypedInt' object has no attribute 'shape'\", the swap discharge rule). Both on 0.10.2 and 0.12.0.1"
        ),
    ),
)

_BY_NAME = {c.name: c for c in CASES}
assert len(_BY_NAME) == len(CASES), "case names must be unique"
assert all(c.kind is None or c.kind in KINDS for c in CASES)


def case(name: str) -> RaceCase:
    """The case called ``name``."""
    return _BY_NAME[name]
