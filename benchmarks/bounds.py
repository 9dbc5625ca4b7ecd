"""Row 4b: what ``PALLAS_GUARD_CHECKS=bounds`` costs, the check vs the plain interpreter.

For each kernel of the test corpus (``tests/ops_corpus.py``) that the plain interpreter runs: the
guard with ``checks="bounds"`` (index checks in the plain interpreter, or the check of the
interpreter the kernel needs) interleaved with the plain interpreter forced by hand, both compiled
ahead of time (ratio checked / plain, target <= 5 per kernel); the checked result is compared bit
for bit with plain's (a difference is a MISS). Then the median over the kernels (target <= 2).

First call: each of those kernels called once as a user would (a jitted op), JAX's caches and the
guard's choices cleared (build, trace, verify, lower, compile, run), with ``checks="bounds"`` vs
without, interleaved (``first ...x`` in each kernel's row); targets: the median over the kernels
<= 1.5, none above 3.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, interleave  # noqa: E402
from first_call import FirstCall, _corpus  # noqa: E402
from kernels import QUICK_CASES, _compile, _compile_choosing, _repeats, _timed  # noqa: E402
from lowering import _first  # noqa: E402

BOUNDS_TARGET = 5.0
BOUNDS_MEDIAN_TARGET = 2.0
BOUNDS_MEDIAN_ROW = "4b. bounds: PALLAS_GUARD_CHECKS=bounds vs plain, median over the corpus"
FIRST_MEDIAN_TARGET = 1.5
FIRST_EACH_TARGET = 3.0


def _bounds_row(case: Any, plain: Callable[[], Any], pairs: int) -> Row:
    """Row 4b for one kernel: the guard with ``checks="bounds"`` vs the plain interpreter by hand."""
    import jax
    import numpy as np

    name = f"4b. bounds: {case.name}"
    checked, why, chosen = _compile_choosing(case, "bounds")
    if checked is None:
        return Row(name, None, BOUNDS_TARGET, note=f"fails with the check: {why}")
    same = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree_util.tree_leaves(checked()), jax.tree_util.tree_leaves(plain()), strict=True)
    )
    if not same:
        return Row(name, None, BOUNDS_TARGET, check=False, note="MISS: the checked result differs from plain's")
    repeats = _repeats(plain)
    comparison = interleave(_timed(checked, repeats), _timed(plain, repeats), pairs=pairs)
    return Row(
        name,
        comparison.ratio("cpu"),
        BOUNDS_TARGET,
        spread=comparison.spread("cpu"),
        wall_ratio=comparison.ratio("wall"),
        pairs=pairs,
        detail=(
            f"checked in {chosen} {comparison.median('a') * 1e3:.2f} ms vs plain "
            f"{comparison.median('b') * 1e3:.2f} ms; results bit-identical"
        ),
    )


def _first_call(kernel: FirstCall, pairs: int) -> float:
    """The first call with ``checks="bounds"`` / without (median of interleaved pairs, CPU time)."""
    a: Any = lambda: _first(kernel, "bounds")  # noqa: E731
    b: Any = lambda: _first(kernel, "none")  # noqa: E731
    return interleave(a, b, pairs=pairs, warmup=0).ratio("cpu")


def _first_rows(first: dict[str, float]) -> list[Row]:
    ratios = list(first.values())
    detail = ", ".join(f"{name} {ratio:.2f}" for name, ratio in first.items())
    worst = max(first, key=first.__getitem__) if first else ""
    return [
        Row(
            "4b. bounds: first call, checked vs unchecked, median over the corpus",
            statistics.median(ratios) if ratios else None,
            FIRST_MEDIAN_TARGET,
            pairs=len(ratios),
            detail=detail,
            note="n = kernels",
        ),
        Row(
            "4b. bounds: first call, checked vs unchecked, worst kernel",
            first[worst] if first else None,
            FIRST_EACH_TARGET,
            pairs=len(ratios),
            detail=worst,
            note="n = kernels",
        ),
    ]


def _bounds_median(rows: list[Row]) -> Row:
    measured = [row.ratio for row in rows if row.ratio is not None]
    if not measured:
        return Row(BOUNDS_MEDIAN_ROW, None, BOUNDS_MEDIAN_TARGET, note="no kernel ran with the check")
    return Row(
        BOUNDS_MEDIAN_ROW,
        statistics.median(measured),
        BOUNDS_MEDIAN_TARGET,
        pairs=len(measured),
        detail=f"worst {max(measured):.2f}",
        note="n = kernels",
    )


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    import jax
    from ops_corpus import cases

    import pallas_guard

    pairs = pairs or (3 if quick else 7)
    first_pairs = min(pairs, 3)  # a first call lasts up to seconds: three pairs per kernel
    was_installed = pallas_guard._surfaces.install.status().requested
    first_calls = {kernel.name: kernel for kernel in _corpus()}
    measured: list[Row] = []
    first: dict[str, float] = {}
    for case in cases():
        if case.xfail or case.skip_reason() or (quick and case.name not in QUICK_CASES):
            continue
        if case.devices > len(jax.devices("cpu")):
            continue
        plain, _ = _compile(case, "plain")
        if plain is None:
            continue
        row = _bounds_row(case, plain, pairs)
        pallas_guard.uninstall()
        if case.name in first_calls:
            first[case.name] = _first_call(first_calls[case.name], first_pairs)
            row.detail = f"{row.detail}; first call {first[case.name]:.2f}x unchecked's".lstrip("; ")
        measured.append(row)
    pallas_guard._vocabulary.settings.reset()
    pallas_guard.uninstall()
    if was_installed:
        pallas_guard.install()
    return [*measured, _bounds_median(measured), *_first_rows(first)]


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(f"{row.name:60} {row.ratio if row.ratio is None else round(row.ratio, 3)!s:>8}  {row.detail or row.note}")
