"""Row 4h: what the guard computes on this CPU against what a TPU v5e computed, output by output.

Every case of ``tests/tpu_corpus.py`` that ran on the chip (its record in
``tests/data/tpu_v5e_records.json``: status ``done``, phase null) and that a CPU interpreter runs is
called once, eagerly, under the guard (policy ``interpret``, the default interpreter choice, no
checks), as ``tests/test_tpu_compile.py`` replays it. Each output is compared with the TPU's: bit for
bit by its sha256 (every output has one), and, where the record holds the values (outputs of at most
4096 elements), by the largest difference relative to the largest ``|value|`` of the TPU's output.
No time is measured. The verdict is the corpus's own: every output within its case's tolerance
(``Case.tolerance``; None where the two cannot be compared: the interpreters' PRNG is not the
TPU's); a differing output with only a digest recorded has no error to measure and is listed.
The replay and the comparison are also used by rows 4f and 4g (``recorded``, ``compare``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, table  # noqa: E402

RECORDS = BENCH_DIR.parent / "tests" / "data" / "tpu_v5e_records.json"
ROW = "4h. CPU values vs the TPU's"
RECORD_ROUNDING = 1e-8
"""Where a record holds values, floats keep nine significant digits (float32 exactly); as in the
tests, an error up to this much of the largest value is that rounding."""


@functools.cache
def records() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDS.read_text())
    return data


def recorded(*, interpretable: bool = True) -> list[tuple[Any, dict[str, Any]]]:
    """The corpus's cases that ran on the TPU (status done, phase null), with their records, in the
    corpus's order; with ``interpretable``, only those a CPU interpreter runs."""
    import tpu_corpus

    found = []
    for case in tpu_corpus.cases():
        record = records()["cases"].get(case.name)
        if record is None or record.get("status") != "done" or record.get("phase") is not None or case.halts:
            continue
        if interpretable and case.interpretable is not None:
            continue
        found.append((case, record))
    return found


@dataclass(frozen=True)
class Output:
    """One output of one case against the TPU's."""

    case: str
    index: int
    identical: bool
    """The same bits (sha256 of the array's bytes, as recorded)."""
    error: float | None
    """Largest |CPU - TPU| / largest |TPU value|; None where only a digest was recorded."""
    tolerance: float | None

    @property
    def within(self) -> bool | None:
        """Within the case's tolerance; None where that cannot be said (no values, or no tolerance)."""
        if self.identical:
            return True
        if self.error is None or self.tolerance is None:
            return None
        return self.error <= max(self.tolerance, RECORD_ROUNDING)


def compare(case: Any, record: dict[str, Any], out: Any) -> list[Output]:
    """Each output of ``out`` against the record's; raises where the shapes or dtypes differ."""
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != len(record["outputs"]):
        raise AssertionError(f"{case.name}: {len(leaves)} outputs, the TPU's {len(record['outputs'])}")
    compared = []
    for index, (leaf, want) in enumerate(zip(leaves, record["outputs"], strict=True)):
        array = np.asarray(leaf)
        if list(array.shape) != want["shape"] or str(array.dtype) != want["dtype"]:
            raise AssertionError(f"{case.name}: {array.shape} {array.dtype}, the TPU's {want['shape']} {want['dtype']}")
        identical = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest() == want["sha256"]
        error = None
        if "values" in want:
            # Back to the output's dtype first: the nine recorded digits are its value exactly.
            expected = np.asarray(want["values"], np.float64).astype(array.dtype).astype(np.float64)
            got = array.astype(np.float64).reshape(-1)
            scale = max(float(np.max(np.abs(expected))), 1e-30)
            error = float(np.max(np.abs(got - expected))) / scale if expected.size else 0.0
        compared.append(Output(case.name, index, identical, error, case.tolerance))
    return compared


def check(case: Any, record: dict[str, Any]) -> Any:
    """A ``FirstCall.check`` for a corpus case: every output within tolerance where that can be said."""

    def verify(out: Any) -> None:
        for output in compare(case, record, out):
            if output.within is False:
                raise AssertionError(f"{case.name}: {output.error:.3g} of the largest value, off the TPU's")

    return verify


def run(case: Any) -> Any:
    """The case called once, eagerly, under the guard with the default interpreter choice."""
    import jax

    import pallas_guard

    pallas_guard.install("interpret", interpreter="auto", checks="none", max_steps=None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return jax.block_until_ready(case.build()(*case.inputs()))
    finally:
        pallas_guard.uninstall()


def _fmt(output: Output) -> str:
    where = output.case if output.index == 0 else f"{output.case}[{output.index}]"
    tolerance = "no tolerance" if output.tolerance is None else f"tolerance {output.tolerance:g}"
    return f"{where} {output.error:.3g} ({tolerance})"


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    """One call per case whatever ``quick`` and ``pairs`` say: nothing is timed (about 20 s)."""
    import pallas_guard

    was_installed = pallas_guard._surfaces.install.status().requested
    pallas_guard.clear_decisions()
    outputs: list[Output] = []
    failed: list[str] = []
    cases = recorded()
    for case, record in cases:
        try:
            outputs.extend(compare(case, record, run(case)))
        except Exception as error:  # a case the guard cannot run is counted, not fatal
            failed.append(f"{case.name}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
    interpreters = Counter(d.interpreter for d in pallas_guard.decisions() if d.action == "interpreted")
    pallas_guard.clear_decisions()
    pallas_guard._vocabulary.settings.reset()
    if was_installed:
        pallas_guard.install()

    identical = [o for o in outputs if o.identical]
    measured = sorted((o for o in outputs if not o.identical and o.error is not None), key=lambda o: -(o.error or 0))
    comparable = [o for o in measured if o.tolerance is not None]
    digests = [o for o in outputs if not o.identical and o.error is None]
    outside = [o for o in outputs if o.within is False]
    largest = comparable[0] if comparable else None
    skipped = len(recorded(interpretable=False)) - len(cases)
    summary = Row(
        f"{ROW}: outputs bit-identical, every one within its case's tolerance",
        None,
        check=not outside and not failed,
        pairs=len(cases) - len(failed),
        detail=(
            f"{len(identical)} of {len(outputs)} outputs bit-identical (sha256); "
            f"{len(measured)} differ with values recorded, {len(digests)} differ with only a digest recorded; "
            f"outside tolerance: {', '.join(map(_fmt, outside)) or 'none'}"
        ),
        note=(
            f"n = cases run ({skipped} that ran on the TPU no CPU interpreter runs; "
            f"interpreters chosen: {', '.join(f'{k} {v}' for k, v in sorted(interpreters.items(), key=str))})"
            + (f"; failed: {'; '.join(failed)}" if failed else "")
        ),
    )
    error_row = Row(
        f"{ROW}: largest error relative to the output's largest |value|",
        None,
        check=None if largest is None else largest.within,
        pairs=len(comparable),
        detail=(f"{_fmt(largest)}" if largest else "no output differs where values were recorded"),
        note="n = differing outputs with values and a tolerance; in order: " + ", ".join(map(_fmt, comparable)),
    )
    result = [summary, error_row]
    uncomparable = [o for o in measured if o.tolerance is None]
    if uncomparable:
        result.append(
            Row(
                f"{ROW}: not comparable (the interpreters' PRNG is not the TPU's)",
                None,
                pairs=len(uncomparable),
                note=", ".join(o.case for o in uncomparable),
            )
        )
    if digests:
        result.append(
            Row(
                f"{ROW}: differ, only a digest recorded (no error to measure)",
                None,
                pairs=len(digests),
                note=", ".join(o.case if o.index == 0 else f"{o.case}[{o.index}]" for o in digests),
            )
        )
    return result


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(table(rows(quick="--quick" in sys.argv)))
