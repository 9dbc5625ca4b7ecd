"""The ``device`` setting: host code that asks which TPU/GPU it runs on is told the device set
(JAX's abstract device), where the target is the CPU and the guard interprets; nothing else
changes, and a mesh of the user's own always wins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python, tensorcore_mesh
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._guard import engine as _engine


def _device_kind() -> str | None:
    device = jax.sharding.get_abstract_mesh().abstract_device
    return None if device is None else str(device.device_kind)


def test_a_device_is_told_where_the_guard_interprets_for_the_cpu(guard: Callable[..., None]) -> None:
    guard("interpret", device="tpu-v5e")
    assert _device_kind() == "TPU v5 lite"
    mesh = tensorcore_mesh("core")  # asks the device for its core count
    assert mesh.shape["core"] == 1
    pallas_guard.uninstall()
    assert _device_kind() is None


@pytest.mark.parametrize("policy", ["strict", "off"])
def test_no_device_under_strict_or_off(guard: Callable[..., None], policy: str) -> None:
    guard(policy, device="tpu-v5e")
    assert _device_kind() is None


def test_none_and_an_unset_device_change_nothing(guard: Callable[..., None]) -> None:
    guard("interpret")
    assert _device_kind() is None
    guard("interpret", device="none")
    assert _device_kind() is None


def test_a_scope_sets_and_takes_away_the_device(guard: Callable[..., None]) -> None:
    guard("interpret", device="tpu-v5e")
    with pallas_guard.policy(device="h100"):
        assert _device_kind() == "NVIDIA H100 80GB HBM3"
    with pallas_guard.policy("strict"):
        assert _device_kind() is None
    assert _device_kind() == "TPU v5 lite"


def test_the_users_own_abstract_mesh_wins(guard: Callable[..., None]) -> None:
    guard("interpret", device="tpu-v5e")
    kind = "TPU v6 lite"
    try:
        theirs = jax.sharding.AbstractDevice(kind, 1, "tpu")
    except TypeError:
        theirs = jax.sharding.AbstractDevice(kind, 1)  # type: ignore[call-arg]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=theirs)):
        assert _device_kind() == kind
        with pallas_guard.policy(device="h100"):  # the guard's scope never replaces the user's mesh
            assert _device_kind() == kind


def test_devices_jit_and_a_users_mesh_are_unaffected(guard: Callable[..., None]) -> None:
    devices = jax.devices()
    guard("interpret", device="tpu-v5e")
    assert jax.devices() == devices
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    x = jax.device_put(jnp.arange(8.0), sharding)
    out = jax.jit(lambda a: jnp.sin(a) * 2, out_shardings=sharding)(x)
    np.testing.assert_allclose(out, np.sin(np.arange(8.0)) * 2, rtol=1e-6)
    assert out.sharding == sharding


def test_a_bad_device_names_the_input_and_the_closest_value() -> None:
    with pytest.raises(pallas_guard.PallasGuardConfigError) as info:
        pallas_guard.install("interpret", device="h1000")
    text = str(info.value)
    assert "install(device=...)='h1000'" in text and "'tpu-v5e'" in text and "did you mean 'h100'?" in text


def test_a_bad_device_in_a_list_names_the_list_and_the_part_it_would_fix() -> None:
    with pytest.raises(pallas_guard.PallasGuardConfigError) as info:
        pallas_guard.install("interpret", device="tpu-v5e,tpu-v66e")
    assert "did you mean 'tpu-v5e,tpu-v6e'?" in str(info.value)
    with pytest.raises(TypeError, match=r"device=\.\.\.\) must be a str or a list of str, got list \[1\]"):
        pallas_guard.install("interpret", device=[1])  # type: ignore[list-item]


def test_host_code_is_told_the_first_device_of_a_list(guard: Callable[..., None]) -> None:
    guard("interpret", device="tpu-v6e,h100")
    assert _device_kind() == "TPU v6 lite"


def test_jaxs_own_device_kinds_are_accepted(guard: Callable[..., None]) -> None:
    guard("interpret", device="NVIDIA H100 80GB HBM3")
    assert _device_kind() == "NVIDIA H100 80GB HBM3"


def test_tpu_interpret_mode_simulates_the_devices_cores() -> None:
    value = _engine.interpret_value("tpu", _interpreters.PLAIN_ONLY, cores=2)
    if not hasattr(value, "num_cores_or_threads"):
        pytest.skip("this jax's TPU interpret mode has no core count")
    assert value.num_cores_or_threads == 2


EMIT_PIPELINE = """
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

def outer(x_hbm, o_hbm):
    def inner(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    pltpu.emit_pipeline(inner, grid=(4,), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
out = pl.pallas_call(outer, out_shape=x, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                     out_specs=pl.BlockSpec(memory_space=pl.ANY))(x)
np.testing.assert_array_equal(out, x * 2)
print("emit_pipeline ok")
"""


@pytest.mark.parametrize("device", ["tpu-v5e", None])
def test_an_emit_pipeline_kernel_runs_with_a_device_set(device: str | None) -> None:
    """emit_pipeline asks for TPU info (tiling) even when interpreted: the variables alone suffice."""
    env = {"PALLAS_GUARD_POLICY": "interpret", "JAX_PLATFORMS": "cpu", "PALLAS_GUARD_DEVICE": device}
    result = run_python(EMIT_PIPELINE, env=env)
    if device is None:
        assert result.returncode != 0
        # jax >= 0.8: "Unsupported TPU device kind: cpu"; 0.7: an assertion on the device kind.
        assert "Unsupported TPU device kind: cpu" in result.stderr or "_get_tpu_generation" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "emit_pipeline ok" in result.stdout


def test_a_core_mesh_kernel_runs_with_the_variables_alone() -> None:
    script = """
        import inspect, jax, jax.numpy as jnp, numpy as np
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu
        if not hasattr(pl, "kernel"):
            print("no pl.kernel"); raise SystemExit
        out = "out_type" if "out_type" in inspect.signature(pl.kernel).parameters else "out_shape"
        x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
        # pltpu.create_tensorcore_mesh, or pltpu.TensorCoreMesh where jax (0.12.1) removed it
        create = vars(pltpu).get("create_tensorcore_mesh") or (lambda name: pltpu.TensorCoreMesh(axis_name=name))
        MESH = create("core")
        @pl.kernel(mesh=MESH, **{out: jax.ShapeDtypeStruct(x.shape, x.dtype)})
        def copy(x_ref, o_ref):  # HBM refs: copied, never read directly (a TPU refuses that)
            pltpu.sync_copy(x_ref, o_ref)
        np.testing.assert_array_equal(copy(x), x)
        print("core mesh ok")
        """
    env = {"PALLAS_GUARD_POLICY": "interpret", "JAX_PLATFORMS": "cpu", "PALLAS_GUARD_DEVICE": "tpu-v5e"}
    result = run_python(script, env=env)
    assert result.returncode == 0, result.stderr
    assert "core mesh ok" in result.stdout or "no pl.kernel" in result.stdout


def test_host_code_without_a_device_fails_as_before_and_with_one_runs(guard: Callable[..., None]) -> None:
    guard("interpret")
    with pytest.raises((AttributeError, ValueError)):
        tensorcore_mesh("core")
    guard("interpret", device="tpu-v5p")
    assert tensorcore_mesh("core").shape["core"] == 2


_ASKS: dict[str, Callable[[], object]] = {
    "get_tpu_info": lambda: pltpu.get_tpu_info(),  # noqa: PLW0108 - looked up at the call: wrapped or not
    "create_tensorcore_mesh": lambda: pltpu.create_tensorcore_mesh("core"),
    # Asks through JAX's own reference to get_tpu_info (a cached function from jax 0.12.1, which
    # names no defining module): the guard wraps it where JAX holds it too.
    "TensorCoreMesh": lambda: pltpu.TensorCoreMesh(axis_name="core"),
}


def _jax_host_functions() -> dict[str, object]:
    """Every place the guard may wrap a host question: the public names and where JAX defines them."""
    import importlib

    places: list[tuple[Any, str]] = [(pltpu, "get_tpu_info"), (pltpu, "create_tensorcore_mesh")]
    for module_name, names in (
        ("jax._src.pallas.mosaic.tpu_info", ("get_tpu_info",)),  # jax >= 0.8
        ("jax._src.tpu_info", ("get_tpu_info",)),  # where JAX's own callers look it up
        ("jax._src.pallas.mosaic.core", ("create_tensorcore_mesh", "_get_default_num_cores")),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        places += [(module, name) for name in names]
    return {f"{module.__name__}.{name}": vars(module).get(name) for module, name in places}


@pytest.mark.parametrize("ask", sorted(_ASKS))
def test_host_code_asking_which_tpu_gets_the_device_setting_as_a_note(ask: str) -> None:
    """Without a device, JAX's own error (type and message) plus a note naming the setting that
    answers it; with one, an answer; under strict no note; after uninstall, JAX's own functions."""
    if not hasattr(pltpu, ask):
        pytest.skip(f"this jax has no pltpu.{ask}")
    call = _ASKS[ask]
    jaxs = _jax_host_functions()
    with pytest.raises(Exception) as unguarded:
        call()
    pallas_guard.install("interpret")
    if ask == "TensorCoreMesh" and isinstance(unguarded.value, AttributeError):
        with pallas_guard.policy(device="tpu-v5e"):
            call()  # the device setting answers it all the same
        pytest.skip("this jax's TensorCoreMesh reads jax.devices()[0].num_cores itself: no host function to note")
    with pytest.raises(type(unguarded.value)) as guarded:
        call()
    assert type(guarded.value) is type(unguarded.value)
    assert str(guarded.value) == str(unguarded.value)
    (note,) = guarded.value.__notes__
    assert "asks which TPU it runs on" in note
    assert "set PALLAS_GUARD_DEVICE=tpu-v5e" in note
    with pallas_guard.policy(device="tpu-v5e"):
        call()
    with pallas_guard.policy("strict"), pytest.raises(type(unguarded.value)) as refused:
        call()
    assert not getattr(refused.value, "__notes__", None)
    # Identity: a wrapt proxy compares equal to what it wraps.
    assert any(f is not jaxs[name] for name, f in _jax_host_functions().items())  # wrapped while installed
    pallas_guard.uninstall()
    assert all(f is jaxs[name] for name, f in _jax_host_functions().items())


SPARSE_CORE = """
import inspect, jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
try:
    from jax.experimental.pallas import tpu_sc as plsc
except ImportError:
    plsc = None
if plsc is None or not hasattr(plsc, "VectorSubcoreMesh") or not hasattr(pl, "kernel"):
    print("no SparseCore mesh"); raise SystemExit
# The mesh's defaults ask the chip's SparseCore info (cores, subcores) in user code, before Pallas.
sizes = {"num_cores": 1}
if "num_subcores" in inspect.signature(plsc.VectorSubcoreMesh).parameters:
    sizes["num_subcores"] = 1
mesh = plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore", **sizes)
out = "out_type" if "out_type" in inspect.signature(pl.kernel).parameters else "out_shape"
x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
@pl.kernel(mesh=mesh, **{out: jax.ShapeDtypeStruct(x.shape, x.dtype)})
def copy(x_hbm, o_hbm):
    pltpu.sync_copy(x_hbm, o_hbm)
np.testing.assert_array_equal(copy(x), x)
print("SparseCore ok")
"""


NO_SPARSE_CORE_INTERPRETER = (
    "jax 0.8: TPU interpret mode fails running a SparseCore kernel (KeyError in its DMA callback) and plain "
    "cannot lower it: the guard says so, listing both (forced by hand, plain returns zeros)"
)


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "tpu-v5p",
            marks=pytest.mark.xfail(jax.__version_info__ < (0, 9), strict=True, reason=NO_SPARSE_CORE_INTERPRETER),
        ),
        None,
    ],
)
def test_a_sparse_core_kernel_runs_with_a_device_set(device: str | None) -> None:
    """A SparseCore mesh asks for the chip's SparseCore info where the user builds it."""
    env = {"PALLAS_GUARD_POLICY": "interpret", "JAX_PLATFORMS": "cpu", "PALLAS_GUARD_DEVICE": device}
    result = run_python(SPARSE_CORE, env=env)
    if "no SparseCore mesh" in result.stdout:
        pytest.skip("this jax has no SparseCore vector-subcore mesh or no pl.kernel")
    if device is None:
        assert result.returncode != 0
        assert "Unsupported TPU device kind: cpu" in result.stderr, result.stderr[-3000:]
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SparseCore ok" in result.stdout
