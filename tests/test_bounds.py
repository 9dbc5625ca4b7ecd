"""``checks="bounds"`` in the plain interpreter: index checks at every access, in every family.

Each family gets kernels of its own: out-of-bounds reads and writes are found (eager and under
``jax.jit``), masked-off elements at a ragged edge are not, and a kernel with no finding returns
bit for bit what the unchecked plain interpreter returns.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import line_of
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

import pallas_guard
from pallas_guard import PallasGuardError

FINDING = "pallas_guard: an out-of-bounds"


def _finding(call: Callable[[], Any], *, jit: bool) -> str:
    """The finding ``call`` raises: ``PallasGuardError`` eagerly; under ``jax.jit`` JAX's runtime
    error carries it (the kernel ran inside the compiled program)."""
    if not jit:
        with pytest.raises(PallasGuardError) as info:
            jax.block_until_ready(call())
        return str(info.value)
    with pytest.raises(Exception, match=FINDING) as raised:
        jax.block_until_ready(jax.jit(call)())
    text = str(raised.value)
    return text[text.index(FINDING) :].splitlines()[0]


def _same_as_unchecked(call: Callable[[], Any]) -> Any:
    """``call`` under the check, asserted bit-identical to the unchecked plain interpreter."""
    with pallas_guard.policy(checks="none"):
        unchecked = jax.block_until_ready(call())
    checked = jax.block_until_ready(call())
    for a, b in zip(jax.tree_util.tree_leaves(unchecked), jax.tree_util.tree_leaves(checked), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return checked


@pytest.fixture(autouse=True)
def bounds(guard: Callable[..., None]) -> None:
    guard("interpret", checks="bounds")


X = jnp.arange(24, dtype=jnp.float32)


# --- generic kernels ---------------------------------------------------------------------------


def shifted_read(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 8 + 4, 8)]  # READ-SITE: step 2 reads [20:28)


def shifted_write(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[pl.ds(pl.program_id(0) * 8 + 4, 8)] = x_ref[pl.ds(pl.program_id(0) * 8, 8)]


def _generic(kernel: Any, steps: int) -> Callable[[], Any]:
    size = 8 if kernel is shifted_read else 24  # the read fills an 8-element block; the write, all
    whole = pl.BlockSpec((24,), lambda i: (0,))
    out = pl.BlockSpec((size,), lambda i: (0,))
    return lambda: pl.pallas_call(  # GENERIC-CALL
        kernel, out_shape=jax.ShapeDtypeStruct((size,), jnp.float32), grid=(steps,), in_specs=[whole], out_specs=out
    )(X)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_out_of_bounds_read_is_found_and_located(jit: bool) -> None:
    _same_as_unchecked(_generic(shifted_read, 2))  # steps 0 and 1 stay inside: no finding
    text = _finding(_generic(shifted_read, 3), jit=jit)
    assert f"{FINDING} read in Pallas kernel 'shifted_read'" in text
    assert f"defined at {__file__}:{line_of('def shifted_read')}" in text
    assert f"called at {__file__}:{line_of('GENERIC-CALL')}" in text
    assert "read [20:28] of a float32[24] buffer" in text
    assert f"test_bounds.py:{line_of('READ-SITE')} (`o_ref[...] = x_ref[pl.ds(" in text
    assert text.endswith(", at grid step (2,)")  # steps 0 and 1 read inside the buffer
    assert pallas_guard.decisions()[-1].interpreter == "plain"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_out_of_bounds_write_is_found(jit: bool) -> None:
    text = _finding(_generic(shifted_write, 3), jit=jit)
    assert f"{FINDING} write in Pallas kernel 'shifted_write'" in text
    assert "write [20:28] of a float32[24] buffer" in text


def write_when(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(x_ref[0] > 0)
    def _() -> None:
        o_ref[pl.ds(x_ref[1].astype(jnp.int32), 2)] = x_ref[pl.ds(0, 2)]  # WHEN-WRITE


def looped_read(x_ref, o_ref):  # type: ignore[no-untyped-def]
    def body(c, acc):  # type: ignore[no-untyped-def]
        return jax.lax.cond(c == x_ref[0].astype(jnp.int32), lambda: acc + x_ref[pl.ds(c * 4, 8)], lambda: acc)

    o_ref[...] = jax.lax.fori_loop(0, 3, body, jnp.zeros((8,), jnp.float32))


def while_read(x_ref, o_ref):  # type: ignore[no-untyped-def]
    def body(carry):  # type: ignore[no-untyped-def]
        i, acc = carry
        return i + 1, acc + x_ref[pl.ds(i * 4, 8)]

    steps = x_ref[0].astype(jnp.int32)
    o_ref[...] = jax.lax.while_loop(lambda c: c[0] < steps, body, (0, jnp.zeros((8,), jnp.float32)))[1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_accesses_inside_branches_and_loops_are_checked(jit: bool) -> None:
    """An access inside ``pl.when`` or a loop's branch is checked like one at the top (the grid
    step is not named there: JAX's interpreter cannot evaluate a program id inside such a body)."""

    def call(kernel: Any, x: jax.Array) -> Callable[[], Any]:
        spec = pl.BlockSpec((8,), lambda i: (i,))
        return lambda: pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(2,), in_specs=[spec], out_specs=spec
        )(x)

    inside, past = jnp.array([1.0, 6.0] + [0.0] * 14), jnp.array([1.0, 7.0] + [0.0] * 14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs unchecked" warning
        _same_as_unchecked(call(write_when, inside))
        _same_as_unchecked(call(looped_read, jnp.zeros(16)))
        _same_as_unchecked(call(while_read, jnp.ones(16)))  # one trip: reads [0:8)
    text = _finding(call(write_when, past), jit=jit)
    assert "write [7:9] of a float32[8] buffer" in text
    assert f"test_bounds.py:{line_of('WHEN-WRITE')}" in text
    text = _finding(call(looped_read, jnp.full(16, 2.0)), jit=jit)  # c == 2 reads [8:16)
    assert "read [8:16] of a float32[8] buffer" in text
    text = _finding(call(while_read, jnp.full(16, 2.0)), jit=jit)  # the second trip reads [4:12)
    assert "read [4:12] of a float32[8] buffer" in text


def copy_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_index_map_pointing_past_the_array_is_found(jit: bool) -> None:
    def call(shift: int) -> Callable[[], Any]:
        return (
            lambda: pl.pallas_call(
                copy_kernel,
                out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                grid=(2, 3),
                in_specs=[pl.BlockSpec((8,), lambda i, j: (i + shift,))],  # SHIFTED-INDEX-MAP
                out_specs=pl.BlockSpec((8,), lambda i, j: (i,)),
            )(X[:16])
        )

    np.testing.assert_array_equal(_same_as_unchecked(call(0)), X[:16])
    text = _finding(call(1), jit=jit)
    assert f"{FINDING} block copy in Pallas kernel 'copy_kernel'" in text
    assert "the block of shape [8] at element offset [16] lies outside the array" in text
    assert f"(its index map at {__file__}:{line_of('SHIFTED-INDEX-MAP')} points past" in text
    assert text.endswith(", at grid step (1, 0)")  # the first step of the second row


def test_a_ragged_last_block_is_no_finding() -> None:
    """20 elements in blocks of 8: the last block overhangs, as on a TPU/GPU; the interpreter pads."""
    spec = pl.BlockSpec((8,), lambda i: (i,))

    def call() -> Any:
        out = jax.ShapeDtypeStruct((20,), jnp.float32)
        return pl.pallas_call(copy_kernel, out_shape=out, grid=(3,), in_specs=[spec], out_specs=spec)(X[:20])

    np.testing.assert_array_equal(_same_as_unchecked(call), X[:20])


def test_a_kernel_forced_into_the_plain_interpreter_by_hand_is_checked_too() -> None:
    call = pl.pallas_call(
        shifted_read,
        out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
        grid=(3,),
        in_specs=[pl.BlockSpec((24,), lambda i: (0,))],
        out_specs=pl.BlockSpec((8,), lambda i: (0,)),
        interpret=True,
    )
    assert "read [20:28]" in _finding(lambda: call(X), jit=True)


def test_without_the_check_the_plain_interpreter_clamps_silently() -> None:
    """The negative control: the same kernel, unchecked, returns shifted values and no error."""
    with pallas_guard.policy(checks="none"):
        out = _generic(shifted_read, 3)()
    assert out.tolist() != X[20:28].tolist()  # clamped to [16:24]: a wrong answer, silently


def test_clean_kernels_of_several_shapes_return_what_the_unchecked_interpreter_returns() -> None:
    key = jax.random.key(0)
    a, b = jax.random.normal(key, (64, 128)), jax.random.normal(jax.random.key(1), (128, 32))

    def matmul_kernel(a_ref, b_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    def matmul() -> Any:
        return pl.pallas_call(
            matmul_kernel,
            out_shape=jax.ShapeDtypeStruct((64, 32), jnp.float32),
            grid=(4,),
            in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0)), pl.BlockSpec((128, 32), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((16, 32), lambda i: (i, 0)),
        )(a, b)

    def loop_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        def body(j, acc):  # type: ignore[no-untyped-def]
            return acc + x_ref[pl.ds(j * 8, 8), :]

        o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros((8, 128), jnp.float32))

    def looped() -> Any:
        return pl.pallas_call(loop_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(a)

    for call in (matmul, looped):
        _same_as_unchecked(call)
        _same_as_unchecked(jax.jit(call))


# --- Mosaic-TPU: scalar prefetch, dynamic pl.ds reads and writes, DMAs --------------------------------


def prefetch_read(idx_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(idx_ref[pl.program_id(0)], 8)]


def prefetch_write(idx_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[pl.ds(idx_ref[pl.program_id(0)], 8)] = x_ref[pl.ds(0, 8)]


def _prefetch(kernel: Any, starts: list[int], *, out: int = 8) -> Callable[[], Any]:
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(len(starts),),
        in_specs=[pl.BlockSpec((24,), lambda i, idx: (0,))],
        out_specs=pl.BlockSpec((out,), lambda i, idx: (0,)),
    )
    return lambda: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((out,), jnp.float32), grid_spec=spec)(
        jnp.array(starts, jnp.int32), X
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scalar_prefetch_dynamic_reads_and_writes(jit: bool) -> None:
    np.testing.assert_array_equal(_same_as_unchecked(_prefetch(prefetch_read, [0, 16])), X[16:24])
    assert "read [18:26] of a float32[24] buffer" in _finding(_prefetch(prefetch_read, [0, 18]), jit=jit)
    _same_as_unchecked(_prefetch(prefetch_write, [0, 8], out=16))
    assert "write [9:17] of a float32[16] buffer" in _finding(_prefetch(prefetch_write, [0, 9], out=16), jit=jit)


def block_from_prefetch(idx_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_scalar_prefetch_index_map_out_of_range_is_found(jit: bool) -> None:
    def call(blocks: list[int]) -> Callable[[], Any]:
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(2,),
            in_specs=[pl.BlockSpec((8,), lambda i, idx: (idx[i],))],  # PREFETCH-INDEX-MAP
            out_specs=pl.BlockSpec((8,), lambda i, idx: (i,)),
        )
        out = jax.ShapeDtypeStruct((16,), jnp.float32)
        return lambda: pl.pallas_call(block_from_prefetch, out_shape=out, grid_spec=spec)(
            jnp.array(blocks, jnp.int32), X
        )

    np.testing.assert_array_equal(_same_as_unchecked(call([2, 0])), np.concatenate([X[16:24], X[:8]]))
    text = _finding(call([0, 3]), jit=jit)
    assert "at element offset [24] lies outside the array" in text
    assert f"(its index map at {__file__}:{line_of('PREFETCH-INDEX-MAP')} points past" in text
    assert text.endswith(", at grid step (1,)")


def test_one_kernel_lowered_in_two_computations_reads_no_tracer_of_the_first() -> None:
    """An index map that reads a scalar-prefetch ref is discharged with the checks too: JAX caches
    that discharge by the index map's jaxpr, which every trace of the kernel shares. The second
    computation must get its own, not the first's, whose program ids were the first's tracers."""
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(2,),
        in_specs=[pl.BlockSpec((8,), lambda i, idx: (idx[i],))],
        out_specs=pl.BlockSpec((8,), lambda i, idx: (i,)),
    )
    call = pl.pallas_call(block_from_prefetch, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid_spec=spec)
    blocks = jnp.array([2, 0], jnp.int32)
    expected = np.concatenate([X[16:24], X[:8]])
    np.testing.assert_array_equal(jax.jit(lambda b, x: call(b, x) * 1)(blocks, X), expected)
    np.testing.assert_array_equal(jax.jit(lambda b, x: call(b, x) + 1)(blocks, X), expected + 1)


def dma_window(start_ref, x_hbm, o_ref, buffer, sem):  # type: ignore[no-untyped-def]
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start_ref[0], 8)], buffer, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buffer[...] * 2


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_dma_from_outside_the_source_is_found(jit: bool) -> None:
    def call(start: int) -> Callable[[], Any]:
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8,), lambda i, s: (0,)),
            scratch_shapes=[pltpu.VMEM((8,), jnp.float32), pltpu.SemaphoreType.DMA],
        )
        out = jax.ShapeDtypeStruct((8,), jnp.float32)
        return lambda: pl.pallas_call(dma_window, out_shape=out, grid_spec=spec)(jnp.array([start], jnp.int32), X)

    np.testing.assert_array_equal(_same_as_unchecked(call(16)), X[16:24] * 2)
    assert "DMA read [20:28] of a float32[24] buffer" in _finding(call(20), jit=jit)


# --- Triton: masked loads and stores at the ragged edge ------------------------------------------------


def _triton_params() -> Any:
    return pltriton.CompilerParams()  # type: ignore[attr-defined]


def masked_double(x_ref, o_ref):  # type: ignore[no-untyped-def]
    start = pl.program_id(0) * 8
    inside = start + jnp.arange(8) < 20
    x = pltriton.load(x_ref.at[pl.ds(start, 8)], mask=inside, other=0.0)
    pltriton.store(o_ref.at[pl.ds(start, 8)], x * 2, mask=inside)


def unmasked_double(x_ref, o_ref):  # type: ignore[no-untyped-def]
    start = pl.program_id(0) * 8
    o_ref[pl.ds(start, 8)] = x_ref[pl.ds(start, 8)] * 2


def wrongly_masked_double(x_ref, o_ref):  # type: ignore[no-untyped-def]
    start = pl.program_id(0) * 8
    inside = start + jnp.arange(8) < 22  # two elements too many
    x = pltriton.load(x_ref.at[pl.ds(start, 8)], mask=inside, other=0.0)
    pltriton.store(o_ref.at[pl.ds(start, 8)], x * 2, mask=start + jnp.arange(8) < 20)


def _triton(kernel: Any) -> Callable[[], Any]:
    return lambda: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((20,), jnp.float32), grid=(3,), compiler_params=_triton_params()
    )(X[:20])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_triton_masked_edges_are_no_finding_and_unmasked_ones_are(jit: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", pallas_guard.PallasGuardWarning)  # checked: nothing to warn of
        np.testing.assert_array_equal(_same_as_unchecked(_triton(masked_double)), X[:20] * 2)
    assert "read [16:24] of a float32[20] buffer" in _finding(_triton(unmasked_double), jit=jit)
    text = _finding(_triton(wrongly_masked_double), jit=jit)
    assert "read [16:24] (unmasked elements) of a float32[20] buffer" in text


# --- Mosaic-GPU, where the plain interpreter runs it ---------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_mosaic_gpu_kernel_in_the_plain_interpreter_is_checked(jit: bool) -> None:
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

    def call(steps: int) -> Callable[[], Any]:
        return lambda: pl.pallas_call(
            shifted_read,
            out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
            grid=(steps,),
            in_specs=[pl.BlockSpec((24,), lambda i: (0,))],
            out_specs=pl.BlockSpec((8,), lambda i: (0,)),
            compiler_params=plgpu.CompilerParams(),
        )(X)

    with pallas_guard.policy(interpreter="plain"):
        _same_as_unchecked(call(2))
        assert "read [20:28] of a float32[24] buffer" in _finding(call(3), jit=jit)


# --- settings at the call -------------------------------------------------------------------------


def test_eager_calls_in_and_out_of_a_bounds_scope_each_get_their_own_executable() -> None:
    """JAX keeps one executable per equation: the checked call must not reuse the unchecked one,
    nor the reverse (the front door marks the checked equation)."""
    call = _generic(shifted_read, 3)
    for _ in range(2):
        with pallas_guard.policy(checks="none"):
            clamped = jax.block_until_ready(call())
        assert clamped.tolist() == X[16:24].tolist()
        with pytest.raises(PallasGuardError, match="read \\[20:28\\]"):
            jax.block_until_ready(call())


def test_a_failure_of_the_check_itself_runs_the_kernel_unchecked_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel the check cannot handle is never failed by it: it runs in the plain interpreter as
    without the check, and its decision's note says the check did not apply; no warning, which a
    ``filterwarnings = error`` suite would turn into a failure."""
    from pallas_guard._checks import bounds as _bounds

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the check cannot handle this kernel")

    monkeypatch.setattr(_bounds, "_check_block", broken)
    spec = pl.BlockSpec((8,), lambda i: (i,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pl.pallas_call(  # UNCHECKED-CALL
            copy_kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(2,), in_specs=[spec], out_specs=spec
        )(X[:16])
    np.testing.assert_array_equal(out, X[:16])
    decision = pallas_guard.decisions()[-1]
    assert decision.called_at == f"{__file__}:{line_of('UNCHECKED-CALL')}"
    said = "bounds could not be checked: RuntimeError: the check cannot handle this kernel"
    assert any(said in note for note in decision.notes)


def test_uninstall_puts_back_every_function_the_check_wrapped() -> None:
    import logging

    from jax._src.pallas import hlo_interpreter
    from jax._src.state import discharge, primitives

    pallas_guard.uninstall()
    before = (dict(discharge._discharge_rules), hlo_interpreter._dynamic_slice, discharge._eval_jaxpr_discharge_state)
    pallas_guard.install("interpret", checks="bounds")
    jax.block_until_ready(_generic(shifted_read, 2)())
    assert discharge._discharge_rules[primitives.get_p] is not before[0][primitives.get_p]
    assert hlo_interpreter._dynamic_slice is not before[1]
    assert discharge._eval_jaxpr_discharge_state is not before[2]
    pallas_guard.uninstall()
    assert (
        dict(discharge._discharge_rules),
        hlo_interpreter._dynamic_slice,
        discharge._eval_jaxpr_discharge_state,
    ) == before
    assert not logging.getLogger("jax._src.callback").filters
    from jax._src.interpreters import pxla

    assert not getattr(pxla.ExecuteReplicated.__call__, "pallas_guard_findings", False)


def _bounds_set_by(where: str) -> contextlib.AbstractContextManager[Any]:
    """The guard reinstalled with bounds set by ``install()`` or by the ``policy()`` scope returned."""
    pallas_guard.uninstall()
    if where == "install":
        pallas_guard.install("interpret", checks="bounds")
        return contextlib.nullcontext()
    pallas_guard.install("interpret")
    return pallas_guard.policy(checks="bounds")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("where", ["install", "policy scope"])
def test_a_finding_is_a_pallas_guard_error_whatever_set_the_check(jit: bool, where: str) -> None:
    """Eager or under jit, from install() or a policy() scope: the finding reaches the caller as
    PallasGuardError itself (not inside JAX's runtime error) and is recorded as a decision."""
    call = _generic(shifted_read, 3)
    scope = _bounds_set_by(where)
    with scope, pytest.raises(PallasGuardError) as raised:
        jax.block_until_ready(jax.jit(call)() if jit else call())
    assert type(raised.value) is PallasGuardError
    assert "CpuCallback" not in str(raised.value) and raised.value.__cause__ is None
    found = [d for d in pallas_guard.decisions() if d.action == "found"]
    assert [(d.check, d.interpreter) for d in found] == [("bounds", "plain")]


def _read_at(i_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(i_ref[0], 8)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("where", ["install", "policy scope"])
def test_a_later_call_that_faults_is_a_pallas_guard_error_naming_its_call(jit: bool, where: str) -> None:
    """The executable compiled at a clean first call runs again at a faulting later one (same
    shapes, an index out of range): its finding is PallasGuardError there too (also where JAX
    dispatches a jitted computation's later calls from C++) and is recorded once. It names the
    faulting call where the kernel is called eagerly, the line of the traced code under jit."""
    kernel = pl.pallas_call(
        _read_at,
        out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec((24,), lambda i, s: (0,))],
            out_specs=pl.BlockSpec((8,), lambda i, s: (0,)),
        ),
    )

    def traced(start: jax.Array, x: jax.Array) -> jax.Array:
        return kernel(start, x)  # KERNEL-IN-JIT

    call = jax.jit(traced) if jit else kernel
    scope = _bounds_set_by(where)
    with scope:
        for start in (2, 4):
            ok = jax.block_until_ready(call(jnp.array([start], jnp.int32), X))
            assert ok.tolist() == X[start : start + 8].tolist()
        with pytest.raises(PallasGuardError) as raised:
            jax.block_until_ready(call(jnp.array([20], jnp.int32), X))  # FAULTING-CALL
    assert type(raised.value) is PallasGuardError and "CpuCallback" not in str(raised.value)
    site = f"{__file__}:{line_of('KERNEL-IN-JIT' if jit else 'FAULTING-CALL')}"
    assert f"called at {site}" in str(raised.value), str(raised.value)
    (found,) = [d for d in pallas_guard.decisions() if d.action == "found"]
    assert found.called_at == site


# --- accesses inside a pl.run_state body ------------------------------------------------------------


def _scoped_state(at: int, *, write_at: int = 0) -> Callable[[], Any]:
    """A kernel that reads 8 elements of its input at ``at`` into a ``pl.run_state`` ref (at
    ``write_at`` of its 16), then copies 8 of them out."""

    def kernel(i_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
        def body(refs):  # type: ignore[no-untyped-def]
            (local,) = refs
            local[pl.ds(i_ref[1], 8)] = x_ref[pl.ds(i_ref[0], 8)]
            o_ref[...] = local[pl.ds(0, 8)] * 2

        pl.run_state(body)((jnp.zeros((16,), jnp.float32),))

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()],
    )
    return lambda: call(jnp.array([at, write_at], jnp.int32), X)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_access_inside_a_run_state_body_is_checked(jit: bool) -> None:
    read = _finding(_scoped_state(20), jit=jit)
    assert "out-of-bounds read" in read and "read [20:28] of a float32[24] buffer" in read
    write = _finding(_scoped_state(0, write_at=12), jit=jit)
    assert "out-of-bounds write" in write and "[12:20] of a float32[16] buffer" in write


def test_a_run_state_body_within_bounds_is_bit_identical_and_fully_checked() -> None:
    out = _same_as_unchecked(_scoped_state(16))
    assert np.asarray(out).tolist() == [float(2 * v) for v in range(16, 24)]
    notes = [n for d in pallas_guard.decisions() for n in d.notes]
    assert not [n for n in notes if "run_state" in n], notes


# --- block copies decided while lowering ----------------------------------------------------------


def _has_checks_at_run_time(call: Callable[[], Any]) -> bool:
    """Whether the checked lowering of ``call`` holds a check that calls back to the host."""
    return "callback" in jax.jit(call).lower().as_text()


def tiled_double(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] * 2


def _tiled(in_map: Any, *, squeezed: bool = False) -> Callable[[], Any]:
    x = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16)
    block = (None, 8) if squeezed else (8, 8)
    out = jax.ShapeDtypeStruct((4, 16) if squeezed else (32, 16), jnp.float32)
    return lambda: pl.pallas_call(
        tiled_double,
        out_shape=out,
        grid=(4, 2),
        in_specs=[pl.BlockSpec(block, in_map)],
        out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
    )(x)


@pytest.mark.parametrize(
    "in_map",
    [
        lambda i, j: (i, j),
        lambda i, j: (3 - i, (j + 1) % 2),
        lambda i, j: (jnp.minimum(i + 1, 3), lax.div(j, 2)),
        lambda i, j: (jnp.where(i < 2, i + 2, i - 2), 1 - j),
        lambda i, j: ((i / 2).astype(jnp.int32) * 2, j),  # float arithmetic: JAX's own evaluation
    ],
    ids=["identity", "reversed", "clamped", "where", "float"],
)
def test_block_copies_inside_at_every_grid_step_are_decided_while_lowering(in_map: Any) -> None:
    """Index maps of program ids alone are computed over the whole grid while lowering: where every
    block lies inside its array the kernel carries no check of its copies, and returns what it
    returns unchecked."""
    call = _tiled(in_map)
    assert not _has_checks_at_run_time(call)
    _same_as_unchecked(call)
    with pallas_guard.policy(checks="none"):
        assert not _has_checks_at_run_time(call)


def test_a_block_copy_outside_at_one_grid_step_keeps_its_check_and_is_found() -> None:
    call = _tiled(lambda i, j: (jnp.where(i == 3, 4, i), j))  # the last row of steps points past the array
    assert _has_checks_at_run_time(call)
    text = _finding(call, jit=True)
    assert "the block of shape [8, 8] at element offset [32, 0] lies outside the array" in text
    assert text.endswith(", at grid step (3, 0)")


def test_squeezed_block_dimensions_are_decided_as_the_interpreter_places_them() -> None:
    inside = _tiled(lambda i, j: (i + 28, j), squeezed=True)  # rows 28..31 of 32
    assert not _has_checks_at_run_time(inside)
    _same_as_unchecked(inside)
    outside = _tiled(lambda i, j: (i + 29, j), squeezed=True)  # row 32 at the last step
    assert _has_checks_at_run_time(outside)
    assert "at element offset [32, 0] lies outside the array" in _finding(outside, jit=True)


def test_a_grid_too_long_to_compute_while_lowering_is_checked_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pallas_guard._checks import on_numbers

    monkeypatch.setattr(on_numbers, "GRID_POINTS", 4)  # the grid has 8 steps
    call = _tiled(lambda i, j: (i, j))
    assert _has_checks_at_run_time(call)
    _same_as_unchecked(call)


def test_an_index_map_reading_a_prefetched_value_is_checked_as_it_runs() -> None:
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(2,),
        in_specs=[pl.BlockSpec((8,), lambda i, idx: (idx[i],))],
        out_specs=pl.BlockSpec((8,), lambda i, idx: (i,)),
    )
    out = jax.ShapeDtypeStruct((16,), jnp.float32)
    call = lambda: pl.pallas_call(block_from_prefetch, out_shape=out, grid_spec=spec)(  # noqa: E731
        jnp.array([2, 0], jnp.int32), X
    )
    assert _has_checks_at_run_time(call)
