"""What makes interpreted kernels affordable and trustworthy in CI: the step budget
(``PALLAS_GUARD_MAX_STEPS``), checks (``PALLAS_GUARD_CHECKS``: races, bounds) and
``PALLAS_INTERPRET``; real kernels on this CPU with no ``interpret=`` anywhere."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import line_of, run_python
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._guard import engine as _engine

# --- a grid over the step budget ------------------------------------------------------------------


def grid_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] * 2


def _grid_call(x: jax.Array, steps: int, **kwargs: object) -> jax.Array:
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    call = pl.pallas_call(grid_kernel, out_shape=x, grid=(steps,), in_specs=[spec], out_specs=spec, **kwargs)
    return call(x)  # CALL-SITE-GRID


@pytest.mark.parametrize("how", ["install", "scope", "env"])
def test_a_grid_over_the_budget_is_not_run(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    x = jnp.ones((8 * 6, 128), jnp.float32)
    if how == "env":
        monkeypatch.setenv("PALLAS_GUARD_MAX_STEPS", "4")
        guard("interpret")
        source = "PALLAS_GUARD_MAX_STEPS"
    elif how == "install":
        guard("interpret", max_steps=4)
        source = "install(max_steps=...)"
    else:
        guard("interpret")
        source = "pallas_guard.policy() scope"
    with pallas_guard.policy(max_steps=4) if how == "scope" else _nothing():
        with pytest.raises(pallas_guard.PallasGuardError) as info:
            jax.jit(lambda x: _grid_call(x, 6))(x)
        np.testing.assert_array_equal(_grid_call(x[:32], 4), x[:32] * 2)  # at the budget: runs
    text = str(info.value)
    assert "'grid_kernel'" in text and f"called at {__file__}:{line_of('CALL-SITE-GRID')}" in text
    assert "its grid (6,) has 6 steps, more than the step budget of 4" in text
    assert f"(from {source})" in text and "the plain interpreter" in text
    assert "smaller shapes" in text and "larger blocks" in text and "pallas_guard_over_budget = skip" in text
    refused, ran = pallas_guard.decisions()
    assert (refused.action, refused.steps, ran.action, ran.steps) == ("refused", 6, "interpreted", 4)


def test_kernels_not_interpreted_are_never_counted(guard: Callable[..., None]) -> None:
    guard("interpret", max_steps=2)
    x = jnp.ones((8 * 6, 128), jnp.float32)
    np.testing.assert_array_equal(_grid_call(x, 6, interpret=True), x * 2)  # explicit interpret=
    with pallas_guard.policy("off"), pytest.raises(ValueError, match="Only interpret mode"):
        _grid_call(x, 6)  # not the guard's to run


def test_the_budget_applies_to_kernels_the_front_door_runs_too(guard: Callable[..., None]) -> None:
    guard("interpret", interpreter="tpu", max_steps=3)
    x = jnp.ones((8 * 6, 128), jnp.float32)
    with pytest.raises(pallas_guard.PallasGuardError, match=r"grid \(6,\) has 6 steps.*TPU interpret mode"):
        _grid_call(x, 6)


def test_decisions_record_the_steps_of_interpreted_kernels(guard: Callable[..., None]) -> None:
    guard("interpret")
    _grid_call(jnp.ones((8 * 3, 128), jnp.float32), 3)
    (decision,) = pallas_guard.decisions()
    assert (decision.action, decision.steps, decision.policy_source) == ("interpreted", 3, "install(policy=...)")


@pytest.mark.parametrize("bad", ["0", "-3", "many", "1.5"])
def test_a_bad_budget_names_the_input(bad: str) -> None:
    with pytest.raises(pallas_guard.PallasGuardConfigError, match=f"install\\(max_steps=...\\)='{bad}'"):
        pallas_guard.install(max_steps=bad)
    with pytest.raises(TypeError, match="must be a str or int"):
        pallas_guard.install(max_steps=2.5)  # type: ignore[arg-type]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --- checks: bounds --------------------------------------------------------------------------------


def oob_kernel(i_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[pl.ds(i_ref[0], 8)]  # from 12: reads 4 elements past the end


def _oob(start: int) -> jax.Array:
    x = jnp.arange(16, dtype=jnp.float32)
    specs = [pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()]
    out = jax.ShapeDtypeStruct((8,), jnp.float32)
    call = pl.pallas_call(oob_kernel, out_shape=out, in_specs=specs)
    return call(jnp.array([start], jnp.int32), x)  # CALL-SITE-OOB


def test_the_plain_interpreter_clamps_an_out_of_bounds_read_silently(guard: Callable[..., None]) -> None:
    """The negative control: without the check, a wrong answer and no error."""
    guard("interpret")
    np.testing.assert_array_equal(_oob(12), np.arange(8, 16))


def test_bounds_check_raises_on_an_out_of_bounds_read(guard: Callable[..., None]) -> None:
    guard("interpret", checks="bounds")
    np.testing.assert_array_equal(_oob(8), np.arange(8, 16))  # in bounds: runs, checked
    with pytest.raises(pallas_guard.PallasGuardError) as info:
        _oob(12)
    text = str(info.value)
    assert "out-of-bounds read in Pallas kernel 'oob_kernel'" in text
    assert f"defined at {__file__}:{line_of('def oob_kernel')}" in text
    assert f"called at {__file__}:{line_of('CALL-SITE-OOB')}" in text
    assert "checks=bounds from install(" in text  # where the setting really came from
    assert "read [12:20] of a float32[16] buffer" in text
    # Checked where it runs unchecked: the plain interpreter, at its speed.
    assert {d.interpreter for d in pallas_guard.decisions()} == {"plain"}


def test_the_races_check_keeps_a_kernel_in_the_plain_interpreter_and_says_nothing_of_cost(
    guard: Callable[..., None],
) -> None:
    """The race check runs inside the plain interpretation: a kernel on one core stays where it runs
    unchecked, with no note and no warning (a suite that turns warnings into errors passes). Forced
    to TPU interpret mode, the kernel runs there, with that interpreter's detector."""
    guard("interpret", checks="races")
    with warnings.catch_warnings():
        warnings.simplefilter("error", pallas_guard.PallasGuardWarning)
        np.testing.assert_array_equal(_oob(8), np.arange(8, 16))
    (decision,) = pallas_guard.decisions()
    assert decision.interpreter == "plain"
    assert decision.notes == ()
    assert decision.called_at == f"{__file__}:{line_of('CALL-SITE-OOB')}"
    pallas_guard.clear_decisions()
    guard("interpret", checks="races", interpreter="tpu")
    np.testing.assert_array_equal(_oob(8), np.arange(8, 16))
    (decision,) = pallas_guard.decisions()
    assert decision.interpreter == "tpu"


def test_bounds_check_under_jit_surfaces_in_jaxs_runtime_error(guard: Callable[..., None]) -> None:
    guard("interpret")
    finding = "pallas_guard: an out-of-bounds read in Pallas kernel 'oob_kernel'"
    with pallas_guard.policy(checks=["bounds"]), pytest.raises(Exception, match=finding):
        jax.block_until_ready(jax.jit(_oob, static_argnums=0)(12))


def test_a_triton_kernel_under_every_check_is_checked_in_plain_and_lowered_for_its_own_target(
    guard: Callable[..., None],
) -> None:
    from jax.experimental.pallas import triton as pltriton

    params = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams  # type: ignore[attr-defined]
    guard("interpret", checks="all")
    x = jnp.ones((8, 128), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pallas_guard.PallasGuardWarning)
        out = pl.pallas_call(grid_kernel, out_shape=x, compiler_params=params())(x)  # CALL-SITE-TRITON
    np.testing.assert_array_equal(out, x * 2)
    (decision,) = [d for d in pallas_guard.decisions() if d.action == "interpreted"]
    assert decision.interpreter == "plain"
    assert decision.called_at == f"{__file__}:{line_of('CALL-SITE-TRITON')}"
    lowered, compiled = decision.notes
    # "all" lowers it for its target too: a Triton kernel for cuda, on the family's default device,
    # and compiles it there with XLA's GPU compiler where its wheels are installed (else says why not).
    assert lowered == "lowering: lowers for cuda (NVIDIA H100 80GB HBM3, the default for triton kernels)"
    from pallas_guard._running import gpu_compile

    missing = gpu_compile.available()
    assert (
        compiled == f"compile: not checked: {missing}"
        if missing
        else compiled.startswith("compile: compiles for h100: ")
    )
    # Bounds and races are checked in the plain interpreter: nothing runs unchecked.
    assert not any("unchecked" in note for note in decision.notes)


@pytest.mark.parametrize("bad", ["race", "races,sizes", "all,none", ""])
def test_a_bad_checks_value_names_the_input(bad: str) -> None:
    if not bad:
        pytest.skip("an empty variable means unset; an empty API string is rejected below")
    with pytest.raises(
        pallas_guard.PallasGuardConfigError,
        match=r"'races', 'bounds', 'agree', 'lowering', 'compile' \(comma-separated\)",
    ):
        pallas_guard.install(checks=bad)


def test_checks_from_the_environment_and_the_older_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    from pallas_guard._vocabulary import settings as _settings

    monkeypatch.setenv("PALLAS_GUARD_DETECT_RACES", "1")
    _settings.reset()
    assert _settings.current("checks") == (frozenset({"races"}), "PALLAS_GUARD_DETECT_RACES")
    monkeypatch.setenv("PALLAS_GUARD_CHECKS", "Bounds")  # the new name wins
    _settings.reset()
    assert _settings.current("checks") == (frozenset({"bounds"}), "PALLAS_GUARD_CHECKS")


def test_uninitialised_memory_reads_as_nan_in_the_checking_interpreters() -> None:
    """README's claim that no check of its own is needed: JAX's TPU interpreter fills with NaN."""
    chosen = _interpreters.candidates(
        pallas_guard._vocabulary.settings.Setting(pallas_guard.Interpreter.AUTO, "test"), checks=frozenset({"bounds"})
    )
    value = _engine.interpret_value("tpu", chosen)
    assert getattr(value, "uninitialized_memory", "nan") == "nan"


# --- PALLAS_INTERPRET -------------------------------------------------------------------------------------

KERNEL = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import pallas_guard
def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
x = jnp.zeros(8)
try:
    out = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    print("ran", float(out[0]))
except Exception as error:
    print("raised", type(error).__name__)
print(pallas_guard.get_policy().value, [d.policy_source for d in pallas_guard.decisions()])
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PALLAS_INTERPRET": "1"}, ["ran 1.0", "interpret ['PALLAS_INTERPRET']"]),
        ({"PALLAS_INTERPRET": " TRUE "}, ["ran 1.0", "interpret ['PALLAS_INTERPRET']"]),
        ({"PALLAS_INTERPRET": "0"}, ["raised ValueError", "warn []"]),
        (
            {"PALLAS_INTERPRET": "1", "PALLAS_GUARD_POLICY": "strict"},
            ["raised PallasGuardError", "strict ['PALLAS_GUARD_POLICY']"],
        ),
    ],
)
def test_pallas_interpret(env: dict[str, str], expected: list[str]) -> None:
    """Truthy: policy interpret, from PALLAS_INTERPRET; falsy: nothing; PALLAS_GUARD_POLICY wins."""
    result = run_python(KERNEL, env={"JAX_PLATFORMS": "cpu", **env})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    if env.get("PALLAS_INTERPRET") == "0":
        # Falsy means nothing: the default policy (warn) of `import pallas_guard`, from no variable.
        assert lines[-1].startswith("warn")
    else:
        assert lines == expected


def test_a_bad_pallas_interpret_names_the_variable() -> None:
    result = run_python("import pallas_guard", env={"PALLAS_INTERPRET": "sometimes"})
    assert result.returncode != 0
    assert "PALLAS_INTERPRET='sometimes' is not a valid pallas_guard PALLAS_INTERPRET value" in result.stderr


def test_doctor_shows_checks_and_budget_with_their_sources() -> None:
    env = {"JAX_PLATFORMS": "cpu", "PALLAS_INTERPRET": "yes", "PALLAS_GUARD_DETECT_RACES": "1"}
    env["PALLAS_GUARD_MAX_STEPS"] = "64"
    result = run_python("from pallas_guard._surfaces.cli import main; raise SystemExit(main(['doctor']))", env=env)
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    assert "interpret (from PALLAS_INTERPRET)" in lines["policy"]
    assert "races (from PALLAS_GUARD_DETECT_RACES)" in lines["checks"]
    assert "64 (from PALLAS_GUARD_MAX_STEPS)" in lines["max"]
    assert "PALLAS_INTERPRET='yes'" in lines["environment"]


# --- checks: races in a Mosaic-GPU kernel ------------------------------------------------------------


def _mgpu_threads(racy: bool) -> Callable[[], jax.Array]:
    import functools
    import inspect

    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    out = "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"

    @functools.partial(plgpu.kernel, **{out: jax.ShapeDtypeStruct((2,), jnp.int32)}, num_threads=2, thread_name="x")
    def two_threads(o_ref):  # type: ignore[no-untyped-def]
        i = jax.lax.axis_index("x")
        if racy:
            o_ref[0] = i  # both threads write one element, unsynchronised
        else:
            o_ref[i] = i

    return two_threads  # type: ignore[no-any-return]


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_race_in_a_mosaic_gpu_kernel_is_reported_naming_the_kernel(guard: Callable[..., None], jitted: bool) -> None:
    if not _interpreters.available("gpu"):
        pytest.skip("this jax has no Mosaic-GPU interpreter")
    guard("interpret", checks="races")
    jnp.zeros(1).block_until_ready()  # a backend in use, as in any program by then: the target is known
    np.testing.assert_array_equal(_mgpu_threads(False)(), [0, 1])  # the control: no race, no error
    racy = _mgpu_threads(True)
    with pytest.raises(Exception, match=r"data race was detected in Pallas kernel '.*two_threads'") as info:
        jax.block_until_ready(jax.jit(racy)() if jitted else racy())
    assert isinstance(info.value, pallas_guard.PallasGuardError)  # eager and under jit alike
    assert "the Mosaic-GPU interpreter with race detection (PALLAS_GUARD_CHECKS=races)" in str(info.value)
    assert {d.interpreter for d in pallas_guard.decisions()} == {"gpu"}
    # The finding leaves the interpreter clean: the next kernel runs, and no race is reported in it
    # (under jit the error stops the computation before the interpreter's own clean-up).
    np.testing.assert_array_equal(_mgpu_threads(False)(), [0, 1])
