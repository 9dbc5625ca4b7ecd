"""The harness that runs JAX's own TPU Pallas tests on a CPU under pallas_guard (tests/jax_suite/run.py).

run.py extracts JAX's test files (and two test helpers the jax wheel lacks) into a temporary
directory and copies this file there as its conftest.py; it sets ``JAX_SUITE_UNDER_GUARD`` to
that directory. Without the variable (in this repository's own suite, which collects tests/)
this file does nothing.

What it does there:

- registers ``jax._src.pallas.pallas_test_util`` and ``jax._src.hypothesis_test_util`` from the
  extracted helpers (JAX's tests import them; the wheel does not ship them);
- makes JAX's test utilities see a TPU v5e where the test asks for one: ``device_under_test()``
  is ``"tpu"`` (``test_device_matches(["tpu"])``, ``is_device_tpu(5, "e")``,
  ``get_tpu_version() == 5``), so the TPU tests run their kernels, which the guard interprets.
  Test classes with ``INTERPRET = True`` (JAX's own interpret-mode variants) keep the CPU they
  run on: they pass ``interpret=True`` themselves and skip off a CPU;
- appends every finding the guard records during a test (a decision of action ``found``), as one
  JSON line with the test's id, to ``JAX_SUITE_UNDER_GUARD_FINDINGS`` (default:
  ``findings-CHECKS.jsonl`` in that directory): a finding that the test itself catches
  (``assertRaises``) leaves no failure behind, and is still counted;
- appends each test's start and each phase's outcome, as JSON lines, to
  ``JAX_SUITE_UNDER_GUARD_RESULTS`` (flushed as they happen: a test that aborts the process is
  the last one started), and deselects the test ids listed in ``JAX_SUITE_UNDER_GUARD_DONE``
  (run.py's resumption after such an abort).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SUITE_DIR = os.environ.get("JAX_SUITE_UNDER_GUARD")
FINDINGS = os.environ.get("JAX_SUITE_UNDER_GUARD_FINDINGS") or (
    os.path.join(SUITE_DIR, f"findings-{os.environ.get('PALLAS_GUARD_CHECKS', 'none')}.jsonl") if SUITE_DIR else None
)
HELPERS = {
    "jax._src.pallas.pallas_test_util": "pallas_test_util.py",
    "jax._src.hypothesis_test_util": "hypothesis_test_util.py",
}
TPU_VERSION = 5
TPU_DEVICE_KIND = "TPU v5 lite"  # what jax reports for a v5e

RESULTS = os.environ.get("JAX_SUITE_UNDER_GUARD_RESULTS")
DONE = os.environ.get("JAX_SUITE_UNDER_GUARD_DONE")

_device = {"platform": "tpu"}


def _append(path: str, row: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def _register_helpers(directory: Path) -> None:
    for name, filename in HELPERS.items():
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, directory / "_helpers" / filename)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        parent, _, child = name.rpartition(".")
        setattr(importlib.import_module(parent), child, module)


def _present_a_tpu() -> None:
    from jax._src import test_util as jtu

    def device_under_test() -> str:
        return _device["platform"]

    def get_tpu_version() -> int:
        if _device["platform"] != "tpu":
            raise ValueError("Device is not TPU")
        return TPU_VERSION

    def is_device_tpu(version: int | None = None, variant: str = "") -> bool:
        if _device["platform"] != "tpu":
            return False
        if version is None:
            return True
        return (version, variant) in ((5, "e"), (5, "lite"))

    def device_kind_match(device_patterns: Any) -> str | None:
        if _device["platform"] != "tpu":
            return original_device_kind_match(device_patterns)
        return jtu.pattern_search(device_patterns, TPU_DEVICE_KIND)

    original_device_kind_match = jtu.device_kind_match
    jtu.device_under_test = device_under_test
    jtu.get_tpu_version = get_tpu_version
    jtu.is_device_tpu = is_device_tpu
    jtu.device_kind_match = device_kind_match


if SUITE_DIR:
    _register_helpers(Path(SUITE_DIR))
    _present_a_tpu()

    @pytest.fixture(autouse=True)
    def _jax_suite_device(request: pytest.FixtureRequest) -> Iterator[None]:
        """A TPU for JAX's TPU tests; the CPU for its interpret-mode classes (``INTERPRET = True``)."""
        import pallas_guard

        interpret = bool(getattr(request.cls, "INTERPRET", False))
        _device["platform"] = "cpu" if interpret else "tpu"
        before = {id(decision) for decision in pallas_guard.decisions()}
        yield
        _device["platform"] = "tpu"
        found = [d for d in pallas_guard.decisions() if d.action == "found" and id(d) not in before]
        for decision in found if FINDINGS else ():
            row = {"test": request.node.nodeid, "check": decision.check, "kernel": decision.kernel}
            _append(FINDINGS, row | {"called_at": decision.called_at, "reason": decision.reason})

    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        if not DONE or not os.path.exists(DONE):
            return
        with open(DONE, encoding="utf-8") as lines:
            done = {line.strip() for line in lines}
        keep = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = keep

    def pytest_runtest_logstart(nodeid: str, location: object) -> None:
        if RESULTS:
            _append(RESULTS, {"test": nodeid, "when": "start"})

    def pytest_runtest_logreport(report: pytest.TestReport) -> None:
        if RESULTS and (report.when == "call" or report.outcome != "passed"):
            message = report.longreprtext[-6000:] if report.failed else ""
            _append(
                RESULTS, {"test": report.nodeid, "when": report.when, "outcome": report.outcome, "message": message}
            )
