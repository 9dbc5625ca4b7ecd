"""Several CPU devices (``--xla_force_host_platform_device_count=4``): a guarded kernel in shard_map.

XLA_FLAGS must be set before the CPU backend starts, so this runs in a fresh interpreter.
``shard_map`` moved from ``jax.experimental.shard_map`` to ``jax.shard_map`` (and ``check_rep``
became ``check_vma``): located by feature detection, like everything else.
"""

from __future__ import annotations

import json

from conftest import run_python

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
