"""JAX's shipped Pallas kernels, called as on a GPU/TPU (no ``interpret=``), run on this CPU.

Each case in ``ops_corpus`` must match its ``jax.numpy`` reference under the guard, with the
interpreter the guard is expected to choose (with the case's ``device`` set, where its host code asks
which GPU/TPU it runs on). ``xfail(strict=True)`` marks only kernels no interpreter can run on the
CPU, so a JAX that fixes one shows up as an unexpected pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import numpy as np
import pytest
from conftest import run_python
from ops_corpus import Case, cases, check

import pallas_guard


def _param(case: Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


def _interpreters_used() -> set[str | None]:
    return {d.interpreter for d in pallas_guard.decisions() if d.action == "interpreted"}


# A multi-device case runs in a fresh interpreter with forced host devices (the device count is
# fixed when the CPU backend starts).
_SUBPROCESS = """
import json, jax, pallas_guard
from ops_corpus import by_name, check
case = by_name({name!r})
pallas_guard.install("interpret", device=case.device)
check(case, jax.block_until_ready(case.run()))
print(json.dumps(sorted({{d.interpreter for d in pallas_guard.decisions() if d.action == "interpreted"}})))
"""


@pytest.mark.parametrize("case", [_param(case) for case in cases()])
def test_shipped_kernel_runs_on_cpu_under_the_guard(case: Case, guard: Callable[..., None]) -> None:
    skip = case.skip_reason()
    if skip:
        pytest.skip(skip)
    if case.devices > len(jax.devices("cpu")):
        tests_dir = str(__import__("pathlib").Path(__file__).parent)
        result = run_python(
            _SUBPROCESS.format(name=case.name),
            env={
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={case.devices}",
                "PYTHONPATH": tests_dir,
            },
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == [case.expected]
        return
    guard("interpret", device=case.device)
    jax.clear_caches()  # a kernel compiled by an earlier test would not reach the guard again
    result = jax.block_until_ready(case.run())
    check(case, result)
    assert _interpreters_used() == {case.expected}


# One or two of each family and of each way of addressing memory (block specs, loops over pl.ds,
# scalar prefetch, DMAs, a Mosaic-GPU kernel in its own interpreter): the whole corpus is compared
# bit for bit by benchmark row 4b.
BOUNDS_CASES = frozenset(
    {
        "gpu.softmax",
        "gpu.attention.mha",
        "tpu.flash_attention",
        "tpu.megablox.gmm",
        "tpu.paged_attention",
        "gpu.ragged_dot_mgpu",
    }
)


@pytest.mark.parametrize(
    "case", [pytest.param(case, id=case.name) for case in cases() if not case.xfail and case.name in BOUNDS_CASES]
)
def test_shipped_kernel_under_the_bounds_check_has_no_finding_and_the_same_bits(
    case: Case, guard: Callable[..., None]
) -> None:
    """JAX's own kernels are in bounds: the check finds nothing and changes no bit of the result
    (each kernel compiled afresh with and without it)."""
    if case.skip_reason() or case.devices > len(jax.devices("cpu")):
        pytest.skip(case.skip_reason() or "needs more CPU devices (checked unchecked in the test above)")
    results = {}
    for checks in ("none", "bounds"):
        guard("interpret", device=case.device, checks=checks)
        jax.clear_caches()
        results[checks] = [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(case.run())]
    check(case, case.run())
    assert results["bounds"] == results["none"]
