"""Failures keep their type and gain context: an eager call that fails at run time moves on to the
next candidate interpreter, the last failure says what was tried, host code asking the CPU which
accelerator it is gets a pointer to the device setting, and machine failures propagate untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import clean_env, run_python
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard

pytest_plugins = ("pytester",)


def _callback_kernel(fail: Callable[[], bool]) -> Callable[..., Any]:
    """A Mosaic-TPU kernel (verified: plain first) whose host callback fails when ``fail()`` says so:
    it lowers in every interpreter and fails only at run time."""

    def host(_: Any) -> None:
        if fail():
            raise RuntimeError("the host callback failed")

    def body(x_ref, o_ref, sem):  # type: ignore[no-untyped-def]
        jax.debug.callback(host, x_ref[0, 0])
        o_ref[...] = x_ref[...] * 2

    # The DMA semaphore makes the plain interpreter's lowering uncertain: verified, plain first.
    scratch = [pltpu.SemaphoreType.DMA]
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), scratch_shapes=scratch)


def test_an_eager_call_that_fails_at_run_time_moves_on_to_the_next_candidate(guard: Callable[..., None]) -> None:
    guard("interpret")
    calls: list[int] = []

    def first_run_fails() -> bool:
        calls.append(1)
        return len(calls) == 1

    out = _callback_kernel(first_run_fails)(jnp.ones((8, 128), jnp.float32))
    np.testing.assert_array_equal(out, np.full((8, 128), 2.0))
    (decision,) = pallas_guard.decisions()
    assert decision.interpreter == "tpu"
    assert (
        decision.tried[0].startswith("plain: failed at run time (") and "the host callback failed" in decision.tried[0]
    )
    assert decision.tried[1] == "tpu: ok"


def test_the_last_candidate_failing_keeps_the_error_and_says_what_was_tried(guard: Callable[..., None]) -> None:
    guard("interpret")
    with pytest.raises(Exception, match="the host callback failed") as info:
        _callback_kernel(lambda: True)(jnp.ones((8, 128), jnp.float32))
    assert not isinstance(info.value, pallas_guard.PallasGuardError)
    note = "\n".join(getattr(info.value, "__notes__", ()))
    assert "failed while running in TPU interpret mode" in note
    assert "plain interpreter (interpret=True): failed at run time" in note
    assert "interpret option of its own" in note


@pytest.mark.parametrize("machine_error", [MemoryError, RecursionError])
def test_a_machine_failure_during_a_trial_propagates_and_pins_nothing(
    guard: Callable[..., None], machine_error: type[BaseException]
) -> None:
    guard("interpret")
    traces: list[int] = []

    def body(x_ref, o_ref, sem):  # type: ignore[no-untyped-def]
        traces.append(1)
        if len(traces) == 1:
            raise machine_error("out of it")
        o_ref[...] = x_ref[...] + 1

    def call() -> jax.Array:
        out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
        kernel = pl.pallas_call(body, out_shape=out, scratch_shapes=[pltpu.SemaphoreType.DMA])
        return kernel(jnp.zeros((8, 128), jnp.float32))

    with pytest.raises(machine_error):
        call()
    jax.clear_caches()
    np.testing.assert_array_equal(call(), np.ones((8, 128)))
    assert [(d.interpreter, d.tried) for d in pallas_guard.decisions()] == [("plain", ("plain: ok",))]


def test_a_users_error_mentioning_core_count_keeps_its_type(guard: Callable[..., None]) -> None:
    guard("interpret")

    def body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        raise AttributeError("my config has no core_count")

    with pytest.raises(AttributeError, match="my config has no core_count") as info:
        pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(jnp.zeros((8, 128)))
    assert not isinstance(info.value, pallas_guard.PallasGuardError)


HOST_CODE_TEST = """
from jax.experimental.pallas import tpu as pltpu

def test_host_code_asks_which_tpu():
    # pltpu.create_tensorcore_mesh, or pltpu.TensorCoreMesh where jax (0.12.1) removed it
    (vars(pltpu).get("create_tensorcore_mesh") or (lambda name: pltpu.TensorCoreMesh(axis_name=name)))("core")
"""


def test_in_pytest_host_code_asking_which_tpu_gets_a_pointer_to_the_device_setting(pytester: pytest.Pytester) -> None:
    """The failure happens before any kernel, in the test's own host code: the plugin sees it."""
    pytester.makepyfile(test_host=HOST_CODE_TEST)
    for name, value in clean_env({"JAX_PLATFORMS": "cpu"}).items():
        pytester._monkeypatch.setenv(name, value)
    result = pytester.runpytest_subprocess("-p", "pallas_guard", "--pallas-guard-policy=interpret", "-q")
    result.assert_outcomes(failed=1)
    assert "PALLAS_GUARD_DEVICE=tpu-v5e" in result.stdout.str()
    result = pytester.runpytest_subprocess(
        "-p", "pallas_guard", "--pallas-guard-policy=interpret", "--pallas-guard-device=tpu-v5e", "-q"
    )
    result.assert_outcomes(passed=1)


def test_a_path_that_holds_control_characters_is_printed_escaped(tmp_path: Path) -> None:
    """A kernel defined in a file whose name holds an escape sequence and a newline: the warning, the
    strict error and the record print it escaped, on their own lines (no colour, no forged line)."""
    (tmp_path / "k\x1b[31mRED\nFAKE: ok.py").write_text(
        "import jax.numpy as jnp\n"
        "from jax.experimental import pallas as pl\n\n\n"
        "def kernel(x_ref, o_ref):\n"
        "    o_ref[...] = x_ref[...] + 1.0\n\n\n"
        "def run():\n"
        "    x = jnp.ones(8)\n"
        "    return pl.pallas_call(kernel, out_shape=x)(x)\n"
    )
    result = run_python(
        f"""
        import glob, importlib.util, warnings
        import pallas_guard

        (path,) = glob.glob({str(tmp_path)!r} + "/k*")
        spec = importlib.util.spec_from_file_location("odd", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pallas_guard.install("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.run()
        print("WARNING", ascii(str(caught[0].message)), ascii(caught[0].filename))
        print("RECORD", ascii(repr(pallas_guard.decisions()[-1])))
        pallas_guard.set_policy("strict")
        try:
            module.run()
        except pallas_guard.PallasGuardError as error:
            print("ERROR", ascii(str(error)))
        """,
        env={"JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    shown = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in result.stdout.splitlines()}
    assert set(shown) == {"WARNING", "RECORD", "ERROR"}, result.stdout
    for what, text in shown.items():
        # ascii() writes a raw ESC as \x1b and a raw newline as \n; an escaped one is \\x1b, \\n.
        assert "\\x1b" not in text.replace("\\\\x1b", ""), (what, text)
        assert "RED\\nFAKE" not in text.replace("RED\\\\nFAKE", ""), (what, text)
        assert "k\\\\x1b[31mRED\\\\nFAKE: ok.py" in text, (what, text)


def test_a_kernel_whose_body_cannot_be_traced_fails_with_its_own_error_under_strict() -> None:
    """Eagerly as under jit: the body's AttributeError, not a refusal about the CPU."""
    result = run_python(
        """
        import jax, jax.numpy as jnp
        from jax.experimental import pallas as pl
        import pallas_guard

        pallas_guard.install("strict")

        def kernel(x_ref, o_ref):
            o_ref[...] = pl.no_such_attribute(x_ref)

        x = jnp.ones(8)
        call = lambda x: pl.pallas_call(kernel, out_shape=x)(x)
        for run in (call, jax.jit(call)):
            try:
                run(x)
            except Exception as error:
                print(type(error).__name__)
        """,
        env={"JAX_PLATFORMS": "cpu"},
    )
    assert result.stdout.split() == ["AttributeError", "AttributeError"], result.stdout + result.stderr
