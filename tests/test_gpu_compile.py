"""The compile check of GPU kernels: XLA's GPU compiler, for a described H100 or A100, on this CPU.

Where jax's compile-only CUDA wheels are installed (the ``gpu`` extra; ``.ci/run gpu``), real
Triton and Mosaic GPU kernels are compiled in a child process and the verdicts are XLA's own: the
shared memory a block may have, the float8 arithmetic an A100 lacks (an LLVM fatal error that ends
the compiler's process), Hopper-only instructions. Without them, the check says it could not run
and how to install it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._running import gpu_compile

MISSING = gpu_compile.available()
needs_the_compiler = pytest.mark.skipif(MISSING is not None, reason=f"no GPU compiler here: {MISSING}")


def _triton_params() -> Any:
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def add_one(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


def matmul(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)


def _matmul(x: jax.Array, y: jax.Array, blocks: tuple[int, int, int], dtype: Any) -> jax.Array:
    bm, bk, bn = blocks
    return pl.pallas_call(
        matmul,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), dtype),
        grid=(x.shape[0] // bm, y.shape[1] // bn),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, 0)), pl.BlockSpec((bk, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_triton_params(),
    )(x, y)


def _compile_notes() -> list[str]:
    return [note for note in pallas_guard.decisions()[-1].notes if note.startswith("compile:")]


@pytest.mark.skipif(MISSING is None, reason="the GPU compiler is installed here")
def test_without_the_gpu_compiler_the_check_says_it_did_not_run_and_how_to_install_it(guard: Any) -> None:
    guard("interpret", checks="compile", device="h100")
    x = jnp.arange(128.0)
    call = pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())
    np.testing.assert_array_equal(call(x), x + 1)
    (note,) = _compile_notes()
    assert note.startswith("compile: not checked: XLA's GPU compiler is not installed (")
    assert 'pip install "pallas_guard[gpu]"' in note and f"jax-cuda12-plugin=={jax.__version__}" in note
    # A check asked for that could not run never passes for one that ran.
    guard("interpret", checks="compile", device="h100", require_checks=True)
    cannot = r"the compile check cannot run on Pallas kernel add_one .*XLA's GPU compiler is not installed"
    with pytest.raises(PallasGuardError, match=cannot):
        pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())(x)


@needs_the_compiler
@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_a_triton_kernel_that_compiles_is_silent_and_bit_identical(guard: Any, gpu: str) -> None:
    x = jnp.arange(4096.0).reshape(64, 64) / 7
    guard("interpret", checks="none")
    unchecked = np.asarray(pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())(x))
    guard("interpret", checks="compile", device=gpu)
    checked = np.asarray(pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())(x))
    assert checked.tobytes() == unchecked.tobytes()
    assert _compile_notes()[0].startswith(f"compile: compiles for {gpu}")


@needs_the_compiler
@pytest.mark.parametrize(("gpu", "available"), [("h100", 232448), ("a100", 166912)])
def test_blocks_over_a_gpus_shared_memory_are_refused_with_xlas_message(guard: Any, gpu: str, available: int) -> None:
    guard("interpret", checks="compile", device=gpu)
    x, y = jnp.ones((512, 1024), jnp.float16), jnp.ones((1024, 512), jnp.float16)
    with pytest.raises(PallasGuardError) as raised:
        _matmul(x, y, (256, 1024, 256), jnp.float16)
    text = str(raised.value)
    assert f"XLA's GPU compile for {gpu} (the device setting) raised JaxRuntimeError: RESOURCE_EXHAUSTED" in text
    assert f"Shared memory size limit exceeded: requested 1048576, available: {available}" in text
    assert "To fix: the kernel's blocks need 1.0 MiB of shared memory" in text
    assert isinstance(raised.value, jax.errors.JaxRuntimeError)  # what the GPU's own compile raises


@needs_the_compiler
def test_float8_compiles_for_an_h100_and_ends_the_compiler_for_an_a100(guard: Any) -> None:
    x = jnp.ones((64, 64), jnp.float8_e4m3fn)
    multiply = functools.partial(_matmul, blocks=(32, 64, 32), dtype=jnp.float32)
    guard("interpret", checks="compile", device="h100")
    np.testing.assert_array_equal(multiply(x, x), np.full((64, 64), 64, np.float32))
    assert _compile_notes()[0].startswith("compile: compiles for h100")
    # Both in one device setting: the A100's refusal says the H100 compiles it.
    guard("interpret", checks="compile", device="h100,a100")
    with pytest.raises(PallasGuardError) as raised:
        multiply(x, x)
    text = str(raised.value)
    assert "XLA's GPU compile for a100 (the device setting; it compiles for h100) raised GpuCompilerError" in text
    assert "only supported on compute capability >= 89" in text and "the compiler ended its process" in text
    assert "To fix: an A100 (compute capability 8.0) has no float8 arithmetic" in text


@needs_the_compiler
def test_a_mosaic_gpu_kernel_with_hopper_instructions_is_refused_for_an_a100_with_the_reason_from_stderr(
    guard: Any,
) -> None:
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    x = jnp.arange(256.0, dtype=jnp.float32)
    call = pl.pallas_call(add_one, out_shape=x, compiler_params=plgpu.CompilerParams())
    guard("interpret", checks="compile", device="h100")
    np.testing.assert_array_equal(call(x), x + 1)
    assert _compile_notes()[0].startswith("compile: compiles for h100")
    guard("interpret", checks="compile", device="a100")
    with pytest.raises(PallasGuardError) as raised:
        pl.pallas_call(add_one, out_shape=x, compiler_params=plgpu.CompilerParams())(x)
    text = str(raised.value)
    assert "raised JaxRuntimeError: INTERNAL: Pass pipeline failed" in text
    # The reason XLA gives only on its standard error.
    assert "'nvvm.cp.async.bulk.wait_group' op is not supported on sm_80" in text


@needs_the_compiler
def test_a_compile_that_succeeded_is_kept_on_disk(guard: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    x = jnp.arange(128.0)
    for expected in ("compile: compiles for h100", "compile: compiles for h100 (cached: an earlier run compiled it)"):
        jax.clear_caches()
        pallas_guard.uninstall()  # a later run: the guard reinstalled, JAX's caches cleared
        guard("interpret", checks="compile", device="h100")
        pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())(x)
        assert _compile_notes() == [expected]
    assert list((tmp_path / "pallas_guard" / "gpu-compiles").glob("*.json"))


@needs_the_compiler
def test_a_block_jaxs_triton_lowering_refuses_is_refused_before_the_compiler(guard: Any) -> None:
    guard("interpret", checks="compile", device="h100")
    x = jnp.arange(96.0)  # Triton's blocks have power-of-2 sizes
    with pytest.raises(PallasGuardError) as raised:
        pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())(x)
    text = str(raised.value)
    assert "JAX's lowering for CUDA (before XLA's GPU compiler) for h100 (the device setting) raised ValueError" in text
    assert "requires that all operations have array arguments and results whose size is a power of 2" in text
