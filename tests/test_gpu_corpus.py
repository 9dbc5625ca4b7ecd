"""The GPU corpus (``tests/gpu_corpus.py``) replayed under the guard against XLA's own record.

Each case was compiled for an H100 and an A100 without the guard, the way the GPU's own
``jax.jit(f).lower(x).compile()`` does with operands on a described device
(``tests/data/gpu_verdicts.json``). Here each is lowered under ``checks=compile`` with that GPU as
the device setting, in a process armed as a user's is: the guard exports the kernel and compiles
it in its own child process. A case
the record refused is the compile check's finding, of the refusal's type, at the same step, with
the record's line; a case it compiled is silent, with the figures XLA's dump and ptxas -v gave the
record. Needs the ``gpu`` extra (``.ci/run gpu``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gpu_corpus
import pytest
from conftest import run_python

from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._running import gpu_compile

MISSING = gpu_compile.available()
RECORDED_WITH = gpu_corpus.recorded_with()
# The record is one compiler's: another jax's Triton, Mosaic GPU or ptxas may spend other registers.
OTHER_COMPILER = f"recorded with jax {RECORDED_WITH.get('jax')}; record again: python tests/gpu_corpus.py --record"
needs_the_compiler = pytest.mark.skipif(MISSING is not None, reason=f"no GPU compiler here: {MISSING}")
needs_the_recorded_compiler = pytest.mark.skipif(
    MISSING is None and RECORDED_WITH.get("jax") != jax_lookup.jax_version(), reason=OTHER_COMPILER
)
CASES = {case.name: case for case in gpu_corpus.CASES}


REPLAY = """
import json, sys
import jax
import pallas_guard
from pallas_guard import PallasGuardError
import gpu_corpus

gpu = sys.argv[1]
report = {}
for case in gpu_corpus.CASES:
    pallas_guard.clear_decisions()
    with pallas_guard.policy(checks="compile", device=gpu):
        try:
            # Traced and lowered, not run: the compile check gives its verdict as the kernel is traced.
            jax.jit(case.program).lower(*gpu_corpus.avals(case))
        except PallasGuardError as finding:
            text = str(finding)
            step = "lowering" if "JAX's lowering for CUDA (before XLA's GPU compiler)" in text else "compile"
            types = [cls.__name__ for cls in type(finding).__mro__]
            report[case.name] = {"verdict": "refused", "step": step, "types": types, "text": text}
            continue
    decisions = pallas_guard.decisions()
    figures = {use.space: use.used for d in decisions for use in d.memory if use.generation == gpu}
    notes = [note for d in decisions for note in d.notes if note.startswith("compile:")]
    report[case.name] = {"verdict": "compiles", "figures": figures, "notes": notes}
print(json.dumps(report))
"""


def _mismatches(recorded: dict[str, Any], replayed: dict[str, Any], gpu: str) -> list[str]:
    """How the guard's verdict or figures differ from the record's for one case and GPU."""
    if replayed["verdict"] != recorded["verdict"]:
        return [f"verdict {replayed['verdict']} (recorded {recorded['verdict']}): {replayed.get('text', '')[:300]}"]
    if recorded["verdict"] == "refused":
        expected_type = "GpuCompilerError" if recorded["type"] == "fatal error" else recorded["type"]
        wrong = (
            [f"step {replayed['step']} (recorded {recorded['step']})"] if replayed["step"] != recorded["step"] else []
        )
        if expected_type not in replayed["types"] or "PallasGuardError" not in replayed["types"]:
            wrong.append(f"types {replayed['types']} (recorded {recorded['type']})")
        if recorded["line"].split(", context:")[0] not in replayed["text"]:
            wrong.append(f"no {recorded['line']!r} in {replayed['text'][:300]!r}")
        return wrong
    notes = replayed["notes"]
    wrong = [] if len(notes) == 1 and notes[0].startswith(f"compile: compiles for {gpu}") else [f"notes {notes}"]
    figures = replayed["figures"]
    for space, field in (
        ("shared memory", "shared_memory"),
        ("registers", "registers"),
        ("spill stores", "spill_stores"),
    ):
        if figures.get(space, 0 if field == "spill_stores" else None) != recorded[field]:
            wrong.append(f"{space} {figures.get(space)} (recorded {recorded[field]})")
    return wrong


@needs_the_compiler
@needs_the_recorded_compiler
@pytest.mark.parametrize("gpu", gpu_corpus.GPUS)
def test_the_guard_gives_xlas_verdict_and_figures_on_every_case(gpu: str, tmp_path: Path) -> None:
    # A user's process: the guard armed from the environment, compiles not read from earlier runs.
    env = {"JAX_PLATFORMS": "cpu", "PALLAS_GUARD_POLICY": "interpret", "XDG_CACHE_HOME": str(tmp_path)}
    result = run_python(
        REPLAY.replace("sys.argv[1]", repr(gpu)), env=env, cwd=Path(__file__).resolve().parent, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    replayed = json.loads(result.stdout.strip().splitlines()[-1])
    recorded = gpu_corpus.recorded()
    assert sorted(replayed) == sorted(recorded)
    wrong = {name: _mismatches(recorded[name][gpu], replayed[name], gpu) for name in recorded}
    assert not {name: why for name, why in wrong.items() if why}


def test_the_record_has_every_kind_of_refusal_and_both_verdicts_per_gpu() -> None:
    recorded = gpu_corpus.recorded()
    assert sorted(recorded) == sorted(CASES)
    refusals = [entry for case in recorded.values() for entry in case.values() if entry["verdict"] == "refused"]
    lines = " | ".join(entry["line"] for entry in refusals)
    for kind in (
        "Shared memory size limit exceeded",  # a block's shared memory, XLA's compile
        "only supported on compute capability >= 89",  # float8 on an A100: the compiler's process ends
        "Pass pipeline failed",  # Mosaic GPU's Hopper instructions on an A100
        "Mosaic GPU kernel exceeds available shared memory",  # Mosaic GPU's own check, at lowering
        "size is a power of 2",  # Triton's lowering, before XLA
    ):
        assert kind in lines, kind
    assert any(entry["type"] == "fatal error" for entry in refusals)
    for gpu in gpu_corpus.GPUS:
        verdicts = {case[gpu]["verdict"] for case in recorded.values()}
        assert verdicts == {"compiles", "refused"}
    # Verdicts that differ between the two GPUs: what the device setting's list is for.
    assert sum(case["h100"]["verdict"] != case["a100"]["verdict"] for case in recorded.values()) >= 4
    assert any(case[gpu].get("spill_stores") for case in recorded.values() for gpu in gpu_corpus.GPUS)
