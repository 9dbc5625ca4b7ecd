"""``checks=all`` replayed on every corpus: no finding on a kernel that is right, a
``PallasGuardError`` on one that is not; and ``all,agree`` (``all`` leaves ``agree`` out for its
cost, not for a false finding) on every kernel ``agree`` compares, which must give no finding either.

- the TPU-recorded corpus (``tpu_corpus``, ``data/tpu_v5e_records.json``): what a real TPU v5e ran
  gives no finding; what it refused while lowering (and, with libtpu here, while compiling) or
  halted on is a finding;
- the race corpus: a valid kernel gives no finding, a racy one is a finding;
- JAX's shipped kernels (``ops_corpus``): no finding, and the reference's values.

Each with the device set to the generation the records were made on, ``tpu-v5e``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jax
import pytest
import race_corpus
import tpu_corpus
from ops_corpus import Case, cases, check

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._running import tpu_compile as _tpu_compile

RECORDS = json.loads((Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json").read_text())["cases"]
COMPILER = _tpu_compile.available() is None


def _findings() -> list[str]:
    return [f"{d.check}: {d.kernel}" for d in pallas_guard.decisions() if d.action == "found"]


def _under_each(items: list[Any], compared: Any, name: Any) -> list[Any]:
    """Each item under ``all``, and under ``all,agree`` where ``agree`` has something to compare:
    a kernel that runs cleanly (a refusal or a race is ``all``'s own checks' to find) in more than
    one interpreter (only plain runs a Triton kernel on a CPU)."""
    params = []
    for item in items:
        params.append(pytest.param("all", item, id=f"{name(item)}-all"))
        if compared(item):
            params.append(pytest.param("all,agree", item, id=f"{name(item)}-all,agree"))
    return params


def _under(checks: str, run: Any, device: str | None = "tpu-v5e") -> BaseException | None:
    """``run()`` under ``checks``: the error it raised, or None."""
    pallas_guard.install("interpret", checks=checks, device=device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.block_until_ready(run())
    except Exception as error:  # the outcome is what is compared
        return error
    return None


@pytest.fixture(autouse=True)
def _uninstalled() -> Any:
    yield
    pallas_guard.uninstall()


def _tpu_refuses(name: str) -> bool:
    """Whether a real TPU refused or halted on the case, at a gate the guard reaches here."""
    phase = RECORDS[name]["phase"]
    return phase in ("lower", "run") or (phase == "compile" and COMPILER)


@pytest.mark.parametrize(
    ("checks", "name"),
    _under_each(
        [case.name for case in tpu_corpus.cases() if case.interpretable is None and case.name in RECORDS],
        lambda name: not _tpu_refuses(name),
        str,
    ),
)
def test_the_tpu_corpus_under_all_finds_what_the_tpu_refused_and_nothing_else(name: str, checks: str) -> None:
    case = tpu_corpus.by_name(name)
    raised = _under(checks, lambda: case.build()(*case.inputs()))
    if _tpu_refuses(name):
        assert isinstance(raised, PallasGuardError), (
            f"{name}: the TPU refused it ({RECORDS[name]['phase']}): {raised!r}"
        )
    else:
        assert raised is None, f"{name}: the TPU ran it: {raised!r}"
        assert not _findings()


@pytest.mark.parametrize(
    ("checks", "case"),
    _under_each(
        [case for case in race_corpus.CASES if not case.detector.startswith("error")],
        lambda case: case.kind is None,
        lambda case: case.name,
    ),
)
def test_the_race_corpus_under_all_finds_each_race_and_nothing_else(case: Any, checks: str) -> None:
    """(A case no interpreter runs, whose detector verdict is an error, is left out.)"""
    if jax_lookup.jax_release() < case.min_jax:
        pytest.skip(f"needs jax >= {case.min_jax}")
    fn, args = case.build(None)
    raised = _under(checks, lambda: fn(*args))
    if case.kind is None:
        assert raised is None, f"{case.name}: a valid kernel: {raised!r}"
        assert not _findings()
    else:
        assert isinstance(raised, PallasGuardError), f"{case.name}: {case.kind}: {raised!r}"


def _runnable(case: Case) -> bool:
    return not case.xfail and case.devices <= len(jax.devices("cpu")) and case.skip_reason() is None


@pytest.mark.parametrize(
    ("checks", "case"),
    _under_each([case for case in cases() if _runnable(case)], lambda case: case.family != "triton", lambda c: c.name),
)
def test_jaxs_shipped_kernels_under_all_give_no_finding_and_the_references_values(case: Case, checks: str) -> None:
    results: list[Any] = []
    raised = _under(checks, lambda: results.append(case.run()) or results[-1], device=case.device)
    assert raised is None, f"{case.name}: {raised!r}"
    assert not _findings()
    check(case, results[-1])
