"""Kernels from libraries pallas_guard has never seen, called through their public APIs on this CPU
with no ``interpret=`` anywhere (as a user calls them). Run by ``.ci/run``'s ``thirdparty`` entry,
which installs ``tests/thirdparty/requirements.txt``; skipped where those libraries are missing.

The user's line is the one that calls the library's API (in these scripts, inside a lambda).
Each case runs in a fresh interpreter with ``PALLAS_GUARD_POLICY`` and ``PALLAS_GUARD_DEVICE`` set,
as a user's script would, and nothing else: the libraries' host code asks which TPU it runs on, and
the device setting alone answers. The result is compared with the library's own reference (and
with TPU interpret mode forced by hand), the decisions name the interpreter and the script's own
line, and ``strict`` names it too.

The Mosaic-GPU calls at the end ask the default device (``jax.devices()``), not the abstract one
the device setting provides: they document what is missing (see ``docs/third-party.md``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import clean_env

pytest.importorskip("qwix")
pytest.importorskip("tokamax")

DEVICE = "tpu-v5e"

SETUP = """
import json, sys
import jax, jax.numpy as jnp
import numpy as np
x8 = jax.random.randint(jax.random.PRNGKey(1), (256, 256), -127, 128, jnp.int32).astype(jnp.int8)
y8 = jax.random.randint(jax.random.PRNGKey(2), (256, 256), -127, 128, jnp.int32).astype(jnp.int8)
s = jnp.full((2, 2), 0.01, jnp.float32)
xf = jax.random.normal(jax.random.PRNGKey(6), (256, 256), jnp.float32)

def forced_tpu(run):
    from jax.experimental.pallas import tpu as pltpu
    import pallas_guard
    # By hand, as without the guard: the abstract TPU device written out, as JAX's error tells one to.
    tpu = jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")
    with pallas_guard.policy("off"), pltpu.force_tpu_interpret_mode(), jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((), (), (), abstract_device=tpu)):
        return run()
"""

CASES = {
    "qwix.quantized_matmul": """
from qwix.contrib.kernels import quantized_matmul as qmm
run = lambda: qmm.quantized_matmul(x8, s, y8, s, bm=128, bk=128, bn=128, dtype=jnp.float32)  # THE-USERS-LINE
got = run()
want = forced_tpu(run)
reference = (x8.astype(jnp.float32) * 0.01) @ (y8.astype(jnp.float32) * 0.01)
""",
    "qwix.lhs_fused_quantized_matmul": """
from qwix.contrib.kernels import lhs_fused_quantized_matmul as lfq
run = lambda: lfq.lhs_fused_quantized_matmul(xf, y8, s, bm=128, bk=128, bn=128, sm=2)  # THE-USERS-LINE
got = run()
want = forced_tpu(run)
reference = None  # x is quantised inside the kernel: the hand-forced run is the reference
""",
    # Its kernel reads TPU info (VMEM, cores, generation) and pipelines with pltpu.emit_pipeline.
    "tokamax.linear_softmax_cross_entropy_loss": """
import tokamax
xa = jax.random.normal(jax.random.PRNGKey(3), (128, 256), jnp.float32)
w = jax.random.normal(jax.random.PRNGKey(4), (256, 512), jnp.float32) * 0.05
labels = jax.random.randint(jax.random.PRNGKey(5), (128,), 0, 512)
lsce = tokamax.linear_softmax_cross_entropy_loss
loss = lambda impl: lsce(xa, labels, w, reduction="mean", implementation=impl)  # THE-USERS-LINE
with tokamax.config.cross_compile(True):
    got = loss("mosaic_tpu")
    want = forced_tpu(lambda: loss("mosaic_tpu"))
    reference = loss("xla")
""",
    "tokamax.dot_product_attention (Pallas-Triton, backward)": """
import tokamax
q, k, v = (jax.random.normal(key, (1, 128, 2, 64), jnp.float32) for key in jax.random.split(jax.random.PRNGKey(0), 3))
attention = tokamax.dot_product_attention
loss = lambda impl: (lambda q, k, v: jnp.sum(attention(q, k, v, is_causal=True, implementation=impl)))  # THE-USERS-LINE
with tokamax.config.cross_compile(True):
    got = jax.grad(loss("triton"), argnums=(0, 1, 2))(q, k, v)
    want = None
    reference = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
""",
}


class GpuCase(NamedTuple):
    source: str
    refusal: str
    """What the library's host code raises on a CPU, whatever device the guard presents."""
    missing: str
    """Why: what it asks, and what fails when that is answered by hand (docs/third-party.md)."""
    module: str = ""
    """A module the case needs beyond this entry's requirements (skipped without it)."""


# Mosaic-GPU kernels whose host code asks the default device (never the abstract one) which GPU it is.
# Run with an H100 set (tokamax refuses a B200 the same way: docs/third-party.md).
GPU_DEVICE = "h100"
GPU_CASES = {
    "tokamax.dot_product_attention (Mosaic GPU)": GpuCase(
        """
import tokamax
keys = jax.random.split(jax.random.PRNGKey(0), 3)
q, k, v = (jax.random.normal(key, (1, 128, 2, 64), jnp.bfloat16) for key in keys)
attention = lambda impl: tokamax.dot_product_attention(q, k, v, implementation=impl)  # THE-USERS-LINE
with tokamax.config.cross_compile(True):
    got = attention("mosaic_gpu")
    want = None
    reference = attention("xla")
""",
        "Only supported for sm80, sm90 and sm100 GPUs.",
        "tokamax 0.0.17 picks its Mosaic-GPU attention kernel by `backend.get_default_device()`'s platform "
        "and `compute_capability`, never the abstract device, and refuses on a CPU ('Only supported for sm80, "
        "sm90 and sm100 GPUs.'); patched past that (an experiment), it reads that device's `core_count`, and "
        "then the Mosaic-GPU interpreter lacks `inline_mgpu`, which its kernels call",
    ),
    "tokamax.ragged_dot (Mosaic GPU)": GpuCase(
        """
import tokamax
lhs = jax.random.normal(jax.random.PRNGKey(0), (256, 128), jnp.bfloat16)
rhs = jax.random.normal(jax.random.PRNGKey(1), (4, 128, 128), jnp.bfloat16)
sizes = jnp.array([64, 64, 64, 64], jnp.int32)
with tokamax.config.cross_compile(True):
    got = tokamax.ragged_dot(lhs, rhs, sizes, implementation="mosaic_gpu")  # THE-USERS-LINE
want = None
reference = jax.lax.ragged_dot(lhs, rhs, sizes)
""",
        "Unsupported GPU architecture.",
        "tokamax 0.0.17 picks its Mosaic-GPU ragged_dot config by `backend.get_default_device()`'s platform "
        "and `compute_capability`, never the abstract device, and refuses on a CPU ('Unsupported GPU "
        "architecture.'); patched past that (an experiment), its sm90 kernel runs in the Mosaic-GPU "
        "interpreter and matches, and its sm100 one calls `inline_mgpu`, which the interpreter lacks",
    ),
    "jax-linear-attention ragged_dot (Mosaic GPU)": GpuCase(
        """
from jla.ops.mosaic_gpu import ragged_dot as jla_ragged_dot
lhs = jax.random.normal(jax.random.PRNGKey(0), (256, 128), jnp.bfloat16)
rhs = jax.random.normal(jax.random.PRNGKey(1), (4, 128, 128), jnp.bfloat16)
sizes = jnp.array([64, 64, 64, 64], jnp.int32)
got = jla_ragged_dot.ragged_dot(lhs, rhs, sizes)  # THE-USERS-LINE
want = None
reference = jax.lax.ragged_dot(lhs, rhs, sizes)
""",
        "it needs an H100",
        "jax-linear-attention 0.1.0 asks `jax.devices()[0]` for platform 'gpu' and compute capability '9.0', "
        "never the abstract device, and refuses on a CPU ('... on cpu: it needs an H100, ...'); patched past "
        "that (an experiment), the Mosaic-GPU interpreter rejects its kernel ('Scoped allocations in "
        "MemorySpace.REGS cannot be mixed with scoped allocations in other memory spaces.')",
        module="jla",
    ),
}

REPORT = """
import pallas_guard
def error(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return None if b is None else max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)
print("REPORT " + json.dumps({
    "vs_reference": error(got, reference), "vs_forced_tpu": error(got, want),
    "decisions": [[d.action, d.interpreter, d.kernel, d.defined_at, d.called_at, d.via, list(d.tried)]
                  for d in pallas_guard.decisions() if d.action != "untouched"],
}))
"""


def _run(
    case: str, policy: str, tmp_path: Path, *, around: str = "", device: str = DEVICE
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The case (a name in ``CASES`` or ``GPU_CASES``) as a user's script, under ``policy`` and
    ``device``; ``around``: a context manager expression the runner (not the script) enters around it."""
    script = tmp_path / "users_script.py"
    source = CASES[case] if case in CASES else GPU_CASES[case].source
    script.write_text(textwrap.dedent(SETUP) + textwrap.dedent(source) + textwrap.dedent(REPORT))
    env = clean_env({"JAX_PLATFORMS": "cpu", "PALLAS_GUARD_POLICY": policy, "PALLAS_GUARD_DEVICE": device})
    # The autoload activates the guard when it is installed; otherwise the script imports it first.
    run = f"runpy.run_path({str(script)!r}, run_name='__main__')"
    command = [
        sys.executable,
        "-c",
        f"import pallas_guard, contextlib, jax, runpy\nwith {around or 'contextlib.nullcontext()'}:\n    {run}",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    return result, script


def _users_line(script: Path) -> str:
    number = next(i for i, line in enumerate(script.read_text().splitlines(), 1) if "THE-USERS-LINE" in line)
    return f"{script}:{number}"


@pytest.mark.parametrize("case", list(CASES))
def test_runs_under_policy_interpret_attributed_to_the_users_line(case: str, tmp_path: Path) -> None:
    result, script = _run(case, "interpret", tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    if report["vs_reference"] is not None:
        assert report["vs_reference"] < 1e-3, report
    if report["vs_forced_tpu"] is not None:
        assert report["vs_forced_tpu"] < 1e-5, report
    interpreted = [d for d in report["decisions"] if d[0] == "interpreted"]
    assert interpreted, report
    users = [d for d in interpreted if d[4] == _users_line(script)]
    assert users, (report, _users_line(script))
    for _, _, kernel, defined_at, _, via, _ in users:
        assert defined_at and "site-packages" in defined_at, kernel  # the library's kernel body
        assert via and "site-packages" in via  # the library's line beside the user's
    if "triton" in case.lower():  # the backward kernel reads program_id inside pl.when
        assert any(d[1] == "tpu" and d[6][0].startswith("plain: failed") for d in interpreted), report


TPU_HOST = (
    "jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), (), "
    "abstract_device=jax.sharding.AbstractDevice('TPU v5 lite', 1, 'tpu')))"
)


@pytest.mark.parametrize("case", [c for c in CASES if "Triton" not in c])
def test_strict_names_the_line_of_the_script_that_called_the_library(case: str, tmp_path: Path) -> None:
    # strict leaves the device alone (as on an accelerator), so the runner answers "which TPU?" the
    # way a TPU host would; the script itself still has no abstract mesh.
    result, script = _run(case, "strict", tmp_path, around=TPU_HOST)
    assert result.returncode != 0
    assert "pallas_guard.PallasGuardError" in result.stderr
    assert f"called at {_users_line(script)} (via " in result.stderr, result.stderr[-3000:]


class AsksTheDefaultDevice(Exception):
    """The library refused in its host code: it asked the default device, not the abstract one."""


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=AsksTheDefaultDevice, reason=gpu.missing))
        for name, gpu in GPU_CASES.items()
    ],
)
def test_mosaic_gpu_kernels_with_a_gpu_device_set(case: str, tmp_path: Path) -> None:
    """Run in the Mosaic-GPU interpreter and match the reference, or refuse in the library's own host
    code for the stated reason (any other failure fails the test)."""
    gpu = GPU_CASES[case]
    if gpu.module:
        pytest.importorskip(gpu.module)
    result, script = _run(case, "interpret", tmp_path, device=GPU_DEVICE)
    if gpu.refusal in result.stderr:
        raise AsksTheDefaultDevice(result.stderr[-2000:])
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["vs_reference"] < 0.1, report  # bfloat16 operands
    assert any(d[0] == "interpreted" and d[1] == "gpu" for d in report["decisions"]), report
    assert any(d[4] == _users_line(script) for d in report["decisions"]), report
