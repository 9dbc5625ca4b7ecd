"""The sharded corpus (``tests/sharded_corpus.py``) replayed under the guard against libtpu's record.

Each whole program was compiled by libtpu for a deviceless topology of its devices, the guard not
installed (``tests/data/sharded_verdicts.json``). Here each runs on as many CPU devices, under
``checks=compile,bounds,races`` with its generation as the device setting: the guard compiles each
kernel on its own, inside a ``shard_map`` over a topology of the mesh's size. A case the compiler
refused is the compile check's finding, of the refusal's type and with its first line; a case it
compiled runs interpreted to the value it computes, with the VMEM figure the record has. Needs
libtpu (``.ci/run tpu``). The one-device v5e cases were also run on a real TPU v5e
(``tests/data/sharded_on_a_v5e.json``): the record's verdicts are the chip's.
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
        generation = sharded_corpus.by_name()[name].generation
        # One device is one chip: the kernel is compiled alone (no mesh to name).
        where = f" ({expected['topology']}, per shard of a mesh x={devices})" if devices > 1 else ""
        if expected["verdict"] == "refused":
            assert "refused" in got, f"{label}: libtpu refuses it, the guard ran it: {got}"
            assert expected["error_type"] in got["types"], f"{label}: {got['types']}"
            said = " ".join(got["refused"].split())  # the finding keeps the refusal's own line breaks
            assert " ".join(expected["first_line"].split())[:80] in said, f"{label}: {said[:600]}"
            assert f"for {generation}{where} (" in got["refused"], f"{label}: {got['refused'][:600]}"
            continue
        assert expected["verdict"] == "compiles", f"{label}: {expected}"
        assert got.get("right") is True, f"{label}: libtpu compiles it; the guard: {got}"
        (note,) = got["notes"]
        heading = f"compile: compiles for {generation}{where}: "
        assert note.startswith(heading), f"{label}: {note}"
        assert ["VMEM", expected["vmem_used"], expected["vmem_limit"]] in got["memory"], f"{label}: {got['memory']}"


def test_the_record_covers_every_case_and_each_verdict_kind() -> None:
    """What the replay compares with: one verdict per case, refusals of three kinds among them."""
    recorded = sharded_corpus.recorded()
    assert sorted(recorded) == sorted(sharded_corpus.by_name())
    refused = {v["error_type"] for v in recorded.values() if v["verdict"] == "refused"}
    assert refused == {"JaxRuntimeError", "MosaicError"}
    assert sum(v["verdict"] == "compiles" for v in recorded.values()) >= 10


def test_on_one_chip_the_deviceless_record_is_the_real_tpus_verdict() -> None:
    """The one-device v5e cases, run on a real TPU v5e with JAX alone (``--on-chip``): what libtpu
    said on this CPU is what the chip said, and what it ran it computed rightly."""
    chip, deviceless = sharded_corpus.on_chip(), sharded_corpus.recorded()
    one_chip = [c.name for c in sharded_corpus.CASES if c.devices == 1 and c.generation == "tpu-v5e"]
    assert sorted(chip) == sorted(one_chip) and len(one_chip) >= 6
    for name in one_chip:
        on_the_chip, here = chip[name], deviceless[name]
        if on_the_chip["verdict"] == "ran":
            assert on_the_chip["right"] is True, name
            assert here["verdict"] == "compiles", name
            continue
        assert here["verdict"] == "refused", name
        assert here["error_type"] == on_the_chip["error_type"], name
        # The same refusal, up to the HLO instruction's name ("%body.1" on the chip's program).
        assert here["first_line"].split(" for %")[0][:120] == on_the_chip["first_line"].split(" for %")[0][:120], name
