"""The compile check for a kernel called inside ``shard_map``: compiled by libtpu in the program a
pod slice of the mesh's shape runs (a topology of the device setting's generation with as many
devices as the mesh), with the per-shard shapes, so a kernel that talks to other chips compiles and
a VMEM verdict follows the sharding.

The programs run in fresh interpreters with several CPU devices (``XLA_FLAGS`` must be set before
the CPU backend starts); they need libtpu (``.ci/run tpu``). The topology table needs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python

from pallas_guard._running import tpu_compile as _tpu_compile

needs_libtpu = pytest.mark.skipif(_tpu_compile.available() is not None, reason=str(_tpu_compile.available()))


@pytest.mark.parametrize(
    ("generation", "devices", "topology"),
    [
        ("tpu-v5e", 1, "v5e:1x1"),
        ("tpu-v5e", 2, "v5e:2x1"),
        ("tpu-v5e", 4, "v5e:2x2"),
        ("tpu-v5e", 8, "v5e:2x4"),
        ("tpu-v6e", 4, "v6e:2x2"),
        ("tpu-v4", 4, "v4:2x2x1"),
        ("tpu-v5p", 8, "v5p:2x2x2"),
        ("tpu7x", 8, "tpu7x:2x2x1"),  # two devices a chip
    ],
)
def test_a_mesh_maps_onto_the_topology_with_as_many_devices(generation: str, devices: int, topology: str) -> None:
    found = _tpu_compile.topology_for(generation, devices)
    assert isinstance(found, tuple) and found[0] == topology


@pytest.mark.parametrize(("generation", "devices"), [("tpu-v5e", 3), ("tpu-v5e", 6), ("tpu7x", 1), ("tpu-v4", 128)])
def test_a_mesh_no_topology_has_says_which_counts_there_are(generation: str, devices: int) -> None:
    found = _tpu_compile.topology_for(generation, devices)
    assert isinstance(found, str) and f"a mesh of {devices} devices maps onto no {generation} topology" in found


PROGRAM = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.sharding import Mesh, PartitionSpec as P
import pallas_guard

devices = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))

def plus_index(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jax.lax.axis_index("x").astype(jnp.float32)

def body(x):
    return pl.pallas_call(plus_index, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

rows = GLOBAL_ROWS // devices  # a global array of that many rows, sharded over the mesh
x = jnp.ones((devices * rows, 1024), jnp.float32)
sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
try:
    out = np.asarray(sharded(x))
    outcome = {"ran": [float(v) for v in out[::rows, 0]]}
except pallas_guard.PallasGuardError as error:
    outcome = {"refused": str(error)}
(decision,) = pallas_guard.decisions()[-1:]
outcome["notes"] = list(decision.notes)
outcome["memory"] = [[m.generation, m.space, m.used, m.limit, m.compiled] for m in decision.memory]
print(json.dumps(outcome))
"""


def _sharded(devices: int, rows: int, device: str = "tpu-v5e") -> dict[str, object]:
    result = run_python(
        PROGRAM.replace("GLOBAL_ROWS", str(rows)),
        env={
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
            "PALLAS_GUARD_CHECKS": "compile",
            "PALLAS_GUARD_DEVICE": device,
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


MIB = 1 << 20


@needs_libtpu
def test_a_kernel_that_asks_its_axis_index_compiles_inside_shard_map_and_runs() -> None:
    """Outside its shard_map the kernel cannot be lowered ("communication ... without shard_map"):
    compiled in the program of a v5e:2x2 it compiles, and the interpreted run gives each shard its
    index."""
    report = _sharded(4, 32)
    assert report["ran"] == [1.0, 2.0, 3.0, 4.0]
    (note,) = report["notes"]  # type: ignore[misc]
    assert note.startswith("compile: compiles for tpu-v5e (v5e:2x2, per shard of a mesh x=4): VMEM ")


BUILT_BEFORE = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.sharding import Mesh, PartitionSpec as P

def plus_index(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jax.lax.axis_index("x").astype(jnp.float32)

kernel = pl.pallas_call(plus_index, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))

import pallas_guard  # installed after the kernel was built: its calls never reach the front door

pallas_guard.install("interpret", checks="compile", device="tpu-v5e")
mesh = Mesh(np.array(jax.devices()), ("x",))
sharded = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
out = np.asarray(sharded(jnp.ones((32, 128), jnp.float32)))
(decision,) = pallas_guard.decisions()
print(json.dumps({"ran": [float(v) for v in out[::8, 0]], "notes": list(decision.notes)}))
"""


@needs_libtpu
def test_a_kernel_built_before_install_is_compiled_in_the_program_of_its_shard_map() -> None:
    """The lowering net compiles its equation, in the ``shard_map`` it lowers in."""
    result = run_python(
        BUILT_BEFORE, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ran"] == [1.0, 2.0, 3.0, 4.0]
    (note,) = report["notes"]
    assert note.startswith("compile: compiles for tpu-v5e (v5e:2x2, per shard of a mesh x=4): VMEM ")


@needs_libtpu
def test_the_vmem_verdict_follows_the_sharding() -> None:
    """The same 24 MiB array: 12 MiB a shard on 2 chips (its block and its output's, 24 MiB, over
    the 16 MiB scoped limit: refused, with libtpu's figure) and 6 MiB a shard on 4 (compiles)."""
    rows = 24 * MIB // (1024 * 4)
    on_two = _sharded(2, rows)
    assert "v5e:2x1, per shard of a mesh x=2" in str(on_two["refused"])
    assert "Scoped allocation with size 24.00M and limit 16.00M" in str(on_two["refused"])
    assert on_two["memory"] == [["tpu-v5e", "VMEM", 24 * MIB, 16 * MIB, False]]
    on_four = _sharded(4, rows)
    assert on_four["ran"] == [1.0, 2.0, 3.0, 4.0]
    assert ["tpu-v5e", "VMEM", 12 * MIB, 16 * MIB, True] in on_four["memory"]  # type: ignore[operator]


@needs_libtpu
def test_a_mesh_no_topology_of_the_generation_has_is_a_note_not_a_verdict() -> None:
    report = _sharded(3, 24)
    assert report["ran"] == [1.0, 2.0, 3.0]
    (note,) = report["notes"]  # type: ignore[misc]
    assert note.startswith("compile: not checked for tpu-v5e: a mesh of 3 devices maps onto no tpu-v5e topology")


RING = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec as P
import pallas_guard

devices = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("x",))

def ring(x_ref, o_ref, send, recv):
    right = jax.lax.rem(jax.lax.axis_index("x") + 1, devices)
    copy = pltpu.make_async_remote_copy(
        src_ref=x_ref, dst_ref=o_ref, send_sem=send, recv_sem=recv, device_id=(right,),
        device_id_type=pltpu.DeviceIdType.MESH,
    )
    copy.start()
    copy.wait()

def body(x):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(ring, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[vmem], out_specs=vmem,
                          scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA])(x)

x = jnp.repeat(jnp.arange(devices, dtype=jnp.float32), 8 * 128).reshape(devices * 8, 128)
out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)
print(json.dumps({"received": [float(v) for v in np.asarray(out)[::8, 0]],
                  "notes": [n for d in pallas_guard.decisions() for n in d.notes]}))
"""


@needs_libtpu
def test_a_ring_of_remote_copies_compiles_for_the_topology_and_each_device_receives_its_neighbours() -> None:
    result = run_python(
        RING,
        env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
            "PALLAS_GUARD_CHECKS": "compile,bounds",
            "PALLAS_GUARD_DEVICE": "tpu-v5e",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["received"] == [3.0, 0.0, 1.0, 2.0]  # each device holds its left neighbour's block
    assert (
        [n for n in report["notes"] if n.startswith("compile:")]
        == [
            n
            for n in report["notes"]
            if n.startswith("compile: compiles for tpu-v5e (v5e:2x2, per shard of a mesh x=4)")
        ]
        != []
    )


@needs_libtpu
def test_a_slice_the_device_setting_names_is_the_one_compiled_for() -> None:
    """``tpu-v5p:2x4x1`` for a mesh of 8: that slice, not the default ``2x2x2``; a mesh of another
    size is a note naming both counts."""
    named = _sharded(8, 64, device="tpu-v5p:2x4x1")
    assert named["ran"] == [float(i) for i in range(1, 9)]
    (note,) = named["notes"]  # type: ignore[misc]
    assert note.startswith("compile: compiles for tpu-v5p (v5p:2x4x1, per shard of a mesh x=8): VMEM ")
    other = _sharded(4, 32, device="tpu-v5e:2x4")
    assert other["ran"] == [1.0, 2.0, 3.0, 4.0]
    (note,) = other["notes"]  # type: ignore[misc]
    assert note == (
        "compile: not checked for tpu-v5e: the device setting names the slice v5e:2x4 (8 devices), and the mesh has 4"
    )


AHEAD_OF_TIME = """
import json
import numpy as np
import jax
import pallas_guard
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pallas_guard._running import tpu_compile
import sharded_corpus

case = sharded_corpus.by_name()["ring.v5e.4"]
devices = tpu_compile.topology_devices("tpu-v5e", 4)
mesh = Mesh(np.array(devices, dtype=object), ("x",))
shard = NamedSharding(mesh, P("x"))
avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard) for x in case.inputs(4)]
text = jax.jit(case.program(mesh)).lower(*avals).compile().as_text()
print(json.dumps({"mosaic": "tpu_custom_call" in text, "callbacks": "callback" in text,
                  "decisions": [(d.action, d.platforms) for d in pallas_guard.decisions()]}))
"""


@needs_libtpu
def test_a_program_compiled_ahead_of_time_for_a_tpu_topology_is_left_to_the_tpu() -> None:
    """From this CPU host, with the guard interpreting: a ring of remote DMAs inside ``shard_map``
    over a v5e:2x2 topology's devices lowers for the TPU (the mesh in force says so), as libtpu
    alone compiles it: a Mosaic kernel, no interpreter callbacks."""
    here = Path(__file__).resolve().parent  # sharded_corpus
    result = run_python(AHEAD_OF_TIME, env={"JAX_PLATFORMS": "cpu", "PALLAS_GUARD_POLICY": "interpret"}, cwd=here)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["mosaic"] is True and report["callbacks"] is False
    assert all(action == "untouched" for action, _ in report["decisions"]), report["decisions"]


def test_slices_of_one_size_keep_their_compiles_apart_on_disk() -> None:
    """Two slices of 8 chips lower a kernel to the same text; what each compiles is kept apart."""

    class Lowered:
        @staticmethod
        def as_text() -> str:
            return "module @kernel {}"

    files = {where: _tpu_compile._verdict_file(Lowered(), "tpu-v5p", where) for where in ("v5p:2x2x2", "v5p:2x4x1")}
    assert None not in files.values() and len(set(files.values())) == 2
