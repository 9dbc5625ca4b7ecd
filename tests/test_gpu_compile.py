"""The compile check of GPU kernels: XLA's GPU compiler, for a described H100 or A100, on this CPU.

Where jax's compile-only CUDA wheels are installed (the ``gpu`` extra; ``.ci/run gpu``), real
Triton and Mosaic GPU kernels are compiled in a child process and the verdicts are XLA's own: the
shared memory a block may have, the float8 arithmetic an A100 lacks (an LLVM fatal error that ends
the compiler's process), Hopper-only instructions. Without them, the check says it could not run
and how to install it.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gpu_corpus
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
    figures = []
    for ending in ("s)", "(cached: an earlier run compiled it)"):
        jax.clear_caches()
        pallas_guard.uninstall()  # a later run: the guard reinstalled, JAX's caches cleared
        guard("interpret", checks="compile", device="h100")
        pl.pallas_call(add_one, out_shape=x, compiler_params=_triton_params())(x)
        (note,) = _compile_notes()
        assert note.startswith("compile: compiles for h100: ") and note.endswith(ending)
        figures.append(pallas_guard.decisions()[-1].memory)
    assert figures[0] == figures[1] and figures[0]  # the figures are kept with the verdict
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


def _operands() -> tuple[jax.Array, jax.Array]:
    x = (jnp.arange(256 * 1024) % 7).reshape(256, 1024).astype(jnp.float16)
    return x, x.T


def _figures() -> dict[str, tuple[int, int]]:
    return {use.space: (use.used, use.limit) for use in pallas_guard.decisions()[-1].memory}


def _ptxas() -> str:
    folder = gpu_compile._ptxas()
    assert folder is not None
    return os.path.join(folder, "ptxas")


@needs_the_compiler
def test_a_triton_kernels_figures_are_xlas_and_ptxass_own(
    guard: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # XLA dumps what it compiled (the child inherits XLA_FLAGS): its thunk sequence states the
    # kernel's shared memory, and ptxas -v, run here on the dumped PTX, its registers and spills.
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to={tmp_path}")
    guard("interpret", checks="compile", device="h100")
    x, y = _operands()
    exact = (np.asarray(x, np.float32) @ np.asarray(y, np.float32)).astype(np.float16)  # sums exact in f32
    np.testing.assert_array_equal(gpu_corpus.pipelined_matmul(x, y, stages=3), exact)
    (sequence,) = tmp_path.glob("*thunk_sequence.txt")
    shared = int(re.search(r"shared_memory: (\d+) bytes", sequence.read_text()).group(1))  # type: ignore[union-attr]
    (ptx,) = [path for path in tmp_path.glob("*.ptx") if ".entry" in path.read_text()]
    report = subprocess.run(
        [_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True, check=False
    )
    registers = int(re.search(r"Used (\d+) registers", report.stderr).group(1))  # type: ignore[union-attr]
    stores = int(re.search(r"(\d+) bytes spill stores", report.stderr).group(1))  # type: ignore[union-attr]
    figures = _figures()
    assert figures["shared memory"] == (shared, 232448) and shared == 3 * 32768  # three stages of 32 KiB
    assert figures["registers"] == (registers, 255)
    assert stores == 0 and "spill stores" not in figures
    (note,) = _compile_notes()
    assert f"shared memory 96.0 KiB of 227.0 KiB (42%), registers {registers} of 255 per thread" in note
    assert re.search(r"\(XLA's compile: [\d.]+ s\)$", note)
    # The pytest plugin's list of slow tests names the compile's time beside the interpreted run.
    import pallas_guard_pytest

    decision = pallas_guard.decisions()[-1]
    row = {"action": "interpreted", "test": "t.py::test", "kernel": decision.kernel, "interpreter": "plain"}
    row |= {"steps": 4, "why": "w", "notes": decision.notes}
    (listed,) = [
        line for line in pallas_guard_pytest.duration_lines([row], {"t.py::test": 9.0}, count=5) if "9.00s" in line
    ]
    assert re.search(r"kernel \(plain, 4 steps, compiled for h100 in [\d.]+ s\)", listed)


@needs_the_compiler
def test_num_stages_an_h100_holds_are_refused_for_an_a100_and_leave_no_headroom_on_the_h100(guard: Any) -> None:
    x, y = _operands()
    guard("interpret", checks="compile", device="h100,a100")
    with pytest.raises(PallasGuardError) as raised:
        gpu_corpus.pipelined_matmul(x, y, stages=7)
    text = str(raised.value)
    assert "XLA's GPU compile for a100 (the device setting; it compiles for h100) raised JaxRuntimeError" in text
    assert "Shared memory size limit exceeded: requested 196608, available: 166912" in text
    # On the H100 (seven stages of 32 KiB) it compiles, with 3 KiB to spare: a finding under headroom.
    guard("interpret", checks="compile", device="h100")
    gpu_corpus.pipelined_matmul(x, y, stages=7)
    assert _figures()["shared memory"] == (7 * 32768, 232448)
    guard("interpret", checks="compile", device="h100", vmem_headroom="5%")
    with pytest.raises(
        PallasGuardError, match=r"compiles with less memory to spare than the headroom setting asks"
    ) as tight:
        gpu_corpus.pipelined_matmul(x, y, stages=7)
    assert "it takes shared memory 224.0 KiB of 227.0 KiB (99%) on h100" in str(tight.value)
    assert "To fix: shrink the kernel's block shapes, or num_stages" in str(tight.value)


@needs_the_compiler
def test_a_kernel_that_spills_registers_says_so_and_is_a_finding_under_headroom(guard: Any) -> None:
    x = jnp.ones((512, 64), jnp.float32)
    y = jnp.ones((64, 512), jnp.float32)
    multiply = functools.partial(_matmul, blocks=(256, 64, 256), dtype=jnp.float32)  # 256 x 256 f32 sums, 128 threads
    guard("interpret", checks="compile", device="h100")
    np.testing.assert_array_equal(multiply(x, y), np.full((512, 512), 64, np.float32))
    figures = _figures()
    assert figures["registers"] == (255, 255) and figures["spill stores"][0] > 0
    assert "spill stores" in _compile_notes()[0]
    guard("interpret", checks="compile", device="h100", vmem_headroom="1%")
    with pytest.raises(PallasGuardError, match="ptxas ran out of registers on h100 and spilled to local memory"):
        multiply(x, y)


_MOSAIC_OWN_REPORT = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl, topologies
from jax.experimental.pallas import mosaic_gpu as plgpu

def kernel(x_ref, o_ref, scratch):
    scratch[...] = x_ref[...] + 1
    o_ref[...] = scratch[...]

def staged(x):
    scratch = [plgpu.SMEM(x.shape, x.dtype)]
    return pl.pallas_call(kernel, out_shape=x, scratch_shapes=scratch, compiler_params=plgpu.CompilerParams())(x)

device = topologies.get_topology_desc("h100", "cuda", target_config=sys.stdin.read(), topology="1x1x1").devices[0]
x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
jax.jit(staged).lower(x).compile()
"""


def staged_in_shared_memory(x: jax.Array) -> jax.Array:
    """A Mosaic GPU kernel whose operand, result and scratch are each 64 KiB of shared memory (the
    kernel ``_MOSAIC_OWN_REPORT`` compiles without the guard)."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

    def kernel(x_ref, o_ref, scratch):  # type: ignore[no-untyped-def]
        scratch[...] = x_ref[...] + 1
        o_ref[...] = scratch[...]

    scratch = [plgpu.SMEM(x.shape, x.dtype)]
    return pl.pallas_call(kernel, out_shape=x, scratch_shapes=scratch, compiler_params=plgpu.CompilerParams())(x)


@needs_the_compiler
def test_a_mosaic_gpu_kernels_figures_are_its_own_compilers(guard: Any) -> None:
    guard("interpret", checks="compile", device="h100")
    x = jnp.arange(128 * 128, dtype=jnp.float32).reshape(128, 128)
    np.testing.assert_array_equal(staged_in_shared_memory(x), x + 1)
    figures = _figures()
    # Pallas stages the operand and the result in shared memory beside the scratch, and a barrier.
    assert figures["shared memory"] == (3 * 65536 + 8, 232448)
    # ptxas's report as Mosaic GPU prints it itself (MOSAIC_GPU_DUMP_PTXAS), the guard not involved.
    env = {name: value for name, value in os.environ.items() if not name.startswith("PALLAS_GUARD")}
    env["PATH"] = os.pathsep.join([os.path.dirname(_ptxas()), os.environ["PATH"]])
    description = gpu_compile.target_config(gpu_compile.TARGETS["h100"])
    own = subprocess.run(
        [sys.executable, "-c", _MOSAIC_OWN_REPORT],
        input=description,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert own.returncode == 0, own.stderr[-2000:]
    registers = int(re.search(r"Used (\d+) registers", own.stdout + own.stderr).group(1))  # type: ignore[union-attr]
    assert figures["registers"] == (registers, 255)


def _hopper_matmul() -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    hopper = pytest.importorskip("jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu")
    config = hopper.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
    operand = jax.ShapeDtypeStruct((1024, 1024), jnp.float16)
    return functools.partial(hopper.matmul, c=None, config=config), (operand, operand), {}


def _ragged_dot() -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    ragged = pytest.importorskip("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
    blocks = {"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2}
    lhs, rhs = jax.ShapeDtypeStruct((1024, 512), jnp.float16), jax.ShapeDtypeStruct((4, 512, 1024), jnp.float16)
    return (
        functools.partial(ragged.ragged_dot, **blocks),
        (lhs, rhs),
        {"group_sizes": jax.ShapeDtypeStruct((4,), jnp.int32)},
    )


@needs_the_compiler
@pytest.mark.parametrize(
    ("program", "shared", "reason"),
    [
        (_hopper_matmul, "224.1 KiB of 227.0 KiB (99%)", "'nvvm.wgmma.fence.aligned' op is not supported on sm_80"),
        (_ragged_dot, "96.0 KiB of 227.0 KiB (42%)", "not supported on sm_80"),
    ],
    ids=["hopper_matmul_mgpu", "ragged_dot_mgpu"],
)
def test_jaxs_mosaic_gpu_kernels_built_with_plgpu_kernel_compile_for_an_h100_and_not_for_an_a100(
    guard: Any, program: Any, shared: str, reason: str
) -> None:
    function, args, kwargs = program()
    jitted = jax.jit(function)
    # With jax's CUDA plugin installed, the guard presents the device setting's GPU only once a
    # backend says the target is the CPU (it starts none itself).
    jax.devices()
    # Lowered, not run: the check's verdict comes as the kernel is traced. The SM count JAX's
    # kernels ask for is the device setting's (the guard presents an abstract H100).
    guard("interpret", checks="compile", device="h100")
    jitted.lower(*args, **kwargs)
    (note,) = _compile_notes()
    assert note.startswith(f"compile: compiles for h100: shared memory {shared}, registers ")
    guard("interpret", checks="compile", device="a100")
    with pytest.raises(PallasGuardError) as raised:
        jitted.lower(*args, **kwargs)
    assert (
        "XLA's GPU compile for a100 (the device setting) raised JaxRuntimeError: INTERNAL: Pass pipeline failed"
        in str(raised.value)
    )
    assert reason in str(raised.value)
