"""Right answers before speed: kernels the plain interpreter would get wrong go to TPU interpret
mode; facts are read through wrappers of the body; the net explains what plain cannot lower;
verification repeats nothing a kernel body does while traced."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard._deciding import facts as _facts
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._jax import lookup as jax_lookup

X = jnp.arange(8 * 128, dtype=jnp.int32).reshape((8, 128))


# --- refs captured through pl.run_state (a row of the "what plain gets wrong" table) --------------


def _copy_kernel(x_ref, y_ref, sem):  # type: ignore[no-untyped-def]
    pltpu.make_async_copy(x_ref, y_ref, sem).start()
    pltpu.make_async_copy(x_ref, y_ref, sem).wait()


def _stateful_copy(x: jax.Array) -> jax.Array:
    """A kernel that writes into a ref it captures (partial arguments), inside ``pl.run_state``."""

    def stateful(refs):  # type: ignore[no-untyped-def]
        x_ref, y_ref = refs
        kernel = functools.partial(_copy_kernel, x_ref, y_ref)
        pl.pallas_call(kernel, scratch_shapes=[pltpu.SemaphoreType.DMA], out_shape=[])()

    _, y = pl.run_state(stateful)((x, jnp.zeros_like(x)))
    return y


def _stateful_copy_closure(x: jax.Array) -> jax.Array:
    """The same, the refs captured by a closure and the semaphore from ``pl.run_scoped``."""

    def stateful(refs):  # type: ignore[no-untyped-def]
        x_ref, y_ref = refs

        def kernel():  # type: ignore[no-untyped-def]
            pl.run_scoped(lambda sem: _copy_kernel(x_ref, y_ref, sem), pltpu.SemaphoreType.DMA)

        pl.pallas_call(kernel, out_shape=[])()

    _, y = pl.run_state(stateful)((x, jnp.zeros_like(x)))
    return y


@pytest.mark.parametrize("build", [_stateful_copy, _stateful_copy_closure])
def test_a_kernel_writing_captured_refs_gets_the_right_answer(guard: Callable[..., None], build: Callable) -> None:  # type: ignore[type-arg]
    guard("interpret")
    np.testing.assert_array_equal(jax.jit(build)(X), X)
    (decision,) = pallas_guard.decisions()
    gap = _interpreters.plain_gets_wrong(_facts.GENERIC._replace(captured_refs="captured"))
    assert decision.interpreter == ("tpu" if gap else "plain")


def test_the_table_row_for_captured_refs_shows_what_plain_gets_wrong(guard: Callable[..., None]) -> None:
    """The row's evidence: forced to the plain interpreter, the same kernel returns zeros on the jax
    versions the row applies to (and the right answer on the others)."""
    (row,) = [gap for gap in _interpreters.GETS_WRONG if gap.fact == "captured_refs"]
    guard("interpret", interpreter="plain")
    out = np.asarray(jax.jit(_stateful_copy)(X))
    applies = row.below is None or jax_lookup.jax_release() < row.below
    wrong = int((out != np.asarray(X)).sum())
    assert (wrong > 0) is applies, f"plain got {wrong} elements wrong on jax {jax_lookup.jax_version()}"


# --- facts through wrappers ----------------------------------------------------------------------


@jax.jit
def _jitted_body(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(x_ref.dtype)


def test_a_jitted_body_reading_program_id_is_verified_and_runs(guard: Callable[..., None]) -> None:
    """Inside a jitted body, program_id sits in a nested jaxpr, where plain cannot substitute it."""
    if jax_lookup.jax_release() < (0, 10):
        pytest.xfail("TPU interpret mode before jax 0.10 cannot run a jitted kernel body (No constant handler)")
    guard("interpret")
    x = jnp.zeros((2, 128), jnp.float32)
    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))
    out = pl.pallas_call(_jitted_body, out_shape=x, grid=(2,), in_specs=[spec], out_specs=spec)(x)
    np.testing.assert_array_equal(out[:, 0], [0, 1])
    (decision,) = pallas_guard.decisions()
    assert decision.interpreter == "tpu" and decision.tried[0].startswith("plain: failed")


def test_an_hbm_annotated_aliased_input_runs(guard: Callable[..., None]) -> None:
    """Block specs in pltpu.HBM make it a Mosaic-TPU kernel, verified (plain fails it before 0.12)."""
    if not hasattr(pltpu, "with_memory_space_constraint"):
        pytest.skip("this jax has no pltpu.with_memory_space_constraint")
    if jax_lookup.jax_release() < (0, 8):
        pytest.xfail(
            "jax 0.7: the plain interpreter cannot lower the HBM-annotated input (TypeError), and TPU interpret "
            "mode leaves the aliased output's unwritten rows uninitialised (NaN), by hand too"
        )
    if jax_lookup.jax_release() < (0, 9):
        pytest.xfail("jax 0.8: TypeError on the HBM-annotated aval (ShapedArrayWithMemorySpace), by hand too")
    guard("interpret")

    def kernel(x_hbm_ref, aliased_y_input, y_hbm_ref):  # type: ignore[no-untyped-def]
        del aliased_y_input
        pltpu.sync_copy(x_hbm_ref.at[:2], y_hbm_ref.at[pl.ds(1, 2)])

    x = jnp.arange(8 * 128.0).reshape(8, 128)

    @jax.jit
    def f(x, y_init):  # type: ignore[no-untyped-def]
        y_init = pltpu.with_memory_space_constraint(y_init, pltpu.HBM)
        return pl.pallas_call(
            kernel,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.HBM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.HBM),
            out_shape=jax.ShapeDtypeStruct(y_init.shape, y_init.dtype),
            input_output_aliases={1: 0},
        )(x, y_init).T

    expected = (-x).at[1:3].set(x[:2])
    np.testing.assert_array_equal(f(x, -x), expected.T)
    (decision,) = pallas_guard.decisions()
    assert decision.tried[-1] == f"{decision.interpreter}: ok"


# --- the net explains what the plain interpreter cannot lower -----------------------------------


def _looped(x_ref, o_ref):  # type: ignore[no-untyped-def]
    total = jax.lax.fori_loop(0, 2, lambda i, acc: acc + pl.program_id(0), 0)
    o_ref[...] = x_ref[...] + total.astype(x_ref.dtype)


def test_the_net_says_which_interpreter_would_run_what_plain_cannot_lower(guard: Callable[..., None]) -> None:
    x = jnp.zeros((2, 128), jnp.float32)
    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))
    built_before = pl.pallas_call(_looped, out_shape=x, grid=(2,), in_specs=[spec], out_specs=spec)
    guard("interpret")  # the kernel was built unguarded: only the lowering net sees it
    with pytest.raises(NotImplementedError) as info:
        built_before(x)
    note = "\n".join(getattr(info.value, "__notes__", ()))
    assert "the plain interpreter, which the lowering net substituted" in note
    assert "TPU interpret mode may run it" in note and "PALLAS_GUARD_INTERPRETER=tpu" in note
    with pallas_guard.policy(interpreter="tpu"):  # the advice works for a kernel built now
        rebuilt = pl.pallas_call(_looped, out_shape=x, grid=(2,), in_specs=[spec], out_specs=spec)
        np.testing.assert_array_equal(rebuilt(x)[:, 0], [0, 2])


# --- verification repeats nothing the body does while traced -------------------------------------


@pytest.fixture
def error_logs() -> Iterator[list[str]]:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect(level=logging.ERROR)
    logging.getLogger().addHandler(handler)
    yield records
    logging.getLogger().removeHandler(handler)


@pytest.mark.parametrize("jitted", [False, True])
def test_an_unused_dma_descriptor_is_reported_once(
    guard: Callable[..., None], error_logs: list[str], jitted: bool
) -> None:
    """JAX logs an error for a DMA descriptor a kernel body built and never used, when the body is
    traced; the guard's verification (this is a Mosaic-TPU kernel) must not trace it twice."""
    guard("interpret")

    def body(x_hbm, o_hbm, sem):  # type: ignore[no-untyped-def]
        pltpu.make_async_copy(x_hbm, o_hbm, sem)  # never started
        copy = pltpu.make_async_copy(x_hbm, o_hbm, sem)
        copy.start()
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    kernel = pl.pallas_call(
        body,
        out_shape=x,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
    )
    np.testing.assert_array_equal((jax.jit(kernel) if jitted else kernel)(x), x)
    assert [record for record in error_logs if "AsyncCopyDescriptor was not used" in record] != []
    assert len([record for record in error_logs if "AsyncCopyDescriptor was not used" in record]) == 1
    assert pallas_guard.decisions()[0].tried[-1].endswith(": ok")
