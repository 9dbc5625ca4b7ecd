"""Sharded and multi-chip TPU kernels, each a whole program over a mesh, and libtpu's verdict on it.

Each case is a ``jax.shard_map`` program (or one of JAX's shipped collectives, which makes its own)
over a one-axis mesh ``x``, for a TPU generation and a number of devices: kernels that ask their
axis index, rings of remote DMAs and semaphores, JAX's ``all_gather``, a barrier, a VMEM verdict
that follows the sharding, a dtype a generation cannot load, core-parallel semantics.

``python tests/sharded_corpus.py --record`` (JAX_PLATFORMS=cpu, libtpu installed) compiles each
whole program with libtpu for a deviceless topology of that many devices, the guard not installed
(its topology helpers only), and writes what the compiler said to ``tests/data/sharded_verdicts.json``: the
verdict, the error's type and first line, and the VMEM each kernel takes. The replay
(``tests/test_sharded_corpus.py``) runs each program on as many CPU devices under the guard with
``checks=compile,bounds,races`` and compares, kernel by kernel compile included, with the record.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "sharded_verdicts.json"
MIB = 1 << 20


class Case(NamedTuple):
    name: str
    generation: str
    devices: int
    program: Callable[[Any], Callable[..., Any]]
    """The whole program over a mesh with axis ``x`` of ``devices`` devices."""
    inputs: Callable[[int], list[np.ndarray]]
    """Its global inputs, each sharded along its first axis over ``x``."""
    reference: Callable[[list[np.ndarray], int], np.ndarray] | None
    """What it computes (None: the case is refused, or gives no checkable value)."""


def _shard_map(body: Callable[..., Any], mesh: Any, out_spec: Any = None) -> Callable[..., Any]:
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P("x"), out_specs=P("x") if out_spec is None else out_spec, check_vma=False
        )
    )


def _tpu() -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu


def _mesh_ids() -> Any:
    """Device ids as positions in the mesh (``pltpu.DeviceIdType``, ``pl.DeviceIdType`` since 0.11)."""
    from jax.experimental import pallas as pl

    return (getattr(_tpu(), "DeviceIdType", None) or pl.DeviceIdType).MESH


# --- the kernels ------------------------------------------------------------------------------------


def plus_index(x_ref, o_ref):  # type: ignore[no-untyped-def]
    import jax

    o_ref[...] = x_ref[...] + jax.lax.axis_index("x").astype(o_ref.dtype)


def _plus_index(mesh: Any) -> Callable[..., Any]:
    import jax
    from jax.experimental import pallas as pl

    def body(x: Any) -> Any:
        return pl.pallas_call(plus_index, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    return _shard_map(body, mesh)


def _rows(rows: int, lanes: int = 128, dtype: Any = np.float32) -> Callable[[int], list[np.ndarray]]:
    def make(devices: int) -> list[np.ndarray]:
        return [np.arange(devices * rows * lanes, dtype=np.float32).reshape(devices * rows, lanes).astype(dtype)]

    return make


def _plus_index_reference(rows: int) -> Callable[[list[np.ndarray], int], np.ndarray]:
    def reference(inputs: list[np.ndarray], devices: int) -> np.ndarray:
        (x,) = inputs
        return x + np.repeat(np.arange(devices, dtype=x.dtype), rows)[:, None]

    return reference


def ring(x_ref, o_ref, send, recv, *, devices: int):  # type: ignore[no-untyped-def]
    import jax

    pltpu = _tpu()
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, devices)
    copy = pltpu.make_async_remote_copy(
        src_ref=x_ref, dst_ref=o_ref, send_sem=send, recv_sem=recv, device_id=(right,),
        device_id_type=_mesh_ids(),
    )  # fmt: skip
    copy.start()
    copy.wait()


def _ring(mesh: Any) -> Callable[..., Any]:
    import jax
    from jax.experimental import pallas as pl

    pltpu = _tpu()
    devices = mesh.size

    def body(x: Any) -> Any:
        vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
        return pl.pallas_call(
            functools.partial(ring, devices=devices),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[vmem],
            out_specs=vmem,
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
        )(x)

    return _shard_map(body, mesh)


def _ring_reference(rows: int) -> Callable[[list[np.ndarray], int], np.ndarray]:
    def reference(inputs: list[np.ndarray], devices: int) -> np.ndarray:
        (x,) = inputs
        blocks = x.reshape(devices, rows, -1)
        return np.roll(blocks, 1, axis=0).reshape(x.shape)  # each device holds its left neighbour's block

    return reference


def barrier_then_copy(x_ref, o_ref, *, devices: int):  # type: ignore[no-untyped-def]
    import jax
    from jax.experimental import pallas as pl

    pltpu = _tpu()
    me = jax.lax.axis_index("x")
    barrier = pltpu.get_barrier_semaphore()
    for neighbour in (jax.lax.rem(me + 1, devices), jax.lax.rem(me + devices - 1, devices)):
        pl.semaphore_signal(barrier, 1, device_id=(neighbour,), device_id_type=_mesh_ids())
    pl.semaphore_wait(barrier, 2)
    o_ref[...] = x_ref[...] * 2


def _barrier(mesh: Any) -> Callable[..., Any]:
    import jax
    from jax.experimental import pallas as pl

    pltpu = _tpu()

    def body(x: Any) -> Any:
        return pl.pallas_call(
            functools.partial(barrier_then_copy, devices=mesh.size),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltpu.CompilerParams(collective_id=0),
        )(x)

    return _shard_map(body, mesh)


def _all_gather(mesh: Any) -> Callable[..., Any]:
    from jax.experimental.pallas.ops.tpu.all_gather import all_gather

    return functools.partial(all_gather, mesh=mesh, axis_name="x")


def _gathered(inputs: list[np.ndarray], devices: int) -> np.ndarray:
    del devices
    return inputs[0]


def add_one(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


def _add_one(mesh: Any) -> Callable[..., Any]:
    import jax
    from jax.experimental import pallas as pl

    def body(x: Any) -> Any:
        return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    return _shard_map(body, mesh)


def _plus_one(inputs: list[np.ndarray], devices: int) -> np.ndarray:
    del devices
    return inputs[0] + 1


def _core_parallel(mesh: Any) -> Callable[..., Any]:
    import jax
    from jax.experimental import pallas as pl

    pltpu = _tpu()

    def body(x: Any) -> Any:
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            add_one,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(x.shape[0] // 8,),
            in_specs=[spec],
            out_specs=spec,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("core_parallel",)),
        )(x)

    return _shard_map(body, mesh)


def reduce_scatter(  # type: ignore[no-untyped-def]  # noqa: PLR0917 - a kernel takes its refs by position
    x_ref,
    o_ref,
    hbm_scratch,
    local_copy_sem,
    left_recv_sem,
    left_send_sem,
    right_recv_sem,
    right_send_sem,
    left_capacity_sem,
    right_capacity_sem,
    accum_scratch,
    *,
    devices: int,
    block: tuple[int, int],
):
    """JAX's bidirectional ring reduce-scatter (the distributed TPU Pallas tutorial,
    ``docs/pallas/tpu/distributed.md``), with its single barrier: each half of a block travels one
    way round the ring, summed on the way, over ``devices`` steps of two phases."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    pltpu = _tpu()
    left, right = 0, 1
    outer_step, phase = pl.program_id(0), pl.program_id(1)
    is_start = jnp.logical_and(outer_step == 0, phase == 0)
    last_iteration = outer_step == pl.num_programs(0) - 1
    working_slot = lax.rem(outer_step, 2)
    receiving_slot = 1 - working_slot
    me = jax.lax.axis_index("x")
    right_neighbor, left_neighbor = lax.rem(me + 1, devices), lax.rem(me + devices - 1, devices)
    left_copy_device = lax.rem(me + outer_step + 1, devices)
    right_copy_device = lax.rem(me - outer_step - 1 + devices, devices)
    half = block[0] // 2
    left_copy_slice, right_copy_slice = pl.ds(0, half), pl.ds(half, half)
    current_phase_slice = pl.ds(phase * half, half)

    def signal(towards: int, semaphore: Any) -> None:
        neighbor = left_neighbor if towards == left else right_neighbor
        pl.semaphore_signal(semaphore, inc=1, device_id=(neighbor,), device_id_type=_mesh_ids())

    def remote(src: Any, dst: Any, send: Any, recv: Any, to: Any) -> Any:
        return pltpu.make_async_remote_copy(
            src_ref=src, dst_ref=dst, send_sem=send, recv_sem=recv, device_id=(to,), device_id_type=_mesh_ids()
        )

    initial_left_copy = remote(
        x_ref.at[me, left_copy_slice],
        hbm_scratch.at[working_slot, left_copy_slice],
        left_send_sem,
        left_recv_sem,
        left_neighbor,
    )
    initial_right_copy = remote(
        x_ref.at[me, right_copy_slice],
        hbm_scratch.at[working_slot, right_copy_slice],
        right_send_sem,
        right_recv_sem,
        right_neighbor,
    )
    left_copy = remote(
        hbm_scratch.at[working_slot, left_copy_slice],
        hbm_scratch.at[receiving_slot, left_copy_slice],
        left_send_sem,
        left_recv_sem,
        left_neighbor,
    )
    right_copy = remote(
        hbm_scratch.at[receiving_slot, right_copy_slice],
        hbm_scratch.at[working_slot, right_copy_slice],
        right_send_sem,
        right_recv_sem,
        right_neighbor,
    )

    @pl.when(is_start)
    def _() -> None:
        barrier = pltpu.get_barrier_semaphore()
        for neighbor in (left_neighbor, right_neighbor):
            pl.semaphore_signal(barrier, inc=1, device_id=(neighbor,), device_id_type=_mesh_ids())
        pl.semaphore_wait(barrier, 2)
        o_ref[...] = jnp.zeros_like(o_ref[...])
        accum_scratch[...] = jnp.zeros_like(accum_scratch[...])
        initial_left_copy.start()
        initial_left_copy.wait()
        initial_right_copy.start()
        signal(left, right_capacity_sem)
        signal(right, left_capacity_sem)

    @pl.when(~is_start)
    def _() -> None:
        @pl.when(phase == left)
        def _() -> None:
            pl.semaphore_wait(right_capacity_sem, 1)
            right_copy.start()

        @pl.when(phase == right)
        def _() -> None:
            pl.semaphore_wait(left_capacity_sem, 1)
            left_copy.start()

    local_copy = pltpu.make_async_copy(
        src_ref=hbm_scratch.at[working_slot, current_phase_slice], dst_ref=accum_scratch, sem=local_copy_sem
    )
    local_copy.start()
    local_copy.wait()

    @pl.when(~last_iteration)
    def _() -> None:
        @pl.when(phase == left)
        def _() -> None:
            accum_scratch[...] += x_ref[left_copy_device, left_copy_slice]

        @pl.when(phase == right)
        def _() -> None:
            accum_scratch[...] += x_ref[right_copy_device, right_copy_slice]

    local_copy = pltpu.make_async_copy(
        src_ref=accum_scratch, dst_ref=hbm_scratch.at[working_slot, current_phase_slice], sem=local_copy_sem
    )
    local_copy.start()
    local_copy.wait()

    @pl.when(is_start)
    def _() -> None:
        initial_right_copy.wait()

    @pl.when(~is_start)
    def _() -> None:
        @pl.when(phase == left)
        def _() -> None:
            right_copy.wait()
            signal(left, right_capacity_sem)

        @pl.when(phase == right)
        def _() -> None:
            left_copy.wait()
            signal(right, left_capacity_sem)

    @pl.when(last_iteration)
    def _() -> None:
        @pl.when(phase == left)
        def _() -> None:
            o_ref[left_copy_slice, ...] = accum_scratch[...]
            pl.semaphore_wait(right_capacity_sem, 1)

        @pl.when(phase == right)
        def _() -> None:
            o_ref[right_copy_slice, ...] = accum_scratch[...]
            pl.semaphore_wait(left_capacity_sem, 1)


def _ring_met(devices: int) -> tuple[Any, Any]:
    """This device's index and its right neighbour on the ring, once both neighbours have signalled
    the barrier semaphore (no remote DMA reaches a device before it runs the kernel)."""
    import jax
    from jax import lax
    from jax.experimental import pallas as pl

    me = jax.lax.axis_index("x")
    right, left = lax.rem(me + 1, devices), lax.rem(me + devices - 1, devices)
    barrier = _tpu().get_barrier_semaphore()
    for neighbour in (left, right):
        pl.semaphore_signal(barrier, 1, device_id=(neighbour,), device_id_type=_mesh_ids())
    pl.semaphore_wait(barrier, 2)
    return me, right


def _to_the_right(src_ref: Any, dst_ref: Any, send_sem: Any, recv_sem: Any, right: Any) -> Any:
    """A remote DMA from ``src_ref`` here to ``dst_ref`` on the right neighbour."""
    return _tpu().make_async_remote_copy(
        src_ref=src_ref, dst_ref=dst_ref, send_sem=send_sem, recv_sem=recv_sem, device_id=(right,),
        device_id_type=_mesh_ids(),
    )  # fmt: skip


def all_gather_matmul(x_ref, y_ref, o_ref, gathered, send_sem, recv_sem, *, devices: int):  # type: ignore[no-untyped-def]  # noqa: PLR0917 - a kernel takes its refs by position
    """An all-gather matmul: the row blocks of ``x`` go round the ring of devices by remote DMA, each
    multiplied by this device's ``y`` while the next is in flight (every block has its own slot)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    me, right = _ring_met(devices)
    rows = x_ref.shape[0]
    gathered[me] = x_ref[...]

    def multiply(slot: Any) -> None:
        product = jnp.dot(gathered[slot], y_ref[...], preferred_element_type=jnp.float32)
        o_ref[pl.ds(pl.multiple_of(slot * rows, rows), rows), :] = product.astype(o_ref.dtype)

    for step in range(devices - 1):
        slot = lax.rem(me - step + devices, devices)  # the block this device received last
        copy = _to_the_right(gathered.at[slot], gathered.at[slot], send_sem, recv_sem, right)
        copy.start()
        multiply(slot)
        copy.wait()
    multiply(right)  # the last block to arrive: the right neighbour's


def reduce_scatter_matmul(a_ref, b_ref, o_ref, sending, receiving, send_sem, recv_sem, *, devices: int):  # type: ignore[no-untyped-def]  # noqa: PLR0917 - a kernel takes its refs by position
    """A reduce-scatter matmul: each device holds a slice of the contraction (``a`` and ``b``); the
    partial products of each row block go round the ring, each device adding its own, until the
    block reaches the device that keeps it (each step has its own send and receive slot)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    me, right = _ring_met(devices)
    rows = o_ref.shape[0]
    for step in range(devices):
        block = lax.rem(me - step - 1 + 2 * devices, devices)  # the last step's is this device's
        part = jnp.dot(a_ref[pl.ds(pl.multiple_of(block * rows, rows), rows), :], b_ref[...])
        if step:
            part += receiving[step - 1]  # the left neighbour's sum of this block so far
        if step == devices - 1:
            o_ref[...] = part
            break
        sending[step] = part
        copy = _to_the_right(sending.at[step], receiving.at[step], send_sem, recv_sem, right)
        copy.start()
        copy.wait()


def _reduce_scatter_matmul(mesh: Any) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    pltpu = _tpu()
    devices = mesh.size

    def body(a: Any, b: Any) -> Any:  # this device's slice of the contraction: a (devices * 16, 128), b (128, 128)
        rows = a.shape[0] // devices
        vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
        slots = pltpu.VMEM((max(devices - 1, 1), rows, b.shape[1]), jnp.float32)
        return pl.pallas_call(
            functools.partial(reduce_scatter_matmul, devices=devices),
            out_shape=jax.ShapeDtypeStruct((rows, b.shape[1]), jnp.float32),
            in_specs=[vmem, vmem],
            out_specs=vmem,
            scratch_shapes=[slots, slots, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            compiler_params=pltpu.CompilerParams(collective_id=0),
        )(a, b)

    return _shard_map(body, mesh)


def _contraction_slices(devices: int) -> list[np.ndarray]:
    """Whole numbers below 4: the sums are exact in bfloat16 passes as in float32."""
    a = (np.arange(devices * devices * ALL_GATHER_ROWS * 128) % 4).astype(np.float32).reshape(-1, 128)
    b = (np.arange(devices * 128 * 128) % 3).astype(np.float32).reshape(-1, 128)
    return [a, b]


def _reduced_product(inputs: list[np.ndarray], devices: int) -> np.ndarray:
    """The sum over devices of their a times their b, row block d on device d."""
    a, b = inputs
    slices = zip(a.reshape(devices, -1, 128), b.reshape(devices, 128, 128), strict=True)
    return sum((a_d @ b_d for a_d, b_d in slices), np.zeros((devices * ALL_GATHER_ROWS, 128), np.float32))


ALL_GATHER_ROWS = 16


def _all_gather_matmul(mesh: Any) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    pltpu = _tpu()
    devices = mesh.size

    def body(x: Any, y: Any) -> Any:  # this device's rows of x, and its own y
        vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
        return pl.pallas_call(
            functools.partial(all_gather_matmul, devices=devices),
            out_shape=jax.ShapeDtypeStruct((devices * x.shape[0], y.shape[1]), jnp.float32),
            in_specs=[vmem, vmem],
            out_specs=vmem,
            scratch_shapes=[
                pltpu.VMEM((devices, *x.shape), x.dtype),
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.DMA,
            ],
            compiler_params=pltpu.CompilerParams(collective_id=0),
        )(x, y)

    return _shard_map(body, mesh)


def _matmul_operands(devices: int) -> list[np.ndarray]:
    """Whole numbers below 4: the products are exact in bfloat16 passes as in float32."""
    x = (np.arange(devices * ALL_GATHER_ROWS * 128) % 4).astype(np.float32).reshape(-1, 128)
    y = (np.arange(devices * 128 * 128) % 3).astype(np.float32).reshape(-1, 128)
    return [x, y]


def _gathered_product(inputs: list[np.ndarray], devices: int) -> np.ndarray:
    """Device d holds all of x times its own block of y."""
    x, y = inputs
    return np.concatenate([x @ block for block in y.reshape(devices, 128, 128)])


REDUCE_SCATTER_BLOCK = (16, 128)
"""The tutorial's block: a half block is one (8, 128) vector register."""


def _reduce_scatter(mesh: Any) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    pltpu = _tpu()
    devices, block = mesh.size, REDUCE_SCATTER_BLOCK

    def body(x: Any) -> Any:  # this device's (devices * 16, 128): one block per device to sum into
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
            grid=(devices, 2),
            scratch_shapes=[pltpu.SemaphoreType.DMA] * 5
            + [pltpu.SemaphoreType.REGULAR] * 2
            + [pltpu.VMEM((block[0] // 2, block[1]), jnp.float32)],
        )
        out_shape = (jax.ShapeDtypeStruct(block, jnp.float32), jax.ShapeDtypeStruct((2, *block), jnp.float32))
        return pl.pallas_call(
            functools.partial(reduce_scatter, devices=devices, block=block),
            out_shape=out_shape,
            grid_spec=spec,
            compiler_params=pltpu.CompilerParams(collective_id=0),
        )(x.reshape(devices, *block))[0]

    return _shard_map(body, mesh)


def _reduce_scattered(inputs: list[np.ndarray], devices: int) -> np.ndarray:
    """Device d holds the sum over devices of their block d (whole numbers: exact in any order)."""
    rows, lanes = REDUCE_SCATTER_BLOCK
    return inputs[0].reshape(devices, devices, rows, lanes).sum(axis=0).reshape(devices * rows, lanes)


def _blocks_per_device(devices: int) -> list[np.ndarray]:
    rows, lanes = REDUCE_SCATTER_BLOCK
    return [(np.arange(devices * devices * rows * lanes) % 251).astype(np.float32).reshape(-1, lanes)]


GLOBAL_24MIB_ROWS = 24 * MIB // (1024 * 4)
"""A float32 array of 24 MiB, 1024 lanes wide: its shard and its output's are 24 MiB together on 2
devices (over v5e's 16 MiB scoped limit) and 12 MiB on 4."""


def _global_rows(rows: int, lanes: int) -> Callable[[int], list[np.ndarray]]:
    def make(devices: int) -> list[np.ndarray]:
        return [np.ones((rows, lanes), np.float32)]

    return make


CASES: list[Case] = [
    *(Case(f"axis_index.v5e.{n}", "tpu-v5e", n, _plus_index, _rows(8), _plus_index_reference(8)) for n in (1, 2, 4, 8)),
    Case("axis_index.v6e.4", "tpu-v6e", 4, _plus_index, _rows(8), _plus_index_reference(8)),
    Case("axis_index.v5p.8", "tpu-v5p", 8, _plus_index, _rows(8), _plus_index_reference(8)),
    *(Case(f"ring.v5e.{n}", "tpu-v5e", n, _ring, _rows(8), _ring_reference(8)) for n in (1, 2, 4)),
    Case("ring.v4.4", "tpu-v4", 4, _ring, _rows(8), _ring_reference(8)),
    *(Case(f"barrier.v5e.{n}", "tpu-v5e", n, _barrier, _rows(8), lambda inputs, n: inputs[0] * 2) for n in (1, 4)),
    Case("all_gather.v5e.4", "tpu-v5e", 4, _all_gather, _rows(8), _gathered),
    *(
        Case(f"reduce_scatter.v5e.{n}", "tpu-v5e", n, _reduce_scatter, _blocks_per_device, _reduce_scattered)
        for n in (2, 4)
    ),
    *(
        Case(f"all_gather_matmul.v5e.{n}", "tpu-v5e", n, _all_gather_matmul, _matmul_operands, _gathered_product)
        for n in (2, 4)
    ),
    *(
        Case(
            f"reduce_scatter_matmul.v5e.{n}",
            "tpu-v5e",
            n,
            _reduce_scatter_matmul,
            _contraction_slices,
            _reduced_product,
        )
        for n in (2, 4)
    ),
    *(
        Case(f"vmem_by_sharding.v5e.{n}", "tpu-v5e", n, _add_one, _global_rows(GLOBAL_24MIB_ROWS, 1024), _plus_one)
        for n in (1, 2, 4)
    ),
    *(
        Case(f"float16.{g}.{n}", f"tpu-{g}", n, _add_one, _rows(8, dtype=np.float16), _plus_one)
        for g, n in (("v5e", 1), ("v5e", 4), ("v6e", 4))
    ),
    *(
        Case(f"core_parallel.{g}.{n}", f"tpu-{g}", n, _core_parallel, _rows(16), _plus_one)
        for g, n in (("v5e", 1), ("v5e", 2), ("v6e", 2), ("v4", 2), ("v5p", 2))
    ),
]


def by_name() -> dict[str, Case]:
    return {case.name: case for case in CASES}


# --- the record: libtpu on each whole program ------------------------------------------------------


def record_one(case: Case) -> dict[str, Any]:
    """libtpu's verdict on ``case``'s whole program, compiled for a topology of its devices."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_guard._deciding import device as _device
    from pallas_guard._running import tpu_compile as _tpu_compile

    devices = _tpu_compile.topology_devices(case.generation, case.devices)
    if isinstance(devices, str):
        return {"verdict": "no topology", "why": devices}
    topology_for = _tpu_compile.topology_for(case.generation, case.devices)
    mesh = Mesh(np.array(devices, dtype=object), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in case.inputs(case.devices)]
    try:
        with _device.presented(case.generation, like=devices[0]):
            compiled = jax.jit(case.program(mesh)).lower(*avals).compile()
    except Exception as error:  # the compiler's refusal, as the chip would give it
        return {
            "verdict": "refused",
            "topology": topology_for[0] if isinstance(topology_for, tuple) else None,
            "error_type": type(error).__name__,
            "first_line": _tpu_compile.first_line(error),
        }
    usage = _tpu_compile.memory(compiled.as_text() or "", case.generation)
    return {
        "verdict": "compiles",
        "topology": topology_for[0] if isinstance(topology_for, tuple) else None,
        "vmem_used": usage.vmem_used,
        "vmem_limit": usage.vmem_limit,
    }


def record() -> None:
    import importlib.metadata

    import pallas_guard

    pallas_guard.uninstall()  # importing it installs it: the record is libtpu's alone

    versions = {name: importlib.metadata.version(name) for name in ("jax", "jaxlib", "libtpu")}
    verdicts = {case.name: record_one(case) for case in CASES}
    DATA.write_text(json.dumps({"versions": versions, "cases": verdicts}, indent=1, sort_keys=True) + "\n")
    for name, verdict in verdicts.items():
        print(name, verdict)


CHIP = Path(__file__).resolve().parent / "data" / "sharded_on_a_v5e.json"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def record_on_chip(path: str) -> None:
    """On a machine with one TPU v5e (``device``): each one-device v5e case run on the chip, with
    JAX alone. Writes the verdict (``ran``: its values right or not; ``refused``: the error's type and
    first line) to ``path``."""
    import importlib.metadata

    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    verdicts: dict[str, Any] = {}
    for case in CASES:
        if case.devices != 1 or case.generation != "tpu-v5e":
            continue
        inputs = case.inputs(1)
        try:
            out = np.asarray(case.program(mesh)(*inputs))
        except Exception as error:
            verdicts[case.name] = {"verdict": "refused", "error_type": type(error).__name__,
                                   "first_line": _first_line(error)}  # fmt: skip
            continue
        right = case.reference is not None and bool(np.array_equal(out, case.reference(inputs, 1)))
        verdicts[case.name] = {"verdict": "ran", "right": right}
    device = jax.devices()[0]
    versions = {name: importlib.metadata.version(name) for name in ("jax", "jaxlib")}
    Path(path).write_text(
        json.dumps({"device": device.device_kind, "versions": versions, "cases": verdicts}, indent=1, sort_keys=True)
        + "\n"
    )


def on_chip() -> dict[str, Any]:
    cases: dict[str, Any] = json.loads(CHIP.read_text())["cases"]
    return cases


def recorded() -> dict[str, Any]:
    cases: dict[str, Any] = json.loads(DATA.read_text())["cases"]
    return cases


if __name__ == "__main__":
    if sys.argv[1:2] == ["--on-chip"] and len(sys.argv) == 3:
        record_on_chip(sys.argv[2])
    elif sys.argv[1:] == ["--record"]:
        record()
    else:
        sys.exit("usage: JAX_PLATFORMS=cpu python tests/sharded_corpus.py --record | --on-chip PATH (on a TPU v5e)")
