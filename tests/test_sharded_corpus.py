"""The sharded corpus (``tests/sharded_corpus.py``) replayed under the guard against libtpu's record.

Each whole program was compiled by libtpu for a deviceless topology of its devices, the guard not
installed (``tests/data/sharded_verdicts.json``). Here each runs on as many CPU devices, under
``checks=compile,bounds,races`` with its generation as the device setting: the guard compiles each
kernel on its own, inside a ``shard_map`` over a topology of the mesh's size. A case the compiler
refused is the compile check's finding, of the refusal's type and with its first line; a case it
compiled runs interpreted to the value it computes, with the VMEM figure the record has. Needs
libtpu (``.ci/run tpu``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sharded_corpus
from conftest import run_python

from pallas_guard._running import tpu_compile as _tpu_compile

needs_libtpu = pytest.mark.skipif(_tpu_compile.available() is not None, reason=str(_tpu_compile.available()))

REPLAY = """
import json, sys
import numpy as np
import jax
import pallas_guard
from jax.sharding import Mesh
import sharded_corpus

mesh = Mesh(np.array(jax.devices()), ("x",))
report = {}
for case in sharded_corpus.CASES:
    if case.devices != jax.device_count():
        continue
    pallas_guard.clear_decisions()
    inputs = case.inputs(case.devices)
    outcome = {}
    with pallas_guard.policy(checks="compile,bounds,races", device=case.generation):
        try:
            out = np.asarray(case.program(mesh)(*inputs))
            outcome["right"] = bool(np.array_equal(out, case.reference(inputs, case.devices)))
        except pallas_guard.PallasGuardError as error:
            outcome["refused"] = str(error)
            outcome["types"] = [cls.__name__ for cls in type(error).__mro__]
    decisions = pallas_guard.decisions()
    outcome["notes"] = [n for d in decisions for n in d.notes if n.startswith("compile")]
    outcome["memory"] = [[m.space, m.used, m.limit] for d in decisions for m in d.memory]
    report[case.name] = outcome
print(json.dumps(report))
"""


def _replayed(devices: int) -> dict[str, Any]:
    result = run_python(
        REPLAY,
        env={
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu",
            "PALLAS_GUARD_POLICY": "interpret",
        },
        cwd=Path(__file__).resolve().parent,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    replayed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return replayed


@needs_libtpu
@pytest.mark.parametrize("devices", sorted({case.devices for case in sharded_corpus.CASES}))
def test_the_guard_gives_libtpus_verdict_on_every_sharded_program(devices: int) -> None:
    recorded = sharded_corpus.recorded()
    replayed = _replayed(devices)
    names = [case.name for case in sharded_corpus.CASES if case.devices == devices]
    assert sorted(replayed) == sorted(names)
    for name in names:
        expected, got = recorded[name], replayed[name]
        label = f"{name} ({expected['topology']})"
        if expected["verdict"] == "refused":
            assert "refused" in got, f"{label}: libtpu refuses it, the guard ran it: {got}"
            assert expected["error_type"] in got["types"], f"{label}: {got['types']}"
            said = " ".join(got["refused"].split())  # the finding keeps the refusal's own line breaks
            assert " ".join(expected["first_line"].split())[:80] in said, f"{label}: {said[:600]}"
            assert f"{expected['topology']}, per shard of a mesh x={devices}" in got["refused"]
            continue
        assert expected["verdict"] == "compiles", f"{label}: {expected}"
        assert got.get("right") is True, f"{label}: libtpu compiles it; the guard: {got}"
        (note,) = got["notes"]
        generation = sharded_corpus.by_name()[name].generation
        heading = f"compile: compiles for {generation} ({expected['topology']}, per shard of a mesh x={devices}): "
        assert note.startswith(heading), f"{label}: {note}"
        assert ["VMEM", expected["vmem_used"], expected["vmem_limit"]] in got["memory"], f"{label}: {got['memory']}"


def test_the_record_covers_every_case_and_each_verdict_kind() -> None:
    """What the replay compares with: one verdict per case, refusals of three kinds among them."""
    recorded = sharded_corpus.recorded()
    assert sorted(recorded) == sorted(sharded_corpus.by_name())
    refused = {v["error_type"] for v in recorded.values() if v["verdict"] == "refused"}
    assert refused == {"JaxRuntimeError", "MosaicError"}
    assert sum(v["verdict"] == "compiles" for v in recorded.values()) >= 10
