"""``jax.distributed.initialize()`` after ``import pallas_guard``: two local CPU processes.

``initialize()`` must come before any backend exists; it succeeding after the guard is imported
and has patched Pallas is the proof that the guard initialises no backend early. Then a guarded
kernel runs in both processes. Everything is bounded in time: JAX's own timeouts, and ours.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from conftest import clean_env

WORKER = """
import json, sys
process_id, port = int(sys.argv[1]), int(sys.argv[2])
import pallas_guard
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from pallas_guard._jax import config as jax_config
early = jax_config.backends_initialized()
patched = bool(getattr(pl.pallas_call, "_self_pallas_guard", False))
kwargs = dict(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
              initialization_timeout=60)
jax.distributed.initialize(**kwargs)
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + process_id
x = jnp.arange(8, dtype=jnp.float32)
y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
print(json.dumps({
    "early": early, "patched": patched, "processes": jax.process_count(), "index": jax.process_index(),
    "devices": jax.device_count(), "y": y.tolist(),
    "decisions": [(d.action, d.interpreter) for d in pallas_guard.decisions()],
}), flush=True)
jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_distributed_initialize_after_import_pallas_guard() -> None:
    env = clean_env({"PALLAS_GUARD_POLICY": "interpret", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": None})
    port = _free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(process_id), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process_id in range(2)
    ]
    outputs = []
    try:
        for worker in workers:
            stdout, stderr = worker.communicate(timeout=180)
            outputs.append((worker.returncode, stdout, stderr))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for process_id, (returncode, stdout, stderr) in enumerate(outputs):
        assert returncode == 0, f"process {process_id}:\n{stderr[-3000:]}"
        report = json.loads(stdout.strip().splitlines()[-1])
        assert report == {
            "early": False,  # the guard was imported and had patched Pallas; still no backend
            "patched": True,
            "processes": 2,
            "index": process_id,
            "devices": 2,
            "y": [2.0 * i + process_id for i in range(8)],
            "decisions": [["interpreted", "plain"]],
        }
