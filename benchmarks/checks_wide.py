"""Row 4m: row 4f's first calls over every corpus the project has, one round.

Row 4f times 29 kernels in nine variants over three rounds; this row times every kernel the
corpora hold that runs cleanly, in four variants (``none``, ``all``, ``all`` where an earlier run
kept the kernel's compile on disk, ``all,agree``), once each in an order that rotates from kernel to
kernel: JAX's shipped kernels (``tests/ops_corpus.py``), every
case of ``tests/tpu_corpus.py`` that ran on the TPU v5e and a CPU interpreter runs (its outputs
checked against the chip's), and the valid kernels of ``tests/race_corpus.py``. One first call per
variant is noisy per kernel; the median over some 140 is not. Target: the median of ``all`` /
``none`` <= 1.5 with no compile kept, reported by kernel family.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row  # noqa: E402
from checks import (  # noqa: E402
    ALL,
    DEVICE,
    EVERY,
    MEDIAN_TARGET,
    _corpus,
    _family_rows,
    _first_call,
    _median_row,
    _warm,
    _why,
    restored_guard,
)
from first_call import FirstCall  # noqa: E402

KEPT = "kept"
"""``all`` where an earlier run kept the kernel's compile on disk (a CI job that restores
``~/.cache/pallas_guard``): that run is made just before, untimed."""
VARIANTS = ("none", ALL, KEPT, EVERY)
QUICK = 12
"""Kernels a quick run takes from each corpus."""


def _kernels(quick: bool) -> list[FirstCall]:
    import race_corpus
    from tpu_values import check, recorded

    ops = _corpus(None)
    tpu = []
    for case, record in recorded():
        inputs = case.inputs()
        tpu.append(
            FirstCall(
                f"tpu_corpus.{case.name}",
                lambda case=case, inputs=inputs: case.build()(*inputs),
                check(case, record),
                DEVICE,
            )
        )
    races = []
    for race_case in race_corpus.CASES:
        if race_case.kind is None and not race_case.detector.startswith("error"):
            races.append(FirstCall(f"race_corpus.{race_case.name}", lambda c=race_case: _call(c), _any, DEVICE))
    if quick:
        return [*ops[:QUICK], *tpu[:QUICK], *races[:QUICK]]
    return [*ops, *tpu, *races]


def _call(case: Any) -> Any:
    fn, args = case.build(None)
    return fn(*args)


def _any(out: Any) -> None:
    """The race corpus's valid kernels have no reference of their own: the run must only succeed."""


def _shown(variant: str) -> str:
    return "all (compiles kept)" if variant == KEPT else variant


def _timed(kernel: FirstCall, variant: str) -> float:
    """The CPU seconds of one first call in ``variant``."""
    if variant != KEPT:
        return _first_call(kernel, variant).cpu
    with tempfile.TemporaryDirectory(prefix="pallas_guard-bench-kept-") as kept:
        _first_call(kernel, ALL, kept)
        return _first_call(kernel, ALL, kept).cpu


def _measure(kernels: list[FirstCall]) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """Each kernel's first call in every variant, the order rotated from kernel to kernel: each
    checked variant's ratio over ``none`` per kernel, and what failed."""
    ratios: dict[str, dict[str, float]] = {variant: {} for variant in VARIANTS[1:]}
    failed: dict[str, list[str]] = {variant: [] for variant in VARIANTS}
    for index, kernel in enumerate(kernels):
        sys.stderr.write(f"  4m. {kernel.name}\n")
        shift = index % len(VARIANTS)
        times: dict[str, float] = {}
        for variant in (*VARIANTS[shift:], *VARIANTS[:shift]):
            try:
                times[variant] = _timed(kernel, variant)
            except Exception as error:  # reported, not counted
                failed[variant].append(f"{kernel.name} ({_why(error)})")
        if "none" in times:
            for variant in VARIANTS[1:]:
                if variant in times:
                    ratios[variant][kernel.name] = times[variant] / times["none"]
    return ratios, failed


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    del pairs  # one round: the median over the kernels is what is judged
    with restored_guard():
        kernels = _kernels(quick)
        warm_note = _warm(kernels)  # the checks' modules, interpreters and the TPU topology: once per process
        ratios, failed = _measure(kernels)
    result = []
    for variant in VARIANTS[1:]:
        failing = f"; fails on {len(failed[variant])}: {', '.join(failed[variant])[:300]}" if failed[variant] else ""
        kept = "an earlier run's compile kept on disk" if variant == KEPT else "no compile kept on disk"
        title = f"4m. checks={_shown(variant)} first call"
        result.append(
            _median_row(
                f"{title} vs none, every corpus: median over the kernels",
                ratios[variant],
                MEDIAN_TARGET if variant == ALL else None,
                f"n = kernels; {kept}" + failing + (f"; {warm_note}" if warm_note else ""),
            )
        )
        result.extend(_family_rows(title, ratios[variant]))
    if failed["none"]:
        result.append(Row("4m. kernels that fail without checks", None, note="; ".join(failed["none"])[:400]))
    return result


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from _harness import table

    print(table(rows(quick="--quick" in sys.argv)))
