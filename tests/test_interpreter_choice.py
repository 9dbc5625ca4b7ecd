"""The per-kernel interpreter choice, the user's override, race detection and clear failures.

Kernel facts come from real JAX objects (CompilerParams, scratch shapes, kernel bodies); the
end-to-end tests run real kernels on this CPU under the guard, with no ``interpret=``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import abstract_tpu_device, add, run_python, tensorcore_mesh
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._deciding import facts as _facts
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._guard import engine as _engine
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._vocabulary import settings as _settings

AUTO = _settings.Setting(pallas_guard.Interpreter.AUTO, "default")


def _setting(name: str) -> _settings.Setting[pallas_guard.Interpreter]:
    return _settings.Setting(_settings.parse("interpreter", name, "test"), "test")


def _interpreted(kernel_name: str | None = None) -> list[str | None]:
    return [
        d.interpreter
        for d in pallas_guard.decisions()
        if d.action == "interpreted" and (kernel_name is None or kernel_name in d.kernel)
    ]


# --- kernels ----------------------------------------------------------------------------------------


def copy_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...]


def remote_kernel(x_ref, o_ref, send_sem, recv_sem):  # type: ignore[no-untyped-def]
    # Never traced here: only its code is inspected.
    pltpu.async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=1).wait()


def signalling_kernel(x_ref, o_ref, sem):  # type: ignore[no-untyped-def]
    pl.semaphore_signal(sem, 1, device_id=0)


def dma_kernel(x_ref, o_ref, scratch, sem):  # type: ignore[no-untyped-def]
    copy = pltpu.make_async_copy(x_ref, scratch, sem.at[0])
    copy.start()
    copy.wait()
    o_ref[...] = scratch[...]


def racy_kernel(x_ref, o_ref, scratch, sem):  # type: ignore[no-untyped-def]
    copy = pltpu.make_async_copy(x_ref, scratch, sem.at[0])
    copy.start()
    o_ref[...] = scratch[...]  # reads the buffer the DMA is still writing
    copy.wait()


def _dma_call(kernel: Callable[..., None], x: jax.Array) -> jax.Array:
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((1,))],
    )(x)


def _triton_params() -> object:
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4)


def _mosaic_gpu() -> object:
    return pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


# --- kernel facts -------------------------------------------------------------------------------------


def test_generic_kernel_has_no_backend_and_no_cross_device_needs() -> None:
    facts = _facts.kernel_facts("pallas_call", copy_kernel, {})
    assert facts.family is None
    assert facts.cross_device is None


@pytest.mark.parametrize(
    ("make_params", "family"),
    [
        (pltpu.CompilerParams, "mosaic_tpu"),
        (_triton_params, "triton"),
        (lambda: _mosaic_gpu().CompilerParams(), "mosaic_gpu"),  # type: ignore[attr-defined]
    ],
    ids=["tpu", "triton", "mosaic_gpu"],
)
def test_compiler_params_classified_by_defining_module(make_params: Callable[[], object], family: str) -> None:
    facts = _facts.kernel_facts("pallas_call", copy_kernel, {"compiler_params": make_params()})
    assert facts.family == family
    assert "compiler_params" in facts.family_evidence


def test_tpu_grid_spec_and_scratch_shapes_mark_a_tpu_kernel() -> None:
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, scratch_shapes=[pltpu.SemaphoreType.DMA])
    assert _facts.kernel_facts("pallas_call", copy_kernel, {"grid_spec": grid_spec}).family == "mosaic_tpu"
    scratch = {"scratch_shapes": [pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))]}
    facts = _facts.kernel_facts("pallas_call", dma_kernel, scratch)
    assert facts.family == "mosaic_tpu"
    assert facts.cross_device is None  # local DMAs and DMA semaphores: the plain interpreter runs them


def test_plgpu_kernel_is_mosaic_gpu() -> None:
    assert _facts.kernel_facts("plgpu.kernel", copy_kernel, {}).family == "mosaic_gpu"


@pytest.mark.parametrize(
    ("body", "kwargs", "why"),
    [
        (copy_kernel, {"compiler_params": pltpu.CompilerParams(collective_id=0)}, "collective_id"),
        (copy_kernel, {"scratch_shapes": [pltpu.SemaphoreType.BARRIER]}, "BARRIER"),
        (remote_kernel, {}, "async_remote_copy"),
        (functools.partial(remote_kernel), {}, "async_remote_copy"),
        (signalling_kernel, {}, "device_id"),
    ],
    ids=["collective_id", "barrier-scratch", "remote-dma", "remote-dma-partial", "device-id-signal"],
)
def test_cross_device_facts(body: Callable[..., None], kwargs: dict[str, object], why: str) -> None:
    facts = _facts.kernel_facts("pallas_call", body, kwargs)
    assert facts.cross_device is not None
    assert why in facts.cross_device


def test_triton_kernel_is_never_cross_device() -> None:
    facts = _facts.kernel_facts("pallas_call", remote_kernel, {"compiler_params": _triton_params()})
    assert facts.family == "triton"
    assert facts.cross_device is None


def _core_mesh() -> object:
    """``pltpu.create_tensorcore_mesh`` asks the device for its core count: on a CPU, an abstract TPU answers."""
    tpu = abstract_tpu_device()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), (), abstract_device=tpu)):
        return tensorcore_mesh("core")


# --- candidates() -----------------------------------------------------------------------------------


def test_generic_and_triton_kernels_get_the_plain_interpreter_alone() -> None:
    for kwargs in ({}, {"compiler_params": _triton_params()}):
        chosen = _interpreters.candidates(AUTO, _facts.kernel_facts("pallas_call", dma_kernel, kwargs))
        assert chosen.names == ("plain",) and not chosen.verify
        assert _engine.interpret_value("plain", chosen) is None  # the lowering net substitutes interpret=True


def test_mosaic_tpu_kernels_try_plain_first_and_verify() -> None:
    facts = _facts.kernel_facts("pallas_call", dma_kernel, {"compiler_params": pltpu.CompilerParams()})
    chosen = _interpreters.candidates(AUTO, facts)
    assert chosen.names == ("plain", "tpu") and chosen.verify


def test_kernels_over_a_tpu_core_mesh_get_tpu_interpret_mode() -> None:
    mesh = _core_mesh()
    facts = _facts.kernel_facts("pl.kernel", copy_kernel, {"mesh": mesh})
    assert facts.core_mesh == type(mesh).__name__
    chosen = _interpreters.candidates(AUTO, facts)
    assert chosen.names == ("tpu", "plain") and chosen.verify
    assert "TPU core mesh" in chosen.reason


def test_program_id_inside_control_flow_is_verified_with_tpu_interpret_mode_as_fallback() -> None:
    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        @pl.when(x_ref[0, 0] > 0)
        def _():  # type: ignore[no-untyped-def]
            o_ref[...] = x_ref[...] + pl.program_id(0)

    chosen = _interpreters.candidates(AUTO, _facts.kernel_facts("pallas_call", kernel, {}))
    assert chosen.names == ("plain", "tpu") and chosen.verify
    assert "program_id" in chosen.reason
    # At the top level the plain interpreter handles it: nothing to verify.
    assert _interpreters.candidates(AUTO, _facts.kernel_facts("pallas_call", copy_kernel, {})).names == ("plain",)


def test_cross_device_kernels_get_tpu_interpret_mode_with_eager_dmas() -> None:
    facts = _facts.kernel_facts("pallas_call", remote_kernel, {})
    chosen = _interpreters.candidates(AUTO, facts)
    assert chosen.names == ("tpu",) and not chosen.verify
    value = _engine.interpret_value("tpu", chosen)
    assert isinstance(value, jax_pallas.tpu_params_class())  # type: ignore[arg-type]
    assert value.dma_execution_mode == "eager"
    assert "cross-device" in chosen.reason


def test_mosaic_gpu_kernels_try_the_mosaic_gpu_interpreter_first() -> None:
    facts = _facts.kernel_facts("plgpu.kernel", copy_kernel, {})
    chosen = _interpreters.candidates(AUTO, facts)
    assert chosen.names == ("gpu",) and not chosen.verify
    gpu_class = jax_pallas.gpu_params_class()
    if gpu_class is not None:  # jax < 0.9.0 has none
        assert isinstance(_engine.interpret_value("gpu", chosen), gpu_class)
    facts = facts._replace(entry_point="pallas_call")  # a pallas_call with Mosaic-GPU compiler_params
    assert _interpreters.candidates(AUTO, facts).names == ("gpu", "plain", "tpu")


@pytest.mark.parametrize("forced", ["plain", "tpu", "gpu"])
def test_forced_interpreter_wins_over_facts(forced: str) -> None:
    facts = _facts.kernel_facts("pallas_call", remote_kernel, {})
    chosen = _interpreters.candidates(_setting(forced), facts)
    assert chosen.names == (forced,) and not chosen.verify
    assert "forced by test" in chosen.reason


def test_race_detection_stays_where_the_kernel_runs() -> None:
    races = frozenset({"races"})
    # Kernels on one core stay in the plain interpreter, which checks races itself at its speed:
    # nothing to warn of. A Mosaic-TPU kernel plain may get wrong keeps TPU interpret mode as its
    # verified second choice, with that interpreter's detector on.
    mosaic_tpu = _facts.kernel_facts("pallas_call", dma_kernel, {"compiler_params": pltpu.CompilerParams()})
    triton = _facts.kernel_facts("pallas_call", copy_kernel, {"compiler_params": _triton_params()})
    for facts in (_facts.GENERIC, mosaic_tpu, triton):
        chosen = _interpreters.candidates(AUTO, facts, checks=races)
        assert chosen.names[0] == "plain" and chosen.checked == races and chosen.checks_note is None
        assert chosen.detect_races == ("tpu" in chosen.names)
    # Kernels whose interpreter is already a checking one keep it, its detector on.
    core_mesh = _facts.kernel_facts("pl.kernel", copy_kernel, {"mesh": _core_mesh()})
    mosaic_gpu = _facts.kernel_facts("plgpu.kernel", copy_kernel, {})
    for facts, checking in ((core_mesh, "tpu"), (mosaic_gpu, "gpu")):
        chosen = _interpreters.candidates(AUTO, facts, checks=races)
        assert chosen.names == (checking,) and chosen.checked == races and chosen.checks_note is None
    # Forced to TPU interpret mode: the route to JAX's detector stays open.
    forced = _interpreters.candidates(_setting("tpu"), _facts.GENERIC, checks=races)
    assert forced.names == ("tpu",) and forced.detect_races
    assert _engine.interpret_value("tpu", forced).detect_races is True


def test_inside_a_lowering_only_plain_is_possible() -> None:
    facts = _facts.kernel_facts("pallas_call", remote_kernel, {})
    chosen = _interpreters.candidates(_setting("tpu"), facts, effects_refused="traced during lowering")
    assert chosen.names == ("plain",)
    assert "lowering" in chosen.reason


def test_collective_id_alone_selects_tpu_interpret_mode() -> None:
    facts = _facts.kernel_facts("pallas_call", None, {"compiler_params": pltpu.CompilerParams(collective_id=0)})
    assert _interpreters.candidates(AUTO, facts).names == ("tpu",)


# --- end to end: real kernels under the guard ------------------------------------------------------


def test_auto_runs_a_dma_kernel_with_the_plain_interpreter(guard: Callable[..., None]) -> None:
    guard("interpret")
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)
    assert _interpreted("dma_kernel") == ["plain"]
    # Eager: verified and run in one lowering, recorded at the call with what was tried.
    assert [(d.layer, d.tried) for d in pallas_guard.decisions()] == [("front door", ("plain: ok",))]


@pytest.mark.parametrize("how", ["install", "scope"])
def test_api_override_forces_tpu_interpret_mode(guard: Callable[..., None], how: str, xs: jax.Array) -> None:
    if how == "install":
        guard("interpret", interpreter="tpu")
        out = add(xs, xs)
    else:
        guard("interpret")
        with pallas_guard.policy(interpreter="tpu"):
            out = add(xs, xs)
    np.testing.assert_array_equal(out, xs + xs)
    [decision] = pallas_guard.decisions()
    assert decision.interpreter == "tpu"
    assert decision.layer == "front door"
    assert "forced by" in decision.reason


def test_env_override_and_bad_value() -> None:
    code = """
        import jax, jax.numpy as jnp
        from jax.experimental import pallas as pl
        import pallas_guard
        def k(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2
        x = jnp.ones((8, 128))
        out = pl.pallas_call(k, out_shape=x)(x)
        assert float(out.sum()) == 2 * 8 * 128
        print([d.interpreter for d in pallas_guard.decisions()])
    """
    env = {"JAX_PLATFORMS": "cpu", "PALLAS_GUARD_POLICY": "interpret", "PALLAS_GUARD_INTERPRETER": "TPU"}
    result = run_python(code, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "['tpu']"
    bad = run_python("import pallas_guard", env={**env, "PALLAS_GUARD_INTERPRETER": "mosaic"})
    assert "PALLAS_GUARD_INTERPRETER='mosaic'" in bad.stderr
    assert "'auto', 'plain', 'tpu', 'gpu'" in bad.stderr


def _detect_races(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PALLAS_GUARD_DETECT_RACES", "1")
    _settings.reset()


RACE_FINDING = r"^pallas_guard: a race \(read of a DMA's destination before its wait\) in Pallas kernel 'racy_kernel'"


def test_race_is_reported_as_pallas_guard_error_naming_the_kernel(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    guard("interpret")
    _detect_races(monkeypatch)
    x = jnp.ones((8, 128), jnp.float32)
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)  # the control: no race, no error
    with pytest.raises(pallas_guard.PallasGuardError, match=RACE_FINDING):
        _dma_call(racy_kernel, x)
    assert _interpreted() == ["plain"]  # found in the plain interpreter (the finding is its own decision)


def test_race_under_jit_names_the_kernel(guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    guard("interpret")
    _detect_races(monkeypatch)
    x = jnp.ones((8, 128), jnp.float32)
    # Under jit the check fails inside the computation; its finding reaches the caller as the
    # guard's own error all the same, not wrapped in JAX's.
    with pytest.raises(PallasGuardError, match=RACE_FINDING):
        jax.block_until_ready(jax.jit(functools.partial(_dma_call, racy_kernel))(x))
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)


def test_a_race_found_by_tpu_interpret_mode_forced_names_the_kernel_and_leaves_it_clean(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    _detect_races(monkeypatch)
    guard("interpret", interpreter="tpu")
    x = jnp.ones((8, 128), jnp.float32)
    # Under jit the detector's verdict is read in a callback after the kernel.
    with pytest.raises(PallasGuardError, match=r"^pallas_guard: a data race was detected in .*racy_kernel"):
        jax.block_until_ready(jax.jit(functools.partial(_dma_call, racy_kernel))(x))
    # The error stopped the computation before TPU interpret mode cleaned up: the guard did it, so
    # the next kernel runs and is not reported for the race of the last one.
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)
    assert _interpreted("dma_kernel") == ["tpu"]


def _failing_in_tpu_interpret_mode(x_ref, o_ref):  # type: ignore[no-untyped-def]
    def fail(_: object) -> None:
        raise RuntimeError("the kernel's host callback failed")

    o_ref[...] = x_ref[...]
    jax.debug.callback(fail, x_ref[0, 0])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_kernel_that_failed_in_tpu_interpret_mode_leaves_race_detection_on_for_the_next(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch, traced: bool
) -> None:
    # A failed kernel skips TPU interpret mode's clean-up, and JAX reuses the state it left: the next
    # kernel ran with that kernel's settings (race detection off) and its race went unreported.
    _detect_races(monkeypatch)
    guard("interpret", interpreter="tpu")
    x = jnp.ones((8, 128), jnp.float32)
    failing = pl.pallas_call(_failing_in_tpu_interpret_mode, out_shape=x, interpret=pltpu.InterpretParams())
    with pytest.raises(Exception, match="the kernel's host callback failed"):
        jax.block_until_ready(failing(x))
    racy = functools.partial(_dma_call, racy_kernel)
    with pytest.raises(PallasGuardError, match=r"^pallas_guard: a data race was detected in .*racy_kernel"):
        jax.block_until_ready(jax.jit(racy)(x) if traced else racy(x))
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)  # and the one after the race runs clean


def test_a_race_found_under_jit_is_not_logged_as_a_failed_callback(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _detect_races(monkeypatch)
    guard("interpret", interpreter="tpu")
    x = jnp.ones((8, 128), jnp.float32)
    with caplog.at_level("ERROR"), pytest.raises(PallasGuardError):
        jax.block_until_ready(jax.jit(functools.partial(_dma_call, racy_kernel))(x))
    # The finding reaches the caller once, as the guard's error: not also as a logged traceback.
    assert not [r for r in caplog.records if r.exc_info and "pallas_guard finding" in str(r.exc_info[1])]


def _waits_for_more_than_signalled(x_ref, o_ref, sem):  # type: ignore[no-untyped-def]
    pl.semaphore_signal(sem, 1)
    pl.semaphore_wait(sem, 2)
    o_ref[...] = x_ref[...]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_wait_nothing_signals_in_tpu_interpret_mode_is_a_finding_not_a_hang(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch, traced: bool
) -> None:
    # TPU interpret mode blocks the core's thread until the count is there, which never comes.
    _detect_races(monkeypatch)
    guard("interpret", interpreter="tpu")
    x = jnp.ones((8, 128), jnp.float32)
    call = pl.pallas_call(_waits_for_more_than_signalled, out_shape=x, scratch_shapes=[pltpu.SemaphoreType.REGULAR])
    with pytest.raises(
        PallasGuardError, match=r"^pallas_guard: a race \(a semaphore wait no signal satisfies\)"
    ) as info:
        jax.block_until_ready(jax.jit(call)(x) if traced else call(x))
    assert "the waits of device 0 core 0 for 2 (it holds 1) in TPU interpret mode" in str(info.value)
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)  # the next kernel runs clean


def test_uninstall_puts_the_judged_waits_back_and_forgets_the_guards_interpreter_state(
    guard: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    semaphore = jax_pallas.semaphore_class("tpu")
    if semaphore is None:
        pytest.skip("this jax has no TPU interpret mode semaphore")
    jaxs_wait = vars(semaphore)["wait"]
    _detect_races(monkeypatch)
    guard("interpret", interpreter="tpu")
    x = jnp.ones((8, 128), jnp.float32)
    np.testing.assert_array_equal(_dma_call(dma_kernel, x), x)
    assert vars(semaphore)["wait"] is not jaxs_wait  # judged while the guard is installed
    assert "tpu" in jax_pallas._guards_states
    pallas_guard.uninstall()
    assert vars(semaphore)["wait"] is jaxs_wait
    assert "tpu" not in jax_pallas._guards_states


def test_env_switches_race_detection_on() -> None:
    code = """
        import jax, jax.numpy as jnp
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu
        import pallas_guard
        def racy(x_ref, o_ref, scratch, sem):
            copy = pltpu.make_async_copy(x_ref, scratch, sem.at[0])
            copy.start()
            o_ref[...] = scratch[...]
            copy.wait()
        x = jnp.ones((8, 128))
        try:
            pl.pallas_call(
                racy, out_shape=x, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((1,))],
            )(x)
        except pallas_guard.PallasGuardError as error:
            print(str(error).splitlines()[0])
        print([d.interpreter for d in pallas_guard.decisions()])
    """
    env = {"JAX_PLATFORMS": "cpu", "PALLAS_GUARD_POLICY": "interpret", "PALLAS_GUARD_DETECT_RACES": "1"}
    result = run_python(code, env=env)
    assert result.returncode == 0, result.stderr
    first, interpreters = result.stdout.strip().splitlines()[-2:]
    assert "pallas_guard: a race (read of a DMA's destination before its wait)" in first
    assert "from PALLAS_GUARD_DETECT_RACES" in first
    assert interpreters == "['plain']"


# --- clear failures -------------------------------------------------------------------------------------


def test_triton_kernel_forced_into_tpu_interpret_mode_fails_clearly(guard: Callable[..., None], xs: jax.Array) -> None:
    guard("interpret", interpreter="tpu")

    def triton_add(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1

    call = pl.pallas_call(triton_add, out_shape=xs, compiler_params=_triton_params())
    try:
        out = call(xs)
    except pallas_guard.PallasGuardError as error:
        assert "TPU interpret mode" in str(error)
        assert "not Triton ones" in str(error)
        assert "triton_add'" in str(error)
        assert error.__cause__ is not None  # chained from JAX's own error
    else:  # a JAX whose TPU interpreter accepts Triton params: then it must be right
        np.testing.assert_array_equal(out, xs + 1)


def test_host_code_asking_the_cpu_for_core_count_fails_clearly(guard: Callable[..., None], xs: jax.Array) -> None:
    plgpu = _mosaic_gpu()
    guard("interpret")

    def sm_count_body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        num_sms = jax.devices()[0].core_count  # what the shipped Mosaic-GPU matmuls do
        o_ref[...] = x_ref[...] * num_sms

    # out_type from jax 0.10 (out_shape deprecated there), out_shape before.
    out = "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"  # type: ignore[attr-defined]
    kernel = plgpu.kernel(sm_count_body, **{out: jax.ShapeDtypeStruct(xs.shape, xs.dtype)})  # type: ignore[attr-defined]
    with pytest.raises(AttributeError) as info:
        kernel(xs)
    assert not isinstance(info.value, pallas_guard.PallasGuardError)  # the user's error keeps its type
    note = "\n".join(getattr(info.value, "__notes__", ()))
    assert "cannot run on the CPU" in note and "PALLAS_GUARD_DEVICE=h100" in note


def test_errors_the_kernel_itself_causes_are_not_hidden(guard: Callable[..., None], xs: jax.Array) -> None:
    guard("interpret")

    def buggy_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] @ x_ref[...]  # (2, 8) @ (2, 8): a shape error of the user's

    with pytest.raises(TypeError) as info:
        pl.pallas_call(buggy_kernel, out_shape=xs)(xs)
    assert not isinstance(info.value, pallas_guard.PallasGuardError)


def test_explain_failure_ignores_unrelated_errors() -> None:
    assert _interpreters.explain_failure(ValueError("bad shape"), interpreter="plain", family=None) is None
    assert _interpreters.explain_failure(ValueError("x"), interpreter="tpu", family="mosaic_tpu") is None
    reason = _interpreters.explain_failure(NotImplementedError("no rule"), interpreter="plain", family="mosaic_gpu")
    assert reason is not None
    assert "Mosaic-GPU interpreter" in reason


def test_auto_without_checks_or_family_is_the_plain_interpreter_alone() -> None:
    """No family and no checks: the plain interpreter, unverified and unchecked."""
    chosen = _interpreters.candidates(AUTO)
    assert (chosen.names, chosen.verify, chosen.detect_races, chosen.checked) == (("plain",), False, False, frozenset())


def dma_to_host(y_hbm_ref, x_host_ref):  # type: ignore[no-untyped-def]
    def body(sem):  # type: ignore[no-untyped-def]
        pltpu.async_copy(y_hbm_ref, x_host_ref, sem).wait()

    pl.run_scoped(body, pltpu.SemaphoreType.DMA)


@pytest.mark.skipif(not callable(getattr(pl, "HOST", None)), reason="this jax builds host outputs otherwise")
def test_a_host_memory_output_stays_in_plain_under_races_and_the_note_says_why(guard: Callable[..., None]) -> None:
    """TPU interpret mode fails on a pl.HOST output (the interpreter table's row); the races check
    does not move such a kernel there, and says it could not check it."""
    host = jax.sharding.NamedSharding(
        jax.sharding.Mesh(jax.devices(), "x"), jax.sharding.PartitionSpec(), memory_kind="pinned_host"
    )
    x = jnp.arange(8 * 128.0).reshape((8, 128))

    def call(x: jax.Array) -> jax.Array:
        return pl.pallas_call(
            dma_to_host,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.HOST),
            out_shape=pl.HOST(shape=(8, 128), dtype=jnp.float32),
        )(x)

    guard("interpret", interpreter="plain")
    try:
        jax.block_until_ready(jax.jit(call, out_shardings=host)(x))
    except jax.errors.JaxRuntimeError as error:
        if "annotate_device_placement" not in str(error):
            raise
        pytest.skip("this jax's CPU has no host memory placement")
    pallas_guard.uninstall()
    jax.clear_caches()
    guard("interpret", interpreter="tpu")
    with pytest.raises(Exception, match=r"MemorySpace.HOST|safe_zip\(\) argument"):
        jax.jit(call, out_shardings=host)(x)
    jax_pallas.reset_interpreter("tpu")  # its failure skipped its clean-up
    pallas_guard.uninstall()
    jax.clear_caches()
    guard("interpret", checks="races")
    np.testing.assert_array_equal(jax.jit(call, out_shardings=host)(x), x)
    decision = pallas_guard.decisions()[-1]
    assert decision.interpreter == "plain"
    # Checked in the plain interpretation: the DMA to host memory followed like any other.
    assert not any("could not be checked" in note for note in decision.notes), decision.notes


def accumulate_rows(x_ref, o_ref):  # type: ignore[no-untyped-def]
    @pl.when(pl.program_id(0) == 0)
    def _() -> None:
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] = o_ref[...] + x_ref[...]


@pytest.mark.skipif(not hasattr(pl, "RevisitMode"), reason="this jax has no pl.RevisitMode")
@pytest.mark.parametrize("checks", ["races", "agree"])
def test_an_output_revisited_at_any_step_stays_in_plain_under_races_and_agree(
    guard: Callable[..., None], checks: str
) -> None:
    """JAX's reduction with non-immediate revisits (revisit=ANY): TPU interpret mode refuses it as
    it runs (the interpreter table's row); races and agree leave it to plain and say why."""
    x = jnp.arange(24 * 384, dtype=jnp.float32).reshape(24, 384)
    out_spec = pl.BlockSpec((8, 128), lambda i, j: (0, j), pipeline_mode=pl.Buffered(1, revisit=pl.RevisitMode.ANY))

    def reduction(x: jax.Array) -> jax.Array:
        return pl.pallas_call(
            accumulate_rows,
            out_shape=jax.ShapeDtypeStruct((8, 384), jnp.float32),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
            out_specs=out_spec,
            grid=(3, 3),
        )(x)

    guard("interpret", interpreter="tpu")
    with pytest.raises(Exception, match="Revisited block"):
        jax.block_until_ready(jax.jit(reduction)(x))
    jax_pallas.reset_interpreter("tpu")  # its failure skipped its clean-up: the next kernel would see it
    pallas_guard.uninstall()
    jax.clear_caches()
    guard("interpret", checks=checks)
    np.testing.assert_array_equal(jax.jit(reduction)(x), x.reshape(3, 8, 384).sum(axis=0))
    assert not [d for d in pallas_guard.decisions() if d.action == "found"]
    notes = pallas_guard.decisions()[-1].notes
    if checks == "races":  # checked in the plain interpretation, where it runs
        assert not any("could not be checked" in n for n in notes), notes
