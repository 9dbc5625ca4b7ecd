"""Kernels from libraries pallas_guard has never seen, called through their public APIs on this CPU
with no ``interpret=`` anywhere (as a user calls them). Run by ``.ci/run``'s ``thirdparty`` entry,
which installs ``tests/thirdparty/requirements.txt``; skipped where those libraries are missing.

The user's line is the one that calls the library's API (in these scripts, inside a lambda).
Each case runs in a fresh interpreter with ``PALLAS_GUARD_POLICY`` set, as a user's script would:
the result is compared with the library's own reference (and with TPU interpret mode forced by
hand), the decisions name the interpreter and the script's own line, and ``strict`` names it too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import clean_env

pytest.importorskip("qwix")
pytest.importorskip("tokamax")

SETUP = """
import json, sys
import jax, jax.numpy as jnp
import numpy as np
# The libraries' host code asks "which TPU?"; on a CPU this abstract TPU device answers.
tpu = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
    (), (), (), abstract_device=jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu")))
x8 = jax.random.randint(jax.random.PRNGKey(1), (256, 256), -127, 128, jnp.int32).astype(jnp.int8)
y8 = jax.random.randint(jax.random.PRNGKey(2), (256, 256), -127, 128, jnp.int32).astype(jnp.int8)
s = jnp.full((2, 2), 0.01, jnp.float32)
xf = jax.random.normal(jax.random.PRNGKey(6), (256, 256), jnp.float32)

def forced_tpu(run):
    from jax.experimental.pallas import tpu as pltpu
    import pallas_guard
    with pallas_guard.policy("off"), pltpu.force_tpu_interpret_mode():
        return run()
"""

CASES = {
    "qwix.quantized_matmul": """
from qwix.contrib.kernels import quantized_matmul as qmm
run = lambda: qmm.quantized_matmul(x8, s, y8, s, bm=128, bk=128, bn=128, dtype=jnp.float32)  # THE-USERS-LINE
with tpu:
    got = run()
    want = forced_tpu(run)
reference = (x8.astype(jnp.float32) * 0.01) @ (y8.astype(jnp.float32) * 0.01)
""",
    "qwix.lhs_fused_quantized_matmul": """
from qwix.contrib.kernels import lhs_fused_quantized_matmul as lfq
run = lambda: lfq.lhs_fused_quantized_matmul(xf, y8, s, bm=128, bk=128, bn=128, sm=2)  # THE-USERS-LINE
with tpu:
    got = run()
    want = forced_tpu(run)
reference = None  # x is quantised inside the kernel: the hand-forced run is the reference
""",
    "tokamax.linear_softmax_cross_entropy_loss": """
import tokamax
xa = jax.random.normal(jax.random.PRNGKey(3), (128, 256), jnp.float32)
w = jax.random.normal(jax.random.PRNGKey(4), (256, 512), jnp.float32) * 0.05
labels = jax.random.randint(jax.random.PRNGKey(5), (128,), 0, 512)
lsce = tokamax.linear_softmax_cross_entropy_loss
loss = lambda impl: lsce(xa, labels, w, reduction="mean", implementation=impl)  # THE-USERS-LINE
with tokamax.config.cross_compile(True), tpu:
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


def _run(case: str, policy: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "users_script.py"
    script.write_text(textwrap.dedent(SETUP) + textwrap.dedent(CASES[case]) + textwrap.dedent(REPORT))
    env = clean_env({"JAX_PLATFORMS": "cpu", "PALLAS_GUARD_POLICY": policy})
    # The autoload activates the guard when it is installed; otherwise the script imports it first.
    command = [
        sys.executable,
        "-c",
        f"import pallas_guard, runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
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


@pytest.mark.parametrize("case", [c for c in CASES if "Triton" not in c])
def test_strict_names_the_line_of_the_script_that_called_the_library(case: str, tmp_path: Path) -> None:
    result, script = _run(case, "strict", tmp_path)
    assert result.returncode != 0
    assert "pallas_guard.PallasGuardError" in result.stderr
    assert f"called at {_users_line(script)} (via " in result.stderr, result.stderr[-3000:]
