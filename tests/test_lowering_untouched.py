"""GPU/TPU lowering is untouched by the guard, proven on this CPU-only machine.

jaxlib ships the Triton, Mosaic-GPU and Mosaic-TPU lowerings, so kernels can be lowered and
exported for cuda/rocm/tpu here (see LOWERING_ON_CPU.md). With the guard installed the text is
byte-identical to an unguarded lowering and the guard's CPU rules are never called; a
multi-platform export keeps the real custom call in the accelerator branch and runs its CPU branch
interpreted. A negative control shows the check catches a rule registered for every platform.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import mlir

import pallas_guard
from pallas_guard._deciding import target as _target
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._surfaces import install as _install

X = jax.ShapeDtypeStruct((8, 128), jnp.float32)


def plus_one_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


def _pallas(compiler_params: Callable[[], Any]) -> Callable[[jax.Array], jax.Array]:
    def f(x: jax.Array) -> jax.Array:
        return pl.pallas_call(
            plus_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=compiler_params()
        )(x)

    return f


def _triton_params() -> Any:
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4)


def _mosaic_gpu_kernel(x: jax.Array) -> jax.Array:
    import inspect

    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    out = "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"
    kernel = plgpu.kernel(plus_one_kernel, **{out: jax.ShapeDtypeStruct(x.shape, x.dtype)})
    return kernel(x)  # type: ignore[no-any-return]


# kind -> (function, platforms, the custom call JAX emits for it)
KERNELS: dict[str, tuple[Callable[[jax.Array], jax.Array], tuple[str, ...], str]] = {
    "triton": (_pallas(_triton_params), ("cuda", "rocm"), "__gpu$xla.gpu.triton"),
    "mosaic_tpu": (_pallas(pltpu.CompilerParams), ("tpu",), "tpu_custom_call"),
    "mosaic_gpu": (_mosaic_gpu_kernel, ("cuda",), "mosaic_gpu_v2"),
}
CASES = [(kind, platform) for kind, (_, platforms, _) in KERNELS.items() for platform in platforms]


class _CountingLedger:
    """Stands in for the installation's ledger: counts every call of the CPU rules."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.calls = 0

    def verifying(self) -> bool:
        # The first thing every CPU rule asks. A front-door trial lowering for the CPU (a Mosaic-TPU
        # kernel verified while configuration says CPU) is not counted.
        verifying = self.ledger.verifying()
        self.calls += not verifying
        return bool(verifying)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)


@pytest.fixture
def rule_calls(monkeypatch: pytest.MonkeyPatch) -> _CountingLedger:
    counter = _CountingLedger(_install.installation.ledger)
    monkeypatch.setattr(_install.installation, "ledger", counter)
    return counter


def _lower(f: Callable[[jax.Array], jax.Array], platform: str) -> str:
    """The lowered text, or the error, as a string: both must be the same with and without the guard."""
    jax.clear_caches()  # a cached lowering would not consult the rules at all
    try:
        traced = jax.jit(f).trace(X)
        return str(traced.lower(lowering_platforms=(platform,)).as_text())
    except Exception as error:  # e.g. jaxlib > 0.10.2 compiles Triton at lowering: no GPU here
        return f"ERROR {type(error).__name__}: {error}"


# The serialised kernels: Triton IR bytecode, and the Mosaic body (base64 MLIR bytecode).
_KERNEL_BLOBS = re.compile(r'ir = "(?:[^"\\]|\\.)*"|\\22body\\22: \\22[A-Za-z0-9+/=]+')


# Per-process counters JAX bakes into Mosaic-GPU kernels (jax 0.11.x): the kernel's dump name
# (`plus_one_kernel_0`, `_1`, ...) and the hash that covers it. Same length after masking.
_PROCESS_COUNTERS = re.compile(r"(dump_basename\\00[A-Za-z_]+?_)\d+")
_KERNEL_HASH = re.compile(r'kernel_hash = "(?:[^"\\]|\\.)*"')


def _comparable(text: str, unstable: bool) -> str:
    """JAX's per-process kernel counters are masked; jaxlib 0.7's serialised kernels are not
    byte-stable between two unguarded lowerings of the same function, so there those blobs are
    left out too, and the rest is compared byte for byte."""
    text = _KERNEL_HASH.sub('kernel_hash = "<hash>"', _PROCESS_COUNTERS.sub(r"\g<1>#", text))
    return _KERNEL_BLOBS.sub("<kernel>", text) if unstable else text


def _install_guard() -> Callable[[], None]:
    pallas_guard.install("interpret")
    return pallas_guard.uninstall


def assert_untouched(
    f: Callable[[jax.Array], jax.Array],
    platform: str,
    custom_call: str,
    counter: _CountingLedger,
    install: Callable[[], Callable[[], None]] = _install_guard,
) -> str:
    unguarded = _lower(f, platform)
    unstable = _comparable(_lower(f, platform), False) != _comparable(unguarded, False)
    undo = install()
    try:
        calls_before = counter.calls
        guarded = _lower(f, platform)
        assert counter.calls == calls_before, f"the guard's CPU rule ran while lowering for {platform}"
    finally:
        undo()
    assert _comparable(guarded, unstable) == _comparable(unguarded, unstable), (
        f"lowering for {platform} changed under the guard"
    )
    assert not unstable or _comparable(unguarded, unstable) != unguarded  # only the kernel blob varied
    if not unguarded.startswith("ERROR"):
        assert custom_call in unguarded
    return unguarded


@pytest.fixture
def unknown_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trace as an AOT build would, where nothing says CPU at trace time.

    The front door chooses the Mosaic-GPU / TPU interpreters at trace time when the target is known
    to be the CPU (they add effects while tracing); such a trace is for the CPU. An AOT lowering
    for an accelerator from this CPU host traces with the target unknown (or uses jax.export).
    """
    monkeypatch.setattr(_target, "detect", lambda: _target.UNKNOWN)


@pytest.mark.parametrize(("kind", "platform"), CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_accelerator_lowering_is_byte_identical_and_the_guard_is_not_called(
    kind: str, platform: str, rule_calls: _CountingLedger, unknown_target: None
) -> None:
    f, _, custom_call = KERNELS[kind]
    text = assert_untouched(f, platform, custom_call, rule_calls)
    if kind == "mosaic_tpu":
        # The real Mosaic kernel is embedded: its MLIR bytecode names the TPU dialect's ops.
        body = re.search(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)", text)
        assert body is not None
        raw = base64.b64decode(body.group(1))
        assert b"vector_store" in raw
        assert b"tpu" in raw


@pytest.mark.parametrize("kind", ["triton", "mosaic_tpu"])
def test_plain_kernels_stay_untouched_with_the_cpu_as_configured_target(kind: str, rule_calls: _CountingLedger) -> None:
    """Kernels the guard runs with the plain interpreter are not touched at trace time at all."""
    jax.devices("cpu")  # the backend is up: the front door's target is the CPU
    f, platforms, custom_call = KERNELS[kind]
    assert_untouched(f, platforms[0], custom_call, rule_calls)


def test_negative_control_a_rule_for_every_platform_is_caught(
    rule_calls: _CountingLedger, unknown_target: None
) -> None:
    """If the guard registered its rule for every platform, the assertion above would fail."""
    f, (platform, *_), custom_call = KERNELS["mosaic_tpu"]
    registry = jax_lowering.lowering_registry()
    assert registry is not None
    primitive = jax_pallas.pallas_call_primitive()
    common = registry.common_rule(primitive)
    assert common is not None
    platform_rules = mlir._platform_specific_lowerings[platform]
    previous = platform_rules.get(primitive)

    def everywhere_rule(ctx: Any, *args: Any, **params: Any) -> Any:
        rule_calls.verifying()  # counted, as the guard's own rule counts itself
        return common(ctx, *args, **{**params, "interpret": True})

    def install_everywhere() -> Callable[[], None]:
        undo_guard = _install_guard()
        registry.register_lowering(primitive, everywhere_rule, platform=platform)

        def undo() -> None:
            if previous is None:
                del platform_rules[primitive]
            else:
                platform_rules[primitive] = previous
            undo_guard()

        return undo

    with pytest.raises(AssertionError, match="the guard's CPU rule ran while lowering for tpu"):
        assert_untouched(f, platform, custom_call, rule_calls, install=install_everywhere)
    assert primitive not in platform_rules or platform_rules[primitive] is previous


def _custom_call_configs(text: str, target: str) -> list[str]:
    # The backend_config (the serialised kernel) of each such custom call; source locations differ.
    return [
        re.sub(r"loc\(#loc\d*\)", "", line.split("backend_config", 1)[1])
        for line in text.splitlines()
        if target in line and "backend_config" in line
    ]


@pytest.fixture
def export_checks() -> Iterator[list[Any]]:
    yield [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@pytest.mark.parametrize(("kind", "platform"), [("mosaic_tpu", "tpu"), ("triton", "cuda")])
def test_multi_platform_export_keeps_the_real_kernel_and_runs_the_cpu_branch_interpreted(
    kind: str, platform: str, export_checks: list[Any], rule_calls: _CountingLedger
) -> None:
    f, _, custom_call = KERNELS[kind]
    try:
        alone = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=export_checks)(X)
    except Exception as error:
        if "No supported GPU devices" in str(error):  # jaxlib > 0.10.2 compiles Triton here
            pytest.skip(f"this jaxlib cannot lower Triton without a GPU: {error}")
        raise
    with pytest.raises(ValueError, match="Only interpret mode is supported on CPU backend"):
        jax.export.export(jax.jit(f), platforms=["cpu", platform], disabled_checks=export_checks)(X)
    pallas_guard.install("interpret")
    calls_before = rule_calls.calls
    both = jax.export.export(jax.jit(f), platforms=["cpu", platform], disabled_checks=export_checks)(X)
    text = both.mlir_module()
    assert rule_calls.calls > calls_before  # the CPU branch went through the guard
    assert "stablehlo.case" in text
    # The accelerator branch carries the same kernel as an unguarded single-platform export.
    assert _custom_call_configs(text, custom_call) == _custom_call_configs(alone.mlir_module(), custom_call)
    assert _custom_call_configs(text, custom_call)
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(both.call(x), x + 1)
    assert {d.interpreter for d in pallas_guard.decisions()} == {"plain"}
