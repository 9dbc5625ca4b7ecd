"""``checks=all`` left on in CI: valid kernels give no finding, every finding is a PallasGuardError.

An interpreter a check runs beside the chosen one never fails the call (the decision says what was
not compared); an option nobody asked for never fails a valid kernel (an empty DMA included); an
output block written across a grid axis declared parallel is a race named by its axis, decided from
the index maps, eager, under jit, and for a kernel built before ``install()``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._deciding import interpreters as _interpreters

needs_tpu_interpreter = pytest.mark.skipif(
    not _interpreters.available("tpu"), reason="this jax has no TPU interpret mode"
)
TPU_PARAMS: Any = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams", None)


def _calls(kernel: Any) -> dict[str, Any]:
    return {"eager": kernel, "jit": jax.jit(kernel)}


# --- an interpreter beside the chosen one that fails -------------------------------------------------


def masked_double(x_ref, o_ref):  # type: ignore[no-untyped-def]
    from jax.experimental.pallas import triton as plgpu

    # A masked load: the plain interpreter runs it, TPU interpret mode has no rule for it.
    o_ref[...] = plgpu.load(x_ref.at[pl.ds(0, 16)], mask=jnp.arange(16) < 10, other=0.0) * 2


@needs_tpu_interpreter
@pytest.mark.parametrize("how", ["eager", "jit"])
def test_an_interpreter_that_fails_beside_the_chosen_one_is_noted_and_the_call_returns(guard: Any, how: str) -> None:
    guard("interpret", checks="agree")
    kernel = pl.pallas_call(masked_double, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32))
    x = jnp.arange(16.0)
    out = np.asarray(jax.block_until_ready(_calls(kernel)[how](x)))
    np.testing.assert_array_equal(out, np.where(np.arange(16) < 10, np.arange(16.0) * 2, 0))
    notes = [note for d in pallas_guard.decisions() for note in d.notes]
    assert any(
        note.startswith("agree: not compared: TPU interpret mode fails on this kernel: NotImplementedError")
        for note in notes
    ), notes
    assert not [d for d in pallas_guard.decisions() if d.action == "found"]


@needs_tpu_interpreter
def test_under_require_checks_a_comparison_nothing_ran_beside_fails_the_call(guard: Any) -> None:
    """Only the chosen interpreter ran: the check asked for did not run, which require_checks makes
    the call's error rather than a green run."""
    guard("interpret", checks="agree", require_checks=True)
    kernel = pl.pallas_call(masked_double, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32))
    with pytest.raises(
        PallasGuardError, match=r"the agree check cannot run on Pallas kernel masked_double .*TPU interpret mode fails"
    ):
        kernel(jnp.arange(16.0))


# --- a block index past the array, found by whichever interpreter sees it ----------------------------


def plus_one(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


@needs_tpu_interpreter
@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("checks", ["bounds,agree", "all", "all,agree"])
def test_an_index_map_past_the_array_is_a_pallas_guard_error(guard: Any, how: str, checks: str) -> None:
    guard("interpret", checks=checks)
    kernel = pl.pallas_call(
        plus_one,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i + 8, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
    )
    with pytest.raises(PallasGuardError) as raised:
        jax.block_until_ready(_calls(kernel)[how](jnp.ones((16, 128))))
    assert type(raised.value) is PallasGuardError
    assert "out-of-bounds" in str(raised.value) and "CpuCallback" not in str(raised.value)


# --- an empty DMA --------------------------------------------------------------------------------------


def empty_copy(x_hbm, o_ref, buf, sem):  # type: ignore[no-untyped-def]
    start = x_hbm.shape[0] - pl.program_id(0) * 0  # traced: the copy [3:3] of a 3-row operand
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start, 0)], buf.at[pl.ds(0, 0)], sem)
    copy.start()
    copy.wait()
    o_ref[...] = jnp.full(o_ref.shape, x_hbm.shape[0], o_ref.dtype)


@pytest.mark.parametrize("checks", ["races", "bounds", "races,bounds", "all", "all,agree"])
def test_an_empty_dma_is_no_finding(guard: Any, checks: str) -> None:
    """A zero-length copy moves nothing and completes as it starts: no DMA is left in flight, and
    nothing is read out of bounds."""
    guard("interpret", checks=checks)
    kernel = pl.pallas_call(
        empty_copy,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        scratch_shapes=[pltpu.VMEM((3, 128), jnp.float32), pltpu.SemaphoreType.DMA],
    )
    for call in _calls(kernel).values():
        assert float(jax.block_until_ready(call(jnp.ones((3, 128))))[0, 0]) == 3.0
    assert not [d for d in pallas_guard.decisions() if d.action == "found"]


# --- an output block written across a parallel grid axis --------------------------------------------


def accumulate(x_ref, o_ref):  # type: ignore[no-untyped-def]
    @pl.when(pl.program_id(1) == 0)
    def _() -> None:
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += x_ref[...]


def _accumulating(semantics: tuple[str, str], out_map: Any = lambda i, j: (i, 0)) -> Any:
    return pl.pallas_call(
        accumulate,
        out_shape=jax.ShapeDtypeStruct((16 if out_map(0, 1) == out_map(0, 0) else 64, 128), jnp.float32),
        grid=(2, 4),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((8, 128), out_map),
        compiler_params=TPU_PARAMS(dimension_semantics=semantics),
    )


@pytest.mark.parametrize("how", ["eager", "jit", "built before install"])
def test_an_output_block_written_across_a_parallel_axis_is_a_race_naming_the_axis(how: str) -> None:
    pallas_guard.uninstall()
    kernel = _accumulating(("parallel", "parallel")) if how == "built before install" else None
    pallas_guard.install("interpret", checks="races")
    try:
        kernel = kernel or _accumulating(("parallel", "parallel"))
        call = jax.jit(kernel) if how == "jit" else kernel
        with pytest.raises(PallasGuardError) as raised:
            jax.block_until_ready(call(jnp.ones((32, 128))))
    finally:
        pallas_guard.uninstall()
    text = str(raised.value)
    assert "an output block written across a parallel grid axis" in text
    assert "output 0's block (0, 0) is visited by the iterations with grid axis 1 = 0, 1, 2, 3" in text
    assert "(tpu-v4, tpu-v5p, tpu7x)" in text and 'declare grid axis 1 "arbitrary"' in text


@pytest.mark.parametrize(
    ("semantics", "out_map"),
    [
        (("parallel", "arbitrary"), lambda i, j: (i, 0)),  # the reduction axis declared as such
        (("parallel", "parallel"), lambda i, j: (i * 4 + j, 0)),  # a block per iteration
    ],
    ids=["arbitrary reduction axis", "a block per iteration"],
)
def test_an_axis_declared_arbitrary_or_a_block_per_iteration_is_no_race(
    guard: Any, semantics: Any, out_map: Any
) -> None:
    guard("interpret", checks="races")
    kernel = _accumulating(semantics, out_map)
    for call in _calls(kernel).values():
        jax.block_until_ready(call(jnp.ones((32, 128))))
    assert not [d for d in pallas_guard.decisions() if d.action == "found"]


# --- a semaphore wait no signal satisfies -----------------------------------------------------------


def _signal_then_wait(signals: int, waits: int) -> Any:
    def body(x_ref, o_ref, sem):  # type: ignore[no-untyped-def]
        pl.semaphore_signal(sem, signals)
        pl.semaphore_wait(sem, waits)
        o_ref[...] = x_ref[...] + 1

    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), scratch_shapes=[pltpu.SemaphoreType.REGULAR]
    )


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_wait_for_more_than_was_signalled_is_a_finding_where_a_tpu_would_hang(guard: Any, how: str) -> None:
    guard("interpret", checks="races")
    with pytest.raises(PallasGuardError) as raised:
        jax.block_until_ready(_calls(_signal_then_wait(1, 2))[how](jnp.ones((8, 128))))
    text = str(raised.value)
    assert "a race (a semaphore wait no signal satisfies)" in text
    assert "`pl.semaphore_wait(sem, waits)`) needs 2 and the semaphore holds 1" in text
    assert "on a TPU the core waits forever" in text


def test_a_wait_for_what_was_signalled_is_no_finding(guard: Any) -> None:
    guard("interpret", checks="races")
    for call in _calls(_signal_then_wait(2, 2)).values():
        assert float(jax.block_until_ready(call(jnp.ones((8, 128))))[0, 0]) == 2.0
    assert not [d for d in pallas_guard.decisions() if d.action == "found"]


# --- a kernel built before install() -----------------------------------------------------------------


@pytest.mark.parametrize("require", [False, True], ids=["noted", "require_checks"])
def test_agree_on_a_kernel_built_before_install_says_it_could_not_run(require: bool) -> None:
    """Its calls never pass the front door, where agree runs the kernel in two interpreters: the
    decision says so (under require_checks the call fails), and the kernel runs, bounds-checked."""
    pallas_guard.uninstall()
    kernel = _accumulating(("parallel", "arbitrary"))
    pallas_guard.install("interpret", require_checks=require)
    try:
        with pallas_guard.policy(checks="agree,bounds"):
            if require:
                with pytest.raises(PallasGuardError, match="the agree check cannot run") as raised:
                    kernel(jnp.ones((32, 128)))
                assert "built before pallas_guard was installed" in str(raised.value)
                return
            out = kernel(jnp.ones((32, 128)))
        (decision,) = pallas_guard.decisions()
    finally:
        pallas_guard.uninstall()
    assert float(out[0, 0]) == 4.0  # the four iterations of the reduction axis, summed
    assert decision.action == "interpreted" and decision.interpreter == "plain"
    (note,) = [n for n in decision.notes if n.startswith("agree:")]
    assert note.startswith("agree: not checked: its kernel never passed the guard's front door (built before")
