"""Several CPU devices (``--xla_force_host_platform_device_count=4``): a guarded kernel in shard_map.

XLA_FLAGS must be set before the CPU backend starts, so this runs in a fresh interpreter.
``shard_map`` moved from ``jax.experimental.shard_map`` to ``jax.shard_map`` (and ``check_rep``
became ``check_vma``): located by feature detection, like everything else.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import run_python

from pallas_guard._deciding import interpreters

PROGRAM = """
import inspect, json
import pallas_guard
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.sharding import Mesh, PartitionSpec as P

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map
parameters = inspect.signature(shard_map).parameters
no_check = {"check_vma": False} if "check_vma" in parameters else {"check_rep": False}

def kernel(x_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...]) * 3 + x_ref[...]

def per_shard(x, **extra):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **extra)(x)

mesh = Mesh(np.array(jax.devices()), ("d",))
def sharded(**extra):
    body = lambda x: per_shard(x, **extra)
    return jax.jit(shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), **no_check))

x = jnp.linspace(-3, 3, 4 * 8 * 16, dtype=jnp.float32).reshape(4 * 8, 16)
by_hand = sharded(interpret=True)(x)
pallas_guard.clear_decisions()  # (the guard records the by-hand kernel too: untouched)
guarded = sharded()(x)
records = pallas_guard.decisions()
jax.clear_caches()
with pallas_guard.policy("strict"):
    try:
        sharded()(x)
        strict = "ran"
    except pallas_guard.PallasGuardError as error:
        strict = str(error).splitlines()[0]
print(json.dumps({
    "devices": jax.device_count(),
    "shards": len(guarded.sharding.device_set),
    "identical": np.asarray(guarded).tobytes() == np.asarray(by_hand).tobytes(),
    "decisions": [(d.action, d.interpreter, d.layer) for d in records],
    "strict": strict,
}))
"""


def test_guarded_kernel_inside_shard_map_on_four_cpu_devices() -> None:
    result = run_python(
        PROGRAM,
        env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    assert report["shards"] == 4
    assert report["identical"] is True
    # One kernel in the program (shard_map lowers the body once for all devices), interpreted.
    assert report["decisions"] == [["interpreted", "plain", "lowering"]]
    assert "would lower for the CPU without interpret=" in report["strict"]


SHARD_MAP = """
import functools, inspect, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec as P
import pallas_guard

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map
parameters = inspect.signature(shard_map).parameters
no_check = {"check_vma": False} if "check_vma" in parameters else {"check_rep": False}
"""
"""What each program below starts with: the imports, and ``shard_map`` where this jax keeps it."""


SCATTER = (
    SHARD_MAP
    + """ANY = getattr(pl, "ANY", None) or pltpu.ANY

def scatter_rows(slices_ref, new_ref, cache_ref, out_ref, sem):
    # Copies of a length read at run time: the plain interpreter cannot slice them.
    del cache_ref
    def one(i, carry):
        to, start, rows = slices_ref[0, i], slices_ref[1, i], slices_ref[2, i]
        copy = pltpu.make_async_copy(new_ref.at[pl.ds(start, rows)], out_ref.at[pl.ds(to, rows)], sem)
        copy.start()
        copy.wait()
        return carry
    jax.lax.fori_loop(0, slices_ref.shape[1], one, 0)

def update(slices, new, cache):
    return pl.pallas_call(
        scatter_rows,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=ANY), pl.BlockSpec(memory_space=ANY)],
            out_specs=pl.BlockSpec(memory_space=ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA],
        ),
        input_output_aliases={2: 0},
    )(slices, new, cache)

mesh = Mesh(np.array(jax.devices()), ("tensor",))
heads = P(None, "tensor")
sharded = jax.jit(shard_map(update, mesh=mesh, in_specs=(P(), heads, heads), out_specs=heads, **no_check))
slices = np.array([[0, 8], [0, 2], [2, 3]], np.int32)
new = np.arange(5 * 4 * 128, dtype=np.float32).reshape(5, 4, 128)
out = np.asarray(sharded(jnp.asarray(slices), jnp.asarray(new), jnp.zeros((16, 4, 128), jnp.float32)))
expected = np.zeros((16, 4, 128), np.float32)
expected[0:2], expected[8:11] = new[0:2], new[2:5]
(decision,) = pallas_guard.decisions()
print(json.dumps({"right": bool((out == expected).all()), "interpreter": decision.interpreter,
                  "reason": decision.reason}))
"""
)


def test_a_kernel_only_tpu_interpret_mode_runs_is_tried_inside_its_shard_map() -> None:
    """Plain cannot slice copies of a length read at run time; TPU interpret mode, tried in the
    ``shard_map`` the kernel is called in (its axis names bound), runs it and is chosen."""
    if not interpreters.available("tpu"):
        pytest.skip("this jax has no TPU interpret mode")
    result = run_python(
        SCATTER,
        env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["right"] is True
    assert report["interpreter"] == "tpu"
    assert "tried plain: failed" in report["reason"]


ASKED_INSIDE = (
    SHARD_MAP
    + """asked = {}

def body(x):
    try:
        asked["cores"] = pltpu.get_tpu_info().num_cores
    except AttributeError:  # a jax without get_tpu_info
        asked["cores"] = len(pltpu.create_tensorcore_mesh("core").devices.flat)
    asked["mesh"] = list(jax.sharding.get_abstract_mesh().axis_names)
    return x

mesh = Mesh(np.array(jax.devices()), ("x",))
jax.jit(shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **no_check))(jnp.zeros((4, 8)))
print(json.dumps(asked))
"""
)


def test_host_code_inside_shard_map_is_told_the_device_setting() -> None:
    """Inside a mesh of this host's CPU devices, ``get_tpu_info`` (``create_tensorcore_mesh`` before
    it) asks the mesh's device: it is told the device setting's (a TPU v4: two cores), the mesh's
    axes kept."""
    result = run_python(
        ASKED_INSIDE,
        env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
            "PALLAS_GUARD_DEVICE": "tpu-v4",
        },
    )
    if "has no attribute 'create_tensorcore_mesh'" in result.stderr:
        pytest.skip("this jax has no pltpu.create_tensorcore_mesh")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"cores": 2, "mesh": ["x"]}


RING = (
    SHARD_MAP
    + """devices = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))
waits_for_its_receive = sys.argv[1] == "waits"

def ring(x_ref, o_ref, send, recv):
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, devices)
    copy = pltpu.make_async_remote_copy(
        src_ref=x_ref, dst_ref=o_ref, send_sem=send, recv_sem=recv, device_id=(right,),
        device_id_type=(getattr(pltpu, "DeviceIdType", None) or pl.DeviceIdType).MESH,
    )
    copy.start()
    if waits_for_its_receive:
        copy.wait()
    else:
        copy.wait_send()  # its block may still be arriving when the kernel ends

def body(x):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(ring, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[vmem], out_specs=vmem,
                          scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])(x)

x = jnp.repeat(jnp.arange(devices, dtype=jnp.float32), 8 * 128).reshape(devices * 8, 128)
try:
    out = jax.jit(shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **no_check))(x)
    print(json.dumps({"received": [float(v) for v in np.asarray(out)[::8, 0]]}))
except pallas_guard.PallasGuardError as error:
    print(json.dumps({"found": str(error).splitlines()[0]}))
"""
)


def _under_races_on_four_devices(program: str) -> dict[str, Any]:
    """``program``'s last line (JSON), run under ``races`` on 4 CPU devices in a process of its own
    (a timeout fails the test where the process would hang); skipped without TPU interpret mode."""
    if not interpreters.available("tpu"):
        pytest.skip("this jax has no TPU interpret mode")
    result = run_python(
        program,
        env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
            "PALLAS_GUARD_CHECKS": "races",
        },
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("waits", [True, False], ids=["waits for its receive", "never waits for its receive"])
def test_a_race_across_devices_is_found_without_hanging_the_process(waits: bool) -> None:
    """Each device runs the kernel in a thread of TPU interpret mode, which waits for all of them at
    the end: the finding is raised once the computation is done (a subprocess timeout fails the
    test where it would hang)."""
    report = _under_races_on_four_devices(RING.replace("sys.argv[1]", repr("waits" if waits else "no")))
    if waits:
        assert report == {"received": [3.0, 0.0, 1.0, 2.0]}
    else:
        assert report["found"].startswith("pallas_guard: a data race was detected in Pallas kernel 'ring'")


TWO_RINGS = (
    SHARD_MAP
    + """devices = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))

def ring(x_ref, o_ref, send, recv, *, waits):
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, devices)
    copy = pltpu.make_async_remote_copy(
        src_ref=x_ref, dst_ref=o_ref, send_sem=send, recv_sem=recv, device_id=(right,),
        device_id_type=(getattr(pltpu, "DeviceIdType", None) or pl.DeviceIdType).MESH,
    )
    copy.start()
    copy.wait() if waits else copy.wait_send()

def body(x):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    for waits in (False, True):  # the racy ring, then one that waits for what it receives
        x = pl.pallas_call(functools.partial(ring, waits=waits), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           in_specs=[vmem], out_specs=vmem,
                           scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])(x)
    return x

x = jnp.repeat(jnp.arange(devices, dtype=jnp.float32), 8 * 128).reshape(devices * 8, 128)
try:
    out = jax.jit(shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **no_check))(x)
    print(json.dumps({"received": [float(v) for v in np.asarray(out)[::8, 0]]}))
except pallas_guard.PallasGuardError as error:
    print(json.dumps({"found": str(error).splitlines()[0]}))
"""
)


def test_a_race_in_the_first_of_two_kernels_across_devices_is_found() -> None:
    """The detector's verdict is read as each kernel ends: a later kernel of the same program,
    which starts the detector afresh, does not hide the race of an earlier one."""
    report = _under_races_on_four_devices(TWO_RINGS)
    assert report.get("found", "").startswith("pallas_guard: a data race was detected in Pallas kernel 'ring'"), report


UNSIGNALLED = (
    SHARD_MAP
    + """devices = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))
signalled = sys.argv[1] == "signalled"

def kernel(x_ref, o_ref, sem):
    me = jax.lax.axis_index("x")
    right = jax.lax.rem(me + 1, devices)
    ids = (getattr(pltpu, "DeviceIdType", None) or pl.DeviceIdType).MESH
    # Device 0 signals its right neighbour once; each device waits for twice that unless every
    # device signals its neighbour twice.
    @pl.when(jnp.logical_or(me == 0, signalled))
    def _():
        pl.semaphore_signal(sem, 1, device_id=(right,), device_id_type=ids)
        if signalled:
            pl.semaphore_signal(sem, 1, device_id=(right,), device_id_type=ids)
    pl.semaphore_wait(sem, 2)
    o_ref[...] = x_ref[...] + 1

def body(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          scratch_shapes=[pltpu.SemaphoreType.REGULAR])(x)

x = jnp.zeros((devices * 8, 128), jnp.float32)
try:
    out = jax.jit(shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **no_check))(x)
    print(json.dumps({"sum": float(np.asarray(out).sum())}))
except pallas_guard.PallasGuardError as error:
    print(json.dumps({"found": str(error)}))
"""
)


UNSENT = (
    SHARD_MAP
    + """devices = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))

def ring(x_ref, o_ref, send, recv):
    me = jax.lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(
        src_ref=x_ref, dst_ref=o_ref, send_sem=send, recv_sem=recv, device_id=(jax.lax.rem(me + 1, devices),),
        device_id_type=(getattr(pltpu, "DeviceIdType", None) or pl.DeviceIdType).MESH,
    )
    @pl.when(me == 0)  # only device 0 sends: the others wait for a receive nobody sends
    def _():
        copy.start()
        copy.wait_send()
    copy.wait_recv()

def body(x):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(ring, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[vmem], out_specs=vmem,
                          scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])(x)

x = jnp.ones((devices * 8, 128), jnp.float32)
try:
    out = jax.jit(shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), **no_check))(x)
    print(json.dumps({"sum": float(np.asarray(out).sum())}))
except pallas_guard.PallasGuardError as error:
    print(json.dumps({"found": str(error)}))
"""
)


def test_a_receive_no_device_sends_is_a_finding_not_a_hang() -> None:
    found = _under_races_on_four_devices(UNSENT)["found"]
    assert found.startswith("pallas_guard: a race (a semaphore wait no signal satisfies) in Pallas kernel 'ring'")
    # Device 1 got device 0's block (4096 bytes); 0, 2 and 3 wait for one nobody sends.
    assert "the waits of device 0 core 0 for 4096 (it holds 0), of device 2 core 0 for 4096 (it holds 0)" in found
    assert "of device 1 " not in found


@pytest.mark.parametrize("signalled", [True, False], ids=["every wait signalled", "a wait no device signals"])
def test_a_wait_no_device_signals_is_a_finding_not_a_hang(signalled: bool) -> None:
    """TPU interpret mode runs each device in a thread of its own: a semaphore wait that no device
    will signal blocks for ever, as the TPU would. Under races it is a finding (a subprocess
    timeout fails the test where it would hang); waits that are signalled run as before."""
    report = _under_races_on_four_devices(UNSIGNALLED.replace("sys.argv[1]", repr("signalled" if signalled else "no")))
    if signalled:
        assert report == {"sum": 4 * 8 * 128.0}
        return
    found = report["found"]
    assert found.startswith("pallas_guard: a race (a semaphore wait no signal satisfies) in Pallas kernel 'kernel'")
    # Device 1 holds the one signal, the others none; every one of the four waits for 2.
    assert "of device 0 core 0 for 2 (it holds 0), of device 1 core 0 for 2 (it holds 1)" in found
    assert "of device 3 core 0 for 2 (it holds 0)" in found and "wait forever" in found


@pytest.mark.parametrize(
    ("xla_flags", "started_first", "devices"),
    [(None, False, 8), ("--xla_force_host_platform_device_count=2", False, 2), (None, True, 1)],
    ids=["given the slice's devices", "the user's own count kept", "started before: told what to set"],
)
def test_a_slice_the_device_setting_names_is_simulated_on_the_cpu(
    xla_flags: str | None, started_first: bool, devices: int
) -> None:
    """``PALLAS_GUARD_DEVICE=tpu-v5e:2x4``: the CPU backend, not started yet, gets the slice's 8
    devices (what a user would set by hand); a count of the user's stays; a backend started before
    the guard stays as it is, and a warning says what to set."""
    code = f"""
import jax
if {started_first}:
    jax.devices()
import pallas_guard
from jax.experimental import pallas as pl
print(jax.device_count())
"""
    result = run_python(
        code,
        env={
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
            "PALLAS_GUARD_DEVICE": "tpu-v5e:2x4",
            "XLA_FLAGS": xla_flags,
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.strip().splitlines()[-1]) == devices
    told = "XLA_FLAGS=--xla_force_host_platform_device_count=8" in result.stderr
    assert told is started_first, result.stderr[-2000:]


def test_uninstall_before_the_backend_starts_gives_the_cpu_its_own_device_count_back() -> None:
    code = """
import jax
import pallas_guard
pallas_guard.install("interpret", device="tpu-v5e:2x4")
from jax.experimental import pallas as pl
given = jax.config.jax_num_cpu_devices
pallas_guard.uninstall()
print(given, jax.config.jax_num_cpu_devices, jax.device_count())
"""
    result = run_python(code, env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": None, "PALLAS_GUARD_POLICY": None})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["8", "-1", "1"]
