"""Every setting takes effect where a kernel is called (traced) and lowered, not where it was built;
strict refuses only what really lowers for the CPU; one interpreter choice per kernel identity."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import abstract_tpu_device, clean_env, line_of, run_python, tensorcore_mesh
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard import PallasGuardError

pytest_plugins = ("pytester",)

X = jnp.arange(16, dtype=jnp.float32)
JAX_CPU_ERROR = "Only interpret mode is supported on CPU backend."


def double_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] * 2


def _double(x: jax.Array) -> jax.Array:
    return pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _platform_dependent(x: jax.Array) -> jax.Array:
    """A kernel used only in a GPU branch; JAX drops that branch when lowering for the CPU."""
    return jax.lax.platform_dependent(x, cuda=_double, default=lambda x: x * 2)


# --- strict: only what lowers for the CPU ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["strict", "interpret", "warn"])
def test_a_kernel_in_an_accelerator_branch_runs_under_every_policy(guard: Callable[..., None], policy: str) -> None:
    guard(policy)
    np.testing.assert_array_equal(jax.jit(_platform_dependent)(X), X * 2)
    assert [d.action for d in pallas_guard.decisions()] == []


def test_strict_builds_kernels_and_refuses_only_their_cpu_lowering(guard: Callable[..., None]) -> None:
    guard("strict")
    kernel = pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype))
    with pytest.raises(PallasGuardError, match="would lower for the CPU"):
        kernel(X)  # CALL-SITE-EAGER
    (record,) = pallas_guard.decisions()
    assert record.called_at == f"{__file__}:{line_of('CALL-SITE-EAGER')}"


def test_strict_leaves_an_aot_lowering_for_tpu_alone(guard: Callable[..., None]) -> None:
    guard("strict")
    kernel = pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype))
    tpu = abstract_tpu_device()  # Mosaic lowering asks which TPU (jax >= 0.12)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), (), abstract_device=tpu)):
        text = jax.jit(kernel).trace(X).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    assert pallas_guard.decisions() == []


MODULE_THAT_BUILDS_KERNELS = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

add_one = pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32))

def f(x):
    return jax.lax.platform_dependent(x, cuda=add_one, default=lambda x: x + 1)
"""


def test_strict_imports_a_module_that_builds_kernels_and_runs_its_cpu_branch(tmp_path: Path) -> None:
    (tmp_path / "kernels_module.py").write_text(MODULE_THAT_BUILDS_KERNELS)
    script = """
        import jax, jax.numpy as jnp
        import kernels_module
        print(jax.jit(kernels_module.f)(jnp.zeros(8, jnp.float32)).tolist())
        """
    result = run_python(script, env={"PALLAS_GUARD_POLICY": "strict", "JAX_PLATFORMS": "cpu"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]" in result.stdout


# --- settings in force at the call, for kernels built earlier --------------------------------------


def oob_kernel(i_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(i_ref[0], 8)]


def test_a_bounds_check_in_force_at_the_call_applies_to_a_kernel_built_before(guard: Callable[..., None]) -> None:
    guard("interpret")
    kernel = pl.pallas_call(
        oob_kernel,
        out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()],
    )
    with pallas_guard.policy(checks="bounds"), pytest.raises(PallasGuardError, match="out-of-bounds read"):
        kernel(jnp.array([12], jnp.int32), X)


def grid_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


def _grid_call(steps: int) -> Callable[..., Any]:
    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))
    return pl.pallas_call(
        grid_kernel, out_shape=jax.ShapeDtypeStruct((steps, 128), jnp.float32), grid=(steps,), in_specs=[spec],
        out_specs=spec,
    )  # fmt: skip


def test_a_step_budget_in_force_at_the_call_applies_to_a_kernel_built_before(guard: Callable[..., None]) -> None:
    guard("interpret", interpreter="tpu")
    kernel = _grid_call(16)
    with pallas_guard.policy(max_steps=4), pytest.raises(PallasGuardError, match="16 steps"):
        kernel(jnp.zeros((16, 128), jnp.float32))


def test_the_policy_in_force_at_the_call_wins_over_the_one_at_build(guard: Callable[..., None]) -> None:
    guard("interpret")
    with pallas_guard.policy("interpret", interpreter="tpu"):
        kernel = _grid_call(2)
    x = jnp.zeros((2, 128), jnp.float32)
    with pallas_guard.policy("strict"), pytest.raises(PallasGuardError):
        jax.jit(kernel)(x)
    jax.clear_caches()
    with pallas_guard.policy("off"), pytest.raises(ValueError, match=JAX_CPU_ERROR):
        jax.jit(kernel)(x)
    jax.clear_caches()
    pallas_guard.uninstall()
    with pytest.raises(ValueError, match=JAX_CPU_ERROR):
        kernel(x)


def test_the_interpreter_in_force_at_the_call_is_used(guard: Callable[..., None]) -> None:
    guard("interpret")
    kernel = _grid_call(2)
    with pallas_guard.policy(interpreter="tpu"):
        np.testing.assert_array_equal(kernel(jnp.zeros((2, 128), jnp.float32)), np.ones((2, 128)))
    assert [d.interpreter for d in pallas_guard.decisions()] == ["tpu"]


def test_a_decorator_form_built_before_follows_the_settings_at_the_call(guard: Callable[..., None]) -> None:
    if not hasattr(pl, "kernel"):
        pytest.skip("pl.kernel appeared in jax 0.8.1")
    guard("interpret")
    tpu = abstract_tpu_device()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), (), abstract_device=tpu)):
        mesh = tensorcore_mesh("core")
    parameters = inspect.signature(pl.kernel).parameters
    out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    shapes = {("out_type" if "out_type" in parameters else "out_shape"): out}

    @functools.partial(pl.kernel, mesh=mesh, **shapes)
    def copy(x_ref, o_ref):  # type: ignore[no-untyped-def]
        pltpu.sync_copy(x_ref, o_ref)  # HBM refs: copied, never read directly (a TPU refuses that)

    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    with pallas_guard.policy("strict"), pytest.raises(PallasGuardError):
        jax.jit(copy)(x)
    jax.clear_caches()
    np.testing.assert_array_equal(copy(x), x)
    assert [d.action for d in pallas_guard.decisions()] == ["refused", "interpreted"]


def test_uninstall_gives_jax_back_for_a_kernel_built_while_installed(guard: Callable[..., None]) -> None:
    guard("interpret")
    kernel = pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype))
    np.testing.assert_array_equal(kernel(X), X * 2)
    pallas_guard.uninstall()
    jax.clear_caches()
    with pytest.raises(ValueError, match=JAX_CPU_ERROR):
        kernel(X)


MARKED_MODULE_KERNELS = """
import jax, jax.numpy as jnp, numpy as np, pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

def oob_kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(i_ref[0], 8)]

OOB = pl.pallas_call(oob_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                     in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()])

def add_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

SPEC = pl.BlockSpec((1, 128), lambda i: (i, 0))
GRID = pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(16,),
                      in_specs=[SPEC], out_specs=SPEC)

@pytest.mark.pallas_guard(checks="bounds")
def test_bounds():
    OOB(jnp.array([12], jnp.int32), jnp.arange(16, dtype=jnp.float32))

@pytest.mark.pallas_guard("strict")
def test_strict():
    GRID(jnp.zeros((16, 128), jnp.float32))

@pytest.mark.pallas_guard(max_steps=4, interpreter="tpu")
def test_budget():
    GRID(jnp.zeros((16, 128), jnp.float32))

def test_unmarked():
    np.testing.assert_array_equal(GRID(jnp.zeros((16, 128), jnp.float32)), np.ones((16, 128)))
"""


def test_markers_apply_to_kernels_built_at_module_level(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_marked=MARKED_MODULE_KERNELS)
    for name, value in clean_env({"JAX_PLATFORMS": "cpu"}).items():
        pytester._monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-p", "pallas_guard", "--pallas-guard-policy=interpret", "-q")
    result.assert_outcomes(passed=1, failed=3)
    outcome = "\n".join(result.outlines)
    for test in ("test_bounds", "test_strict", "test_budget"):
        assert f"FAILED test_marked.py::{test}" in outcome


# --- one choice per kernel identity -----------------------------------------------------------------


def _factory(loop: bool) -> Callable[..., None]:
    """One body code object, two kernels: only the one with the loop needs TPU interpret mode (the
    plain interpreter substitutes program_id only at the body's top level)."""

    def body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        if loop:
            step = lambda i, acc: acc + pl.program_id(0)  # noqa: E731
            o_ref[...] = x_ref[...] + jax.lax.fori_loop(0, 2, step, 0).astype(x_ref.dtype)
        else:
            o_ref[...] = x_ref[...] + 1

    return body


def _from_factory(loop: bool, x: jax.Array) -> jax.Array:
    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))
    return pl.pallas_call(_factory(loop), out_shape=x, grid=(2,), in_specs=[spec], out_specs=spec)(x)


def test_two_kernels_from_one_factory_each_get_their_own_choice(guard: Callable[..., None]) -> None:
    guard("interpret")
    x = jnp.zeros((2, 128), jnp.float32)
    np.testing.assert_array_equal(_from_factory(False, x)[:, 0], [1, 1])
    np.testing.assert_array_equal(_from_factory(True, x)[:, 0], [0, 2])
    assert [d.interpreter for d in pallas_guard.decisions()] == ["plain", "tpu"]


EXPORT_SCRIPT = """
import jax, jax.numpy as jnp
from jax import export
import pallas_guard
from jax.experimental import pallas as pl

def body(x_ref, o_ref):
    step = lambda i, acc: acc + pl.program_id(0)
    o_ref[...] = x_ref[...] + jax.lax.fori_loop(0, 2, step, 0).astype(x_ref.dtype)

def f(x):
    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))
    return pl.pallas_call(body, out_shape=x, grid=(2,), in_specs=[spec], out_specs=spec)(x)

x = jnp.zeros((2, 128), jnp.float32)
try:  # first: a function traced before keeps its trace, exported as it is
    export.export(jax.jit(f), platforms=["cpu"])(x)
except pallas_guard.PallasGuardError as error:
    print("refused:", error)
print("runs:", jax.jit(f)(x)[:, 0].tolist())
"""


def test_an_export_for_the_cpu_of_a_tpu_interpreted_kernel_says_why_it_cannot() -> None:
    result = run_python(EXPORT_SCRIPT, env={"PALLAS_GUARD_POLICY": "interpret", "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert "runs: [0.0, 2.0]" in result.stdout
    refusal = result.stdout.split("refused:", 1)[1]
    assert "cannot be exported for the CPU" in refusal and "TPU interpret mode" in refusal
    assert "host callbacks" in refusal and "plain: failed" in refusal


def test_an_export_for_the_cpu_runs_a_plain_kernel(guard: Callable[..., None]) -> None:
    guard("interpret")
    from jax import export

    exported = export.export(jax.jit(_double), platforms=["cpu"])(X)
    np.testing.assert_array_equal(exported.call(X), X * 2)


# --- an eager call with verification lowers once -----------------------------------------------------


def test_an_eager_verified_call_lowers_the_kernel_once(guard: Callable[..., None]) -> None:
    """The trial lowering is the real one: the first call costs what a hand-written one does."""
    from pallas_guard._jax import lowering as jax_lowering
    from pallas_guard._jax import pallas as jax_pallas

    guard("interpret")

    def dma_body(x_hbm, o_hbm, sem):  # type: ignore[no-untyped-def]
        copy = pltpu.make_async_copy(x_hbm, o_hbm, sem)
        copy.start()
        copy.wait()

    registry, primitive = jax_lowering.lowering_registry(), jax_pallas.pallas_call_primitive()
    assert registry is not None
    guards_rule = registry.cpu[primitive]
    lowerings = []

    def counting_rule(ctx, *args, **params):  # type: ignore[no-untyped-def]
        lowerings.append(params.get("interpret"))
        return jax_lowering.unwrap_rule(guards_rule)(ctx, *args, **params)  # type: ignore[misc]

    registry.register_lowering(primitive, counting_rule, platform="cpu")
    try:
        x = jnp.ones((8, 128), jnp.float32)
        kernel = pl.pallas_call(
            dma_body,
            out_shape=x,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA],
        )
        np.testing.assert_array_equal(kernel(x), x)
    finally:
        registry.cpu[primitive] = guards_rule
    (decision,) = pallas_guard.decisions()
    assert decision.tried == ("plain: ok",)
    assert len(lowerings) == 1


# --- a verified kernel first called under jax.jit: the plain interpreter traced once ----------------


def _dma_scaled(scale: float, x: jax.Array) -> jax.Array:
    """A Mosaic-TPU DMA kernel (facts leave plain vs TPU interpret mode open: the guard verifies)."""

    def body(x_hbm, o_hbm, buffer, sem):  # type: ignore[no-untyped-def]
        pltpu.make_async_copy(x_hbm, buffer, sem).start()
        pltpu.make_async_copy(x_hbm, buffer, sem).wait()
        buffer[...] = buffer[...] * scale
        pltpu.make_async_copy(buffer, o_hbm, sem).start()
        pltpu.make_async_copy(buffer, o_hbm, sem).wait()

    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
    )(x)


@pytest.fixture
def interpreter_traces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The input shapes of each trace of the plain interpreter (JAX's rule and the guard look it up
    when they lower)."""
    from jax._src.pallas import hlo_interpreter

    traces: list[tuple[int, ...]] = []
    original = hlo_interpreter.pallas_call_hlo_interpret

    def counted(*args: Any, **params: Any) -> Any:
        traces.append(tuple(args[0].shape))
        return original(*args, **params)

    monkeypatch.setattr(hlo_interpreter, "pallas_call_hlo_interpret", counted)
    return traces


def test_a_verified_kernel_under_jit_traces_the_plain_interpreter_once(
    guard: Callable[..., None], interpreter_traces: list[tuple[int, ...]]
) -> None:
    guard("interpret")
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(jax.jit(functools.partial(_dma_scaled, 2.0))(x), x * 2)
    (decision,) = pallas_guard.decisions()
    assert (decision.interpreter, decision.layer, decision.tried) == ("plain", "lowering", ("plain: ok",))
    assert interpreter_traces == [(8, 128)]  # the trial's trace, replayed by the outer lowering


def test_a_verified_kernel_under_jit_is_lowered_with_the_bounds_check_once(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial verifies the unchecked interpreter's trace; the check's own lowering, the costly
    one, is made once, by the outer lowering, and the checked kernel still runs checked."""
    from pallas_guard._checks import checked_plain

    checked_lowerings = []
    original = checked_plain.lower

    def counted(*args: Any, **kwargs: Any) -> Any:
        checked_lowerings.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(checked_plain, "lower", counted)
    guard("interpret", checks="bounds")
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(jax.jit(functools.partial(_dma_scaled, 2.0))(x), x * 2)
    (decision,) = pallas_guard.decisions()
    assert (decision.interpreter, decision.layer, decision.tried) == ("plain", "lowering", ("plain: ok",))
    assert len(checked_lowerings) == 1


def test_kept_interpreter_traces_serve_only_their_own_kernel_and_shapes(
    guard: Callable[..., None], interpreter_traces: list[tuple[int, ...]]
) -> None:
    """Two kernels of one shape and one kernel at two shapes, all first called in one trace: each
    lowers with its own trace of the interpreter, never another's."""
    guard("interpret")
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    y = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)

    def f(x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
        return _dma_scaled(2.0, x), _dma_scaled(3.0, x), _dma_scaled(2.0, y)

    doubled, tripled, doubled_y = jax.jit(f)(x, y)
    np.testing.assert_array_equal(doubled, x * 2)
    np.testing.assert_array_equal(tripled, x * 3)
    np.testing.assert_array_equal(doubled_y, y * 2)
    assert sorted(interpreter_traces) == [(8, 128), (8, 128), (16, 128)]
    assert [d.interpreter for d in pallas_guard.decisions()] == ["plain"] * 3


def test_a_kept_interpreter_trace_matches_only_the_equation_it_was_made_from() -> None:
    from types import SimpleNamespace

    from jax._src.sharding_impls import ShardingContext

    from pallas_guard._guard import engine as _engine
    from pallas_guard._jax import lowering as jax_lowering

    def equation(scale: float, x: jax.Array) -> Any:  # traced without the guard: nothing lowers
        jaxpr = jax.jit(functools.partial(_dma_scaled, scale)).trace(x).jaxpr
        (eqn,) = [e for e in jaxpr.eqns if "interpret" in e.params]
        return eqn

    def lowering(eqn: Any, avals: Any = None) -> tuple[Any, dict[str, Any]]:
        ctx = SimpleNamespace(
            avals_in=avals or [v.aval for v in eqn.invars],
            jaxpr_eqn_ctx=eqn.ctx,
            module_context=SimpleNamespace(axis_context=ShardingContext(1)),
        )
        return ctx, {**eqn.params, "interpret": True}  # as the net substitutes it

    x = jnp.zeros((8, 128), jnp.float32)
    kept, other_kernel, other_shape = equation(2.0, x), equation(3.0, x), equation(2.0, jnp.zeros((16, 128)))
    traces = _engine.PlainTraces()
    assert traces.trace(kept)
    assert traces._take(*lowering(other_kernel)) is None
    assert traces._take(*lowering(other_shape)) is None
    assert traces._take(*lowering(kept, avals=[v.aval for v in other_shape.invars])) is None
    ctx, params = lowering(kept)
    assert traces._take(ctx, {**params, "debug": not params["debug"]}) is None
    in_shard_map = SimpleNamespace(**{**vars(ctx), "module_context": SimpleNamespace(axis_context=None)})
    assert traces._take(in_shard_map, params) is None
    with jax_lowering.equation_context(kept):  # where JAX calls the lowering rule
        assert traces._take(ctx, params) is not None
        assert traces._take(ctx, params) is None  # replayed once
