"""Right answers whatever JAX cached before and whichever interpreter has a bug.

JAX caches a kernel's state discharge per jaxpr object and eager executables per equation; the
checks must hold in both directions whatever ran before (checked after unchecked, unchecked after
checked, after ``uninstall()``). An interpreter choice is keyed by what determines the traced kernel
(module globals included). The table of what each interpreter gets wrong keeps the Mosaic-GPU
interpreter from grids it runs as program 0; ``checks="agree"`` finds such a disagreement itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python
from jax.experimental import pallas as pl

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas

X = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)


# --- a kernel that reaches its refs through a jitted helper ------------------------------------------


@jax.jit
def _copy_rows(x_ref, o_ref, start):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(start, 8), :]


def through_jitted_helper(start_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    _copy_rows(x_ref, o_ref, start_ref[0])


def _kernel(body: Callable[..., None]) -> Callable[..., Any]:
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=_smem()), pl.BlockSpec()],
    )


def _smem() -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.SMEM


def _run(kernel: Callable[..., Any], start: int, *, jit: bool) -> Any:
    # A new jitted function each time: one jitted function keeps its executable across settings.
    call = jax.jit(lambda *args: kernel(*args)) if jit else kernel  # noqa: PLW0108
    return jax.block_until_ready(call(jnp.array([start], jnp.int32), X))


BODIES = [through_jitted_helper]
ROUTES = [False, True]


@pytest.mark.parametrize("jit", ROUTES, ids=["eager", "jit"])
@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.__name__)
def test_a_checked_run_checks_after_an_unchecked_one(guard: Any, body: Any, jit: bool) -> None:
    """JAX cached the inner jaxpr's unchecked discharge: the checked run must not read it."""
    guard("interpret")
    kernel = _kernel(body)
    with pallas_guard.policy(checks="none"):
        clamped = _run(kernel, 12, jit=jit)  # out of bounds: the interpreter clamps, unchecked
    np.testing.assert_array_equal(clamped, X[8:16])
    with pallas_guard.policy(checks="bounds"), pytest.raises(Exception, match="out-of-bounds read"):
        _run(kernel, 12, jit=jit)
    with pallas_guard.policy(checks="bounds"), pytest.raises(Exception, match="out-of-bounds read"):
        _run(_kernel(body), 12, jit=jit)  # a fresh kernel through the same helper


@pytest.mark.parametrize("jit", ROUTES, ids=["eager", "jit"])
@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.__name__)
def test_an_unchecked_run_after_a_checked_one_is_jaxs(guard: Any, body: Any, jit: bool) -> None:
    """The checked discharge must not stay where an unchecked lowering (or JAX alone) reads it."""
    guard("interpret")
    kernel = _kernel(body)
    with pallas_guard.policy(checks="bounds"), pytest.raises(Exception, match="out-of-bounds read"):
        _run(kernel, 12, jit=jit)
    with pallas_guard.policy(checks="bounds"):
        np.testing.assert_array_equal(_run(kernel, 4, jit=jit), X[4:12])
    with pallas_guard.policy(checks="none"):
        np.testing.assert_array_equal(_run(kernel, 12, jit=jit), X[8:16])
    pallas_guard.uninstall()
    by_hand = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=_smem()), pl.BlockSpec()],
        interpret=True,
    )
    np.testing.assert_array_equal(_run(by_hand, 12, jit=jit), X[8:16])


def by_hand_kernel(start_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(start_ref[0], 8), :]


def test_interpret_true_by_hand_is_checked_eagerly_in_either_order(guard: Any) -> None:
    """JAX keeps one eager executable per equation: written by hand, the kernel's checked and
    unchecked runs must not share it, in either order; the finding is the guard's error."""
    guard("interpret")
    kernel = pl.pallas_call(
        by_hand_kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=_smem()), pl.BlockSpec()],
        interpret=True,
    )
    for order in (("none", "bounds", "none"), ("bounds", "none", "bounds")):
        jax.clear_caches()
        for checks in order:
            with pallas_guard.policy(checks=checks):
                if checks == "bounds":
                    with pytest.raises(PallasGuardError, match="out-of-bounds read"):
                        _run(kernel, 12, jit=False)
                else:
                    np.testing.assert_array_equal(_run(kernel, 12, jit=False), X[8:16])


# --- findings: one type eagerly, whatever set the check ---------------------------------------------


def oob_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(12 + pl.program_id(0) * 0, 8), :]


def test_an_eager_finding_is_pallas_guard_error_whatever_set_the_check() -> None:
    pallas_guard.install("interpret")
    kernel = pl.pallas_call(oob_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(1,))
    with pallas_guard.policy(checks="bounds"), pytest.raises(PallasGuardError, match="out-of-bounds read"):
        kernel(X)
    pallas_guard.uninstall()
    pallas_guard.install("interpret", checks="bounds")
    with pytest.raises(PallasGuardError, match="out-of-bounds read"):
        kernel(X)


def dma_whole_source(start_ref, x_hbm, o_hbm, sem):  # type: ignore[no-untyped-def]
    from jax.experimental.pallas import tpu as pltpu

    copy = pltpu.make_async_copy(x_hbm, o_hbm.at[pl.ds(start_ref[0], 8)], sem)
    copy.start()
    copy.wait()


def test_a_dma_write_from_a_whole_source_is_named_a_write(guard: Any) -> None:
    from jax.experimental.pallas import tpu as pltpu

    guard("interpret", checks="bounds")
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    kernel = pl.pallas_call(
        dma_whole_source,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=_smem()), any_space],
        out_specs=any_space,
        scratch_shapes=[pltpu.SemaphoreType.DMA],
    )
    with pytest.raises(PallasGuardError) as info:
        kernel(jnp.array([12], jnp.int32), X[:8])
    assert "DMA write [12:20, 0:128] of a float32[16, 128] buffer" in str(info.value)


# --- eager executables and uninstall(): a real process each ------------------------------------------

EAGER_THEN_GONE = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import pallas_guard

def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

pallas_guard.install("interpret")
x = jnp.arange(8.0)
kernel = pl.pallas_call(add_one, out_shape=x)
print("interpreted", kernel(x).tolist() == (x + 1).tolist())
{after}
try:
    kernel(x)
    print("after: ran")
except ValueError as error:
    print("after:", error)
"""


@pytest.mark.parametrize(
    "after", ["pallas_guard.uninstall()", "pallas_guard.set_policy('off')"], ids=["uninstall", "policy off"]
)
def test_an_eager_executable_is_not_reused_under_another_setting(after: str) -> None:
    done = run_python(EAGER_THEN_GONE.format(after=after))
    assert done.returncode == 0, done.stderr
    assert "interpreted True" in done.stdout
    assert "after: Only interpret mode is supported on CPU backend." in done.stdout, done.stdout


# --- interpreter choices keyed by what the body traces ----------------------------------------------

WITH_LOOP = False


def _factory() -> Callable[..., Any]:
    from jax import lax
    from jax.experimental.pallas import tpu as pltpu

    def body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        if WITH_LOOP:  # program_id inside a fori_loop: the plain interpreter cannot substitute it
            extra = lax.fori_loop(0, 2, lambda i, c: c + pl.program_id(0), 0)
            o_ref[...] = x_ref[...] + extra.astype(jnp.float32)
        else:
            o_ref[...] = x_ref[...] + 1.0

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=pltpu.CompilerParams(),
    )


def test_a_kept_choice_is_keyed_by_the_globals_the_body_reads(guard: Any) -> None:
    """Two kernels of one factory, same shapes, differing in a module global the body reads: the
    second needs another interpreter than the one verified for the first."""
    guard("interpret")
    x = jnp.zeros((16, 128), jnp.float32)
    np.testing.assert_array_equal(_factory()(x), x + 1)
    globals()["WITH_LOOP"] = True
    try:
        out = _factory()(x)
    finally:
        globals()["WITH_LOOP"] = False
    np.testing.assert_array_equal(out[:, 0], [0] * 8 + [2] * 8)


# --- the Mosaic-GPU interpreter and a grid ----------------------------------------------------------


def gmem_rows(x_ref, o_ref):  # type: ignore[no-untyped-def]
    i = pl.program_id(0)
    o_ref[i, :] = x_ref[i, :] * 2.0


def gmem_op(x: jax.Array) -> jax.Array:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    spec = pl.BlockSpec(memory_space=plgpu.GMEM)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(gmem_rows, out_shape=out, grid=(2,), in_specs=[spec], out_specs=spec)(x)


GMEM_X = jnp.arange(16.0, dtype=jnp.float32).reshape(2, 8)


@pytest.fixture
def gpu_interpreter() -> None:
    if jax_pallas.gpu_params_class() is None:
        pytest.skip("this jax has no Mosaic-GPU interpreter")


def _without_gpu_row(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = tuple(gap for gap in _interpreters.GETS_WRONG if gap.interpreter != "gpu")
    monkeypatch.setattr(_interpreters, "GETS_WRONG", rows)


def test_the_gpu_row_shows_what_the_gpu_interpreter_gets_wrong(
    guard: Any, gpu_interpreter: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row's evidence: without it the guard picks the Mosaic-GPU interpreter, which returns NaN
    rows; with it, the plain interpreter, exact."""
    guard("interpret")
    _without_gpu_row(monkeypatch)
    wrong = np.asarray(jax.jit(gmem_op)(GMEM_X))
    assert pallas_guard.decisions()[-1].interpreter == "gpu"
    assert np.isnan(wrong[1]).all()
    monkeypatch.undo()
    jax.clear_caches()
    for route in (jax.jit(gmem_op), gmem_op):
        np.testing.assert_array_equal(route(GMEM_X), GMEM_X * 2)
        assert pallas_guard.decisions()[-1].interpreter == "plain"
    assert "runs every step of a pallas_call's grid as program 0" in pallas_guard.decisions()[-1].reason


def _partitioned(op: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    from jax.experimental.custom_partitioning import custom_partitioning

    wrapped = custom_partitioning(op)
    kwargs: dict[str, Any] = {"sharding_rule": "i j -> i j"} if jax_lookup.jax_release() >= (0, 6) else {}
    wrapped.def_partition(
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: arg_shapes[0].sharding,
        partition=lambda mesh, arg_shapes, result_shape: (mesh, op, arg_shapes[0].sharding, (arg_shapes[0].sharding,)),
        **kwargs,
    )
    return wrapped  # type: ignore[no-any-return]


def test_inside_custom_partitioning_no_interpreter_with_effects_is_chosen(
    guard: Any, gpu_interpreter: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """custom_partitioning lowers its body without effect tokens (KeyError: OrderedIOEffect): even
    where the facts call for the Mosaic-GPU interpreter first, only plain is used there."""
    guard("interpret")
    np.testing.assert_array_equal(jax.jit(_partitioned(gmem_op))(GMEM_X), GMEM_X * 2)
    _without_gpu_row(monkeypatch)
    jax.clear_caches()
    np.testing.assert_array_equal(jax.jit(_partitioned(gmem_op))(GMEM_X), GMEM_X * 2)
    assert {decision.interpreter for decision in pallas_guard.decisions()} == {"plain"}


def test_the_agree_check_finds_the_gpu_interpreter_wrong(
    guard: Any, gpu_interpreter: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the table's row removed, the agree check finds the NaN rows itself, names both
    interpreters and the first differing element, and keeps the plain interpreter."""
    guard("interpret", checks="agree")
    _without_gpu_row(monkeypatch)
    with pytest.raises(PallasGuardError) as info:
        gmem_op(GMEM_X)
    text = str(info.value)
    assert (
        "interpreters disagree" in text
        and "output 0 at [1, 0], which the kernel wrote, is nan in the Mosaic-GPU interpreter" in text
    )
    assert "but 16.0 in the plain interpreter" in text
    assert [d.check for d in pallas_guard.decisions() if d.action == "found"] == ["agree"]  # recorded as such
    np.testing.assert_array_equal(gmem_op(GMEM_X), GMEM_X * 2)  # the guard keeps plain
    np.testing.assert_array_equal(jax.jit(gmem_op)(GMEM_X), GMEM_X * 2)


def test_the_agree_check_under_jit_compares_when_the_computation_runs(
    guard: Any, gpu_interpreter: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under jit the interpreters are compared inside the computation, on the call's own inputs,
    and only when it runs: tracing and lowering it run no interpreter."""
    guard("interpret", checks="agree")
    _without_gpu_row(monkeypatch)
    jax.jit(gmem_op).lower(GMEM_X)  # nothing computed: no finding
    jax.eval_shape(gmem_op, GMEM_X)
    with pytest.raises(PallasGuardError, match=r"interpreters disagree.*output 0 at \[1, 0\], which the kernel wrote"):
        jax.jit(gmem_op)(GMEM_X)


def add_rows(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] * 2.0 + 1.0


def test_the_agree_check_is_silent_where_interpreters_agree(guard: Any) -> None:
    """Plain and TPU interpret mode agree bit for bit on a generic kernel: no finding, the same bits
    as the unchecked run, and the decision says what was compared."""
    guard("interpret", checks="agree")
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    kernel = pl.pallas_call(
        add_rows, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype), grid=(2,), in_specs=[spec], out_specs=spec
    )
    checked = np.asarray(kernel(X))
    assert "agree: plain, tpu agree" in pallas_guard.decisions()[-1].tried
    with pallas_guard.policy(checks="none"):
        assert np.asarray(kernel(X)).tobytes() == checked.tobytes()


# --- once uninstalled, nothing left behind --------------------------------------------------------

LEAVES_NOTHING = """
import logging
import jax, jax.numpy as jnp, numpy as np
from jax._src.pallas import hlo_interpreter
from jax._src.state import discharge
from jax.experimental import pallas as pl
from jax.interpreters import mlir
from jax.experimental.pallas import mosaic_gpu, tpu  # their discharge rules, registered before
import pallas_guard

def read_at(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(s_ref[0], 8), :] * 2.0

x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
start = jnp.array([4], jnp.int32)
def by_hand():
    from jax.experimental.pallas import tpu as pltpu
    specs = [pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()]
    out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    return pl.pallas_call(read_at, out_shape=out, in_specs=specs, interpret=True)

pallas_guard.uninstall()
before = (dict(discharge._discharge_rules), hlo_interpreter._dynamic_slice,
          hlo_interpreter._dynamic_update_slice, dict(mlir._platform_specific_lowerings["cpu"]),
          getattr(hlo_interpreter, "loops", None), discharge._eval_jaxpr_discharge_state)
jax_alone = np.asarray(jax.jit(lambda s, a: by_hand()(s, a))(start, x))
pallas_guard.install("interpret", checks="bounds,agree")
guarded = np.asarray(by_hand()(start, x))
guarded_jit = np.asarray(jax.jit(lambda s, a: by_hand()(s, a))(start, x))
# jax 0.7 calls its grid loop by another name, which the guard leaves alone there (no fast path).
wrapped = (before[4] is None or hlo_interpreter.loops is not before[4],
           discharge._eval_jaxpr_discharge_state is not before[5])
pallas_guard.uninstall()
after = (dict(discharge._discharge_rules), hlo_interpreter._dynamic_slice,
         hlo_interpreter._dynamic_update_slice, dict(mlir._platform_specific_lowerings["cpu"]),
         getattr(hlo_interpreter, "loops", None), discharge._eval_jaxpr_discharge_state)
print("restored", after == before)
print("no filters", not logging.getLogger("jax._src.callback").filters)
again = np.asarray(jax.jit(lambda s, a: by_hand()(s, a))(start, x))
print("same bits", jax_alone.tobytes() == guarded.tobytes() == guarded_jit.tobytes() == again.tobytes())
print("had wrapped the grid loop and the discharge evaluator", wrapped == (True, True))
"""


def test_uninstall_leaves_nothing_behind() -> None:
    """Every function the checks and the fast plain interpretation wrapped is JAX's again, no CPU
    rule of the guard's remains, and a kernel after uninstall() gives the bits JAX alone gives."""
    done = run_python(LEAVES_NOTHING)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == [
        "restored True",
        "no filters True",
        "same bits True",
        "had wrapped the grid loop and the discharge evaluator True",
    ], done.stdout


def test_uninstall_forgets_what_install_pinned() -> None:
    """A later install() starts from the environment, not from an earlier install()'s settings."""
    from pallas_guard._vocabulary import settings as _settings

    pallas_guard.install("warn", checks="bounds,agree", device="h100")
    pallas_guard.uninstall()
    pallas_guard.install("interpret")
    assert _settings.current("checks").value == frozenset()
    assert _settings.current("device").value == "none"
