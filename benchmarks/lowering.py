"""Row 4d: the lowering check (``PALLAS_GUARD_CHECKS=lowering``), with the check vs without.

First call: each kernel of the corpus (``tests/ops_corpus.py``), JAX's caches and the guard's
choices cleared, called once with the check (one extra lowering of its ``pallas_call`` for its
real target) and once without, interleaved; target: the median over the kernels <= 1.5. Steady:
the same kernels called again once settled, the check's only cost a lookup; target <= 1.02.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, Sample, Stopwatch, interleave  # noqa: E402
from first_call import FirstCall, _corpus  # noqa: E402

FIRST_TARGET = 1.5
STEADY_TARGET = 1.02
STEADY_CALLS = 5
QUICK = frozenset({"gpu.softmax", "gpu.layer_norm", "tpu.matmul", "tpu.flash_attention"})


def _install(kernel: FirstCall, checks: str) -> None:
    import pallas_guard

    pallas_guard.uninstall()  # forgets the settled choices and lowerings
    pallas_guard.install("interpret", checks=checks, max_steps=None, device=kernel.device)


def _first(kernel: FirstCall, checks: str) -> Sample:
    import jax

    jax.clear_caches()
    _install(kernel, checks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Stopwatch() as watch:
            out = jax.block_until_ready(kernel.call())
    kernel.check(out)
    return watch.sample


def _steady(kernel: FirstCall, checks: str) -> Sample:
    """``STEADY_CALLS`` calls once the first has settled everything (its lowering included)."""
    import jax

    import pallas_guard

    with pallas_guard.policy(checks=checks), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.block_until_ready(kernel.call())
        with Stopwatch() as watch:
            for _ in range(STEADY_CALLS):
                jax.block_until_ready(kernel.call())
    return watch.sample


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    import pallas_guard

    pairs = pairs or (3 if quick else 5)
    was_installed = pallas_guard._surfaces.install.status().requested
    kernels = [k for k in _corpus() if not quick or k.name in QUICK]
    first: list[float] = []
    steady: list[float] = []
    details: list[str] = []
    for kernel in kernels:
        a: Any = lambda kernel=kernel: _first(kernel, "lowering")  # noqa: E731
        b: Any = lambda kernel=kernel: _first(kernel, "none")  # noqa: E731
        comparison = interleave(a, b, pairs=pairs, warmup=0)
        first.append(comparison.ratio("cpu"))
        _install(kernel, "none")
        settled = interleave(
            lambda kernel=kernel: _steady(kernel, "lowering"),
            lambda kernel=kernel: _steady(kernel, "none"),
            pairs=pairs,
            warmup=1,
        )
        steady.append(settled.ratio("cpu"))
        details.append(f"{kernel.name} {first[-1]:.2f}/{steady[-1]:.3f}")
    pallas_guard._vocabulary.settings.reset()
    pallas_guard.uninstall()
    if was_installed:
        pallas_guard.install()
    return [
        Row(
            "4d. lowering check: first call, median over the kernels, with vs without",
            statistics.median(first) if first else None,
            FIRST_TARGET,
            pairs=len(first),
            detail=f"worst {max(first):.3f}" if first else "",
            note="n = kernels; per kernel first/steady: " + ", ".join(details),
        ),
        Row(
            f"4d. lowering check: steady ({STEADY_CALLS} calls, settled), median over the kernels",
            statistics.median(steady) if steady else None,
            STEADY_TARGET,
            pairs=len(steady),
            detail=f"worst {max(steady):.3f}" if steady else "",
            note="n = kernels",
        ),
    ]


if __name__ == "__main__":
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for row in rows(quick="--quick" in sys.argv):
        ratio = f"{row.ratio:.3f}" if row.ratio is not None else "n/a"
        print(f"{row.name:60} {ratio:>7}  {row.detail} {row.note}")
