"""Kernels nobody here would write for the guard: the patterns third-party libraries use, run
under the guard on this CPU with no ``interpret=`` anywhere.

- a ``pl.kernel`` over a TPU core mesh with DMAs and semaphores (qwix, tokamax): TPU interpret mode;
- Mosaic-GPU ``pallas_call``s with ordinary block specs (JAX's own ``PallasMGPUTest``): the
  Mosaic-GPU interpreter is verified, fails on the non-trivial windows, and the plain one runs them;
- a kernel no interpreter can run: one error listing each interpreter tried;
- ``program_id`` inside ``pl.when`` (tokamax's Triton attention backward): plain fails, TPU runs it;
- the same kernels called through a library in site-packages: attributed to the caller's line.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import site
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import abstract_tpu_device, line_of, tensorcore_mesh
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard._deciding import interpreters as _interpreters


def _mgpu() -> Any:
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as error:  # absl missing, or this jax's Mosaic GPU does not import on CPU
        pytest.skip(f"jax.experimental.pallas.mosaic_gpu does not import here: {error}")
    return plgpu


def _decisions(kernel: str) -> list[pallas_guard.Decision]:
    return [d for d in pallas_guard.decisions() if kernel in d.kernel]


# --- a pl.kernel over a TPU core mesh, with DMAs and semaphores -------------------------------------


@pytest.fixture
def abstract_tpu() -> Iterator[None]:
    """Host code asks "which TPU?" (the core count); on a CPU an abstract TPU device answers."""
    tpu = abstract_tpu_device()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), (), abstract_device=tpu)):
        yield


def _core_mesh_double(x: jax.Array) -> jax.Array:
    mesh = tensorcore_mesh("core")
    scratch = [pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA]
    parameters = inspect.signature(pl.kernel).parameters
    shapes = {("out_type" if "out_type" in parameters else "out_shape"): jax.ShapeDtypeStruct(x.shape, x.dtype)}
    shapes["scratch_types" if "scratch_types" in parameters else "scratch_shapes"] = scratch

    @functools.partial(pl.kernel, mesh=mesh, **shapes)
    def core_mesh_kernel(x_hbm, o_hbm, buffer, sem):  # type: ignore[no-untyped-def]
        core = jax.lax.axis_index("core")  # unbound in the plain interpreter
        pltpu.make_async_copy(x_hbm, buffer, sem).start()
        pltpu.make_async_copy(x_hbm, buffer, sem).wait()
        buffer[...] = buffer[...] * 2 + core.astype(buffer.dtype)
        pltpu.make_async_copy(buffer, o_hbm, sem).start()
        pltpu.make_async_copy(buffer, o_hbm, sem).wait()

    return core_mesh_kernel(x)  # CALL-SITE-CORE-MESH (verified: named where the kernel is called)


def test_core_mesh_kernel_runs_in_tpu_interpret_mode(guard: Callable[..., None], abstract_tpu: None) -> None:
    if not hasattr(pl, "kernel"):
        pytest.skip("pl.kernel exists from jax 0.8.1")
    if not _interpreters.available("tpu"):
        pytest.skip("this jax has no TPU interpret mode")
    guard("interpret")
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(_core_mesh_double(x), x * 2)
    (decision,) = _decisions("core_mesh_kernel")
    assert (decision.action, decision.interpreter) == ("interpreted", "tpu")
    assert "TPU core mesh" in decision.reason
    assert decision.called_at == f"{__file__}:{line_of('CALL-SITE-CORE-MESH')}"


def test_core_mesh_kernel_fails_in_the_plain_interpreter(guard: Callable[..., None], abstract_tpu: None) -> None:
    """The negative control: forced to plain, the same kernel fails, as it did before the choice."""
    if not hasattr(pl, "kernel"):
        pytest.skip("pl.kernel exists from jax 0.8.1")
    guard("interpret", interpreter="plain")
    x = jnp.ones((8, 128), jnp.float32)
    with pytest.raises(Exception, match="unbound axis name: core"):
        jax.block_until_ready(_core_mesh_double(x))


# --- Mosaic-GPU pallas_calls with block specs (JAX 0.10.2's PallasMGPUTest) ----------------------------


def _mgpu_call(**kwargs: Any) -> Callable[..., Any]:
    plgpu = _mgpu()
    return functools.partial(pl.pallas_call, compiler_params=plgpu.CompilerParams(), **kwargs)


def _add_one_1d(x: jax.Array) -> jax.Array:  # test_add_one_1d
    @_mgpu_call(
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
        out_specs=pl.BlockSpec((128,), lambda i: (i,)),
        grid=(x.shape[0] // 128,),
    )
    def add_one_1d(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1.0

    return add_one_1d(x)


def _add_one_2d(x: jax.Array) -> jax.Array:  # test_add_one_2d
    @_mgpu_call(
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        grid=(x.shape[0] // 8,),
    )
    def add_one_2d(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1.0

    return add_one_2d(x)


def _program_ids() -> jax.Array:  # test_block_spec_no_block_shape
    @_mgpu_call(
        out_shape=jax.ShapeDtypeStruct((128,), jnp.int32),
        out_specs=pl.BlockSpec(None, lambda i: i),
        grid=(1,),
    )
    def program_ids(o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = jnp.full(o_ref.shape, pl.program_id(0))

    return program_ids()


@pytest.mark.parametrize(
    ("name", "run", "expected"),
    [
        ("add_one_1d", lambda: _add_one_1d(jnp.ones(8 * 128)), np.full(8 * 128, 2.0)),
        ("add_one_2d", lambda: _add_one_2d(jnp.ones((64, 128))), np.full((64, 128), 2.0)),
        ("program_ids", _program_ids, np.zeros(128, np.int32)),
    ],
)
def test_mosaic_gpu_block_spec_kernels_fall_back_to_the_plain_interpreter(
    guard: Callable[..., None], name: str, run: Callable[[], jax.Array], expected: np.ndarray
) -> None:
    guard("interpret")
    np.testing.assert_array_equal(np.asarray(run()), expected)
    (decision,) = _decisions(name)
    assert (decision.action, decision.interpreter) == ("interpreted", "plain")
    if _interpreters.available("gpu"):  # jax >= 0.9.0: verified, failed, and the next one taken
        assert decision.tried[0].startswith("gpu: failed (AssertionError"), decision.tried
        assert decision.tried[-1] == "plain: ok"
        assert "tried gpu: failed" in decision.reason


def test_mosaic_gpu_kernel_with_a_trivial_window_keeps_the_mosaic_gpu_interpreter(guard: Callable[..., None]) -> None:
    if not _interpreters.available("gpu"):
        pytest.skip("this jax has no Mosaic-GPU interpreter")
    guard("interpret")

    @_mgpu_call(out_shape=jax.ShapeDtypeStruct((128,), jnp.float32))
    def whole_block(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] * 3

    x = jnp.arange(128, dtype=jnp.float32)
    np.testing.assert_array_equal(whole_block(x), x * 3)
    (decision,) = _decisions("whole_block")
    assert (decision.interpreter, decision.layer, decision.tried) == ("gpu", "front door", ("gpu: ok",))


def test_verification_is_paid_once_per_kernel_and_shapes(guard: Callable[..., None]) -> None:
    from pallas_guard._surfaces import install as _install

    guard("interpret")
    ledger = _install.installation.ledger
    x = jnp.ones(8 * 128)
    _add_one_1d(x)
    settled = ledger.settled_count()
    jax.clear_caches()
    _add_one_1d(x + 1)  # a new pallas_call, the same kernel and shapes: no new trial
    assert ledger.settled_count() == settled
    _add_one_1d(jnp.ones(16 * 128))  # new shapes: verified again
    assert ledger.settled_count() == settled + 1


def test_no_interpreter_runs_it_one_error_lists_each(guard: Callable[..., None]) -> None:
    """Non-trivial block windows (the Mosaic-GPU interpreter refuses them) and a Mosaic-GPU
    primitive (the plain interpreter and TPU interpret mode have no rule for it)."""
    if not _interpreters.available("gpu"):
        pytest.skip("this jax has no Mosaic-GPU interpreter")
    plgpu = _mgpu()
    guard("interpret")

    @_mgpu_call(
        out_shape=jax.ShapeDtypeStruct((256,), jnp.float32),
        in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
        out_specs=pl.BlockSpec((128,), lambda i: (i,)),
        grid=(2,),
    )
    def unrunnable(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1.0
        plgpu.commit_smem()

    with pytest.raises(pallas_guard.PallasGuardError) as info:
        unrunnable(jnp.ones(256))  # CALL-SITE-UNRUNNABLE
    text = str(info.value)
    assert "no interpreter could run Pallas kernel" in text and "unrunnable" in text
    assert f"called at {__file__}:{line_of('CALL-SITE-UNRUNNABLE')}" in text
    listed = [line for line in text.splitlines() if line.startswith("  - ")]
    assert [line.split(":")[0] for line in listed] == [
        "  - the Mosaic-GPU interpreter",
        "  - the plain interpreter (interpret=True)",
        "  - TPU interpret mode",
    ]
    assert "AssertionError" in listed[0] and "commit_smem" in listed[1]
    assert "this looks like a gap in them" in text  # each failure is inside JAX's interpreters
    assert "PALLAS_GUARD_INTERPRETER=" in text
    assert info.value.__cause__ is not None  # chained from the first failure
    assert isinstance(info.value.__cause__, AssertionError)


def test_a_bug_in_the_kernel_stays_the_users_unchanged(guard: Callable[..., None]) -> None:
    """Every interpreter fails the same way: not the interpreters' fault, so JAX's own error."""
    if not _interpreters.available("gpu"):
        pytest.skip("without the Mosaic-GPU interpreter (jax < 0.9) the guard explains the failure as that gap")
    guard("interpret")

    @_mgpu_call(out_shape=jax.ShapeDtypeStruct((128,), jnp.float32))
    def broken(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + jnp.ones((3,))  # shapes that cannot broadcast

    with pytest.raises(Exception) as info:  # whatever JAX raises, unchanged
        broken(jnp.ones(128))
    assert not isinstance(info.value, pallas_guard.PallasGuardError)
    assert isinstance(info.value, TypeError)  # JAX's own shape error, not a wrapper of ours
    assert "incompatible shapes for broadcasting: (128,), (3,)" in str(info.value)


# --- program_id inside control flow (tokamax's Triton attention backward) ---------------------------------


def _pid_in_when(x: jax.Array) -> jax.Array:
    def pid_in_when(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...]

        @pl.when(pl.program_id(0) >= 0)
        def _():  # type: ignore[no-untyped-def]
            o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        pid_in_when, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,), in_specs=[spec], out_specs=spec
    )(x)


def test_program_id_inside_control_flow_falls_back_to_tpu_interpret_mode(guard: Callable[..., None]) -> None:
    guard("interpret")
    x = jnp.zeros((16, 128), jnp.float32)
    expected = np.concatenate([np.zeros((8, 128)), np.ones((8, 128))]).astype(np.float32)
    np.testing.assert_array_equal(_pid_in_when(x), expected)
    (decision,) = _decisions("pid_in_when")
    if decision.interpreter == "plain":  # a jax whose plain interpreter handles it: verified, kept
        assert decision.tried == ("plain: ok",)
    else:
        assert decision.interpreter == "tpu"
        assert decision.tried[0].startswith("plain: failed (NotImplementedError")


# --- through a library installed in site-packages ----------------------------------------------------------

LIBRARY = '''
"""A kernel library: the user calls its API, it calls Pallas."""
import jax
from jax.experimental import pallas as pl


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def double(x):
    return pl.pallas_call(_double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)  # LIBRARY-CALL
'''


@pytest.fixture
def kernel_library(tmp_path: Path) -> Iterator[Any]:
    site_packages = tmp_path / "lib" / "python" / "site-packages"
    (site_packages / "kernel_library").mkdir(parents=True)
    (site_packages / "kernel_library" / "__init__.py").write_text(textwrap.dedent(LIBRARY))
    saved = list(sys.path)
    site.addsitedir(str(site_packages))
    try:
        yield importlib.import_module("kernel_library")
    finally:
        sys.path[:] = saved
        sys.modules.pop("kernel_library", None)


def test_warning_and_record_name_the_callers_line_with_the_library_beside_it(
    guard: Callable[..., None], kernel_library: Any
) -> None:
    guard("warn")
    x = jnp.ones(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_array_equal(jax.jit(kernel_library.double)(x), x * 2)  # CALL-SITE-LIBRARY
    (warning,) = [w for w in caught if issubclass(w.category, pallas_guard.PallasGuardWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line_of("CALL-SITE-LIBRARY"))
    library_line = f"{kernel_library.__file__}:{line_of('LIBRARY-CALL', kernel_library.__file__)}"
    assert f"(via {library_line})" in str(warning.message)
    (decision,) = pallas_guard.decisions()
    assert decision.called_at == f"{__file__}:{line_of('CALL-SITE-LIBRARY')}"
    assert decision.via == library_line
    assert decision.defined_at == f"{kernel_library.__file__}:{line_of('def _double', kernel_library.__file__)}"


def test_strict_names_the_callers_line_and_says_interpret_is_not_the_callers_to_pass(
    guard: Callable[..., None], kernel_library: Any
) -> None:
    guard("strict")
    with pytest.raises(pallas_guard.PallasGuardError) as info:
        kernel_library.double(jnp.ones(8))  # CALL-SITE-LIBRARY-STRICT
    text = str(info.value)
    assert f"called at {__file__}:{line_of('CALL-SITE-LIBRARY-STRICT')} (via {kernel_library.__file__}:" in text
    assert "so set the policy rather than interpret=" in text


# --- "defined at" for any body --------------------------------------------------------------------------------


class _Kernels:
    def method(self, x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1

    def __call__(self, x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1


def _plain_body(x_ref, o_ref, amount=1):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + amount


def _closure() -> Callable[..., None]:
    def closure_body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1

    return closure_body


@pytest.mark.parametrize(
    ("body", "defined"),
    [
        (functools.partial(_plain_body, amount=1), "def _plain_body"),
        (functools.partial(functools.partial(_plain_body), amount=1), "def _plain_body"),
        (_Kernels().method, "def method"),
        (_Kernels(), "def __call__"),
        (functools.wraps(_plain_body)(lambda *a: _plain_body(*a)), "def _plain_body"),  # noqa: PLW0108
        (_closure(), "def closure_body"),
    ],
    ids=["partial", "nested-partial", "bound-method", "callable-object", "decorated", "closure"],
)
def test_defined_at_for_any_body(guard: Callable[..., None], body: Any, defined: str) -> None:
    guard("strict")
    x = jnp.ones(8)
    with pytest.raises(pallas_guard.PallasGuardError) as info:
        pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    assert f"(defined at {__file__}:{line_of(defined)})" in str(info.value)
