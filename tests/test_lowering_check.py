"""The lowering check: a kernel the guard interprets is also lowered for its real target.

JAX's own Python lowering for TPU (Mosaic) and GPU (Triton) runs on a CPU given a platform and an
abstract device: blocks whose last two dimensions are not (8, 128) multiples, a sort, or (for
Triton) arrays whose size is not a power of 2 are refused there though every interpreter runs them.
The check reports that as a finding, eager and under ``jit``, naming the target and JAX's error;
a kernel that lowers runs with the same bits as without the check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from ops_corpus import Case, cases

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._checks import lowering as _lowering_check

pytestmark = pytest.mark.skipif(
    _lowering_check.lowering_api() is not None, reason="this jax cannot lower for a chosen platform"
)

ROWS = jnp.arange(96 * 300, dtype=jnp.float32).reshape(96, 300) / 7


def double(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] * 2.0 + 1.0


def sort_rows(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = jnp.sort(x_ref[...], axis=-1)


def blocked(body: Callable[..., None], block: tuple[int, int], shape: tuple[int, int], params: Any) -> Any:
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        grid=(shape[0] // block[0], shape[1] // block[1]),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=params,
    )


def tpu_params() -> Any:
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams()


def triton_params() -> Any:
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams()


def _unchecked(kernel: Any, x: jax.Array) -> bytes:
    with pallas_guard.policy(checks="none"):
        return np.asarray(kernel(x)).tobytes()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_tpu_blocks_of_3_by_100_are_a_finding(guard: Any, traced: bool) -> None:
    guard("interpret", checks="lowering")
    kernel = blocked(double, (3, 100), (96, 300), tpu_params())
    call = jax.jit(kernel) if traced else kernel
    with pytest.raises(PallasGuardError, match="found by the lowering check") as raised:
        call(ROWS)
    text = str(raised.value)
    assert "'double'" in text and "test_lowering_check.py" in text and "tpu (TPU v5 lite" in text
    assert "divisible by 8 and 128" in text
    # JAX's text once, in the finding (no chained copy), and the legal block shape nearest to it.
    assert "raised ValueError: " in text and raised.value.__cause__ is None
    assert "To fix: a block shape of (8, 128)" in text


def test_a_refused_kernel_keeps_raising(guard: Any) -> None:
    """The refusal is not settled away: the second call raises too, never returning the result."""
    guard("interpret", checks="lowering")
    kernel = blocked(double, (3, 100), (96, 300), tpu_params())
    for _ in range(2):
        with pytest.raises(PallasGuardError, match="divisible by 8 and 128"):
            kernel(ROWS)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_sort_is_refused_by_the_tpu_lowering(guard: Any, traced: bool) -> None:
    guard("interpret", checks="lowering")
    kernel = blocked(sort_rows, (8, 300), (96, 300), tpu_params())
    call = jax.jit(kernel) if traced else kernel
    with pytest.raises(PallasGuardError, match="Unimplemented primitive in Pallas TPU lowering") as raised:
        call(ROWS)
    assert "sort" in str(raised.value) and "'sort_rows'" in str(raised.value)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_triton_kernel_of_size_300_is_refused_on_the_h100(guard: Any, traced: bool) -> None:
    guard("interpret", checks="lowering", device="h100")
    kernel = blocked(double, (3, 100), (6, 100), triton_params())
    call = jax.jit(kernel) if traced else kernel
    with pytest.raises(PallasGuardError, match="power of 2") as raised:
        call(ROWS[:6, :100])
    assert "cuda (NVIDIA H100 80GB HBM3, the device setting)" in str(raised.value)


@pytest.mark.parametrize("block", [(8, 300), (32, 300)])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_kernel_that_lowers_is_silent_and_bit_identical(guard: Any, block: tuple[int, int], traced: bool) -> None:
    guard("interpret", checks="lowering")
    kernel = blocked(double, block, (96, 300), tpu_params())
    call = jax.jit(kernel) if traced else kernel
    checked = np.asarray(call(ROWS)).tobytes()
    notes = pallas_guard.decisions()[-1].notes
    assert "lowering: lowers for tpu (TPU v5 lite, the default for mosaic_tpu kernels)" in notes
    assert checked == _unchecked(call, ROWS)


def test_a_triton_kernel_that_lowers_on_the_h100_is_silent(guard: Any) -> None:
    guard("interpret", checks="lowering")
    with pallas_guard.policy(device="h100"):
        kernel = blocked(double, (16, 128), (32, 128), triton_params())
        x = ROWS[:32, :128]
        assert np.asarray(kernel(x)).tobytes() == _unchecked(kernel, x)


@pytest.mark.parametrize(
    ("device", "params", "lowered_for"),
    [("tpu-v5e", triton_params, "cuda (NVIDIA H100"), ("h100", tpu_params, "tpu (TPU v5 lite")],
    ids=["triton under a tpu device", "mosaic-tpu under a gpu device"],
)
def test_each_family_is_lowered_for_its_own_target(guard: Any, device: str, params: Any, lowered_for: str) -> None:
    """One device for a project with both families: a valid kernel of the other family is lowered
    for its own family's default device, and the note says why; nothing is refused."""
    guard("interpret", checks="lowering", device=device)
    kernel = blocked(double, (16, 128), (32, 128), params())
    x = ROWS[:32, :128]
    checked = np.asarray(kernel(x)).tobytes()
    notes = [note for note in pallas_guard.decisions()[-1].notes if note.startswith("lowering:")]
    assert notes and lowered_for in notes[0] and f"the device setting {device!r}" in notes[0], notes
    assert checked == _unchecked(kernel, x)


@pytest.mark.parametrize(
    ("params", "lowered_for"), [(triton_params, "cuda (NVIDIA A100-SXM4-80GB"), (tpu_params, "tpu (TPU v6 lite")]
)
def test_a_device_per_family_lowers_each_family_for_its_own(guard: Any, params: Any, lowered_for: str) -> None:
    guard("interpret", checks="lowering", device=["a100", "tpu-v6e"])
    kernel = blocked(double, (16, 128), (32, 128), params())
    kernel(ROWS[:32, :128])
    notes = [note for note in pallas_guard.decisions()[-1].notes if note.startswith("lowering:")]
    assert notes == [f"lowering: lowers for {lowered_for}, the device setting)"], notes


def test_a_generic_kernel_without_a_device_is_not_checked(guard: Any) -> None:
    """No compiler params and no device: no target to lower for; the decision says so."""
    guard("interpret", checks="lowering")
    kernel = blocked(double, (3, 100), (96, 300), None)
    kernel(ROWS)
    notes = [note for note in pallas_guard.decisions()[-1].notes if note.startswith("lowering:")]
    assert notes and "a generic kernel has no target of its own" in notes[0]


def test_a_generic_kernel_is_lowered_for_the_device_set(guard: Any) -> None:
    guard("interpret", checks="lowering", device="tpu-v5e")
    kernel = blocked(double, (3, 100), (96, 300), None)
    with pytest.raises(PallasGuardError, match=r"the device setting.*divisible by 8 and 128"):
        kernel(ROWS)


def test_the_check_lowers_once_per_kernel_and_shapes(guard: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    guard("interpret", checks="lowering")
    calls: list[Any] = []
    check = _lowering_check.check
    monkeypatch.setattr(_lowering_check, "check", lambda *a: calls.append(a) or check(*a))
    kernel = blocked(double, (8, 300), (96, 300), tpu_params())
    for _ in range(3):
        kernel(ROWS)
    assert len(calls) == 1
    kernel(ROWS[:48])  # other shapes: lowered again
    assert len(calls) == 2


def test_without_the_check_nothing_is_lowered(guard: Any) -> None:
    guard("interpret", checks="none")
    kernel = blocked(double, (3, 100), (96, 300), tpu_params())
    assert np.asarray(kernel(ROWS)).shape == (96, 300)


# --- JAX's shipped kernels, each lowered for its own family's target -----------------------------

NOT_CHECKED = {
    # No compiler params: a generic kernel, lowered only for a device the user sets.
    None: "a generic kernel has no target of its own",
    # Measured on jax 0.12.0.1: JAX's Mosaic-GPU lowering lowers these kernels alone in a process,
    # but after other kernels ran it may compile for this process's backend on the way ("the
    # platform for the specified backend cpu is different from the lowering platform cuda").
    "mosaic_gpu": "is different from the lowering platform",
}


def _lowerable(case: Case) -> object:
    marks = [pytest.mark.skip(reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_lowerable(case) for case in cases()])
def test_every_shipped_kernel_lowers_for_its_own_target(case: Case, guard: Any) -> None:
    """Every corpus kernel the guard runs lowers for its family's target at the corpus's shapes, or
    the decision names why the check could not run; none is refused."""
    if case.skip_reason() or case.devices > len(jax.devices("cpu")):
        pytest.skip(case.skip_reason() or f"needs {case.devices} devices")
    guard("interpret", checks="lowering", device=case.device)
    jax.clear_caches()
    jax.block_until_ready(case.run())
    notes = {note for d in pallas_guard.decisions() for note in d.notes if note.startswith("lowering:")}
    assert notes, case.name
    family = _family(case)
    for note in notes:
        if family is None:
            assert "not checked" in note and NOT_CHECKED[family] in note, note
        elif family in NOT_CHECKED and "not checked" in note:
            assert NOT_CHECKED[family] in note, note
        else:
            assert note.startswith("lowering: lowers for "), note


def _family(case: Case) -> str | None:
    """The family the guard sees: the example kernel passes no compiler params (generic)."""
    return None if case.name == "tpu.example_kernel.double" else case.family


@pytest.mark.parametrize("checks", ["lowering", "lowering,compile", "lowering,agree", "lowering,races"])
def test_what_jax_logs_while_tracing_a_kernel_is_logged_once(guard: Any, checks: str, caplog: Any) -> None:
    """The checks trace the kernel again (for its target, in the other interpreters, with the race
    check's table); what JAX logged during the first trace (an unused DMA descriptor) is not logged
    again: a test counting its log lines sees one."""
    from jax.experimental.pallas import tpu as pltpu

    def unused_descriptor(x_hbm_ref, o_hbm_ref, sem):  # type: ignore[no-untyped-def]
        pltpu.make_async_copy(x_hbm_ref, o_hbm_ref, sem)

    guard("interpret", checks=checks, device="tpu-v5e")
    kernel = pl.pallas_call(
        unused_descriptor,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
    )
    with caplog.at_level("ERROR"):
        jax.block_until_ready(kernel(jnp.zeros((8, 128))))
    logged = [r for r in caplog.records if "AsyncCopyDescriptor was not used" in r.getMessage()]
    assert len(logged) == 1
    assert any(n.startswith("lowering: lowers for") for d in pallas_guard.decisions() for n in d.notes)
