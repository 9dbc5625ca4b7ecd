"""Row 4g: the compile check (``checks=compile``, device ``tpu-v5e``), with the check vs without.

The kernels: every case of ``tests/tpu_corpus.py`` that ran on a TPU v5e (its record: status
``done``, phase null) and that a CPU interpreter runs, each jitted as a user jits it. First call:
JAX's caches and the guard's choices cleared, the jitted kernel called once with the check (libtpu's
compiler lowers and compiles it for the v5e on this CPU, ahead of the interpreted run) and once
without, interleaved; target: the median over the kernels <= 1.5. Steady: the same jitted function
called again once settled, about 0.1 s of calls a sample (the compile happened at its trace:
nothing is left for the check to do); target <= 1.02, as for the lowering check (row 4d). libtpu
starts once per process, at the first compile: that start is made before timing and reported.
Where libtpu cannot run here, the rows say why (``_tpu_compile.available()``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Comparison, Row, Sample, Stopwatch, interleave, table  # noqa: E402

DEVICE = "tpu-v5e"
FIRST_TARGET = 1.2
FIRST_CLOCK = "wall"
"""The first-call rows' verdict: what a user waits. libtpu compiles in a thread beside the
interpreted run, which the wall clock shows and the process's CPU time (both threads) cannot; the
CPU ratio is given beside it."""
STEADY_TARGET = 1.02
STEADY_SECONDS = 0.1
"""Each steady sample calls the kernel about this long (at least 5 calls): a call of a small jitted
kernel takes 0.02-1 ms, too short to time alone on a shared machine."""
FIRST_ROW = "4g. compile check: first call, median over the kernels, with vs without"
KEPT_ROW = "4g. compile check: first call, its compile kept on disk by an earlier run, with vs without"
EAGER_ROW = "4g. compile check: first call eager (outside jax.jit), median over the kernels, with vs without"
STEADY_ROW = "4g. compile check: steady (the same jitted kernel called again, settled), median over the kernels"
QUICK = frozenset(
    {"tiling.f32_8x128", "dtype.f32_add", "matmul.f32", "matmul.revisited_output", "index.prefetch_gather"}
)
"""Kernels whose unchecked first call takes 30 to 300 ms, as in the whole corpus: the check's cost is
about the same for each, so the smallest decide the median."""


class Kernel:
    """A corpus case, jitted: ``first`` makes a fresh jitted function and calls it once."""

    def __init__(self, case: Any, record: dict[str, Any]) -> None:
        import jax
        from tpu_values import check

        self.name = case.name
        self.case = case
        self.inputs = tuple(jax.device_put(x) for x in case.inputs())  # no host copy in the timed calls
        self.check: Callable[[Any], None] = check(case, record)
        self.jitted: dict[str, Any] = {}
        self.calls = 0

    def first(self, checks: str, kept: str | None = None, *, eager: bool = False) -> Sample:
        """``kept``: the directory of compiles kept on disk (``XDG_CACHE_HOME``) an earlier run
        filled; None: a new, empty one, so that libtpu compiles the kernel. ``eager``: the kernel
        called outside ``jax.jit``, where its compile runs beside the whole interpreted run."""
        import jax

        import pallas_guard

        os.environ["XDG_CACHE_HOME"] = kept or tempfile.mkdtemp(prefix="pallas_guard-bench-")
        jax.clear_caches()
        pallas_guard.uninstall()  # forgets the settled choices, lowerings and compiles
        pallas_guard.install("interpret", checks=checks, max_steps=None, device=DEVICE)
        function = self.case.build() if eager else jax.jit(self.case.build())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Stopwatch() as watch:
                out = jax.block_until_ready(function(*self.inputs))
        self.check(out)
        if not eager:
            self.jitted[checks] = function  # traced under ``checks``: what the steady calls call
        return watch.sample

    def steady(self, checks: str) -> Sample:
        """``calls`` calls of the function jitted (and compiled) under ``checks``, once it ran."""
        import jax

        import pallas_guard

        function = self.jitted[checks]
        with pallas_guard.policy(checks=checks), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.block_until_ready(function(*self.inputs))
            if not self.calls:  # the same number for both variants: fixed by the first to run
                with Stopwatch() as once:
                    jax.block_until_ready(function(*self.inputs))
                self.calls = max(5, min(1000, int(STEADY_SECONDS / max(once.sample.wall, 1e-6))))
            with Stopwatch() as watch:
                for _ in range(self.calls):
                    jax.block_until_ready(function(*self.inputs))
        return watch.sample


def _compiled() -> str | None:
    """What the compile check's decision said of the kernel (its last first call with the check)."""
    import pallas_guard

    notes = [note for d in pallas_guard.decisions() for note in d.notes if note.startswith("compile:")]
    reasons = [d.reason for d in pallas_guard.decisions() if "compile" in d.reason]
    said = notes or reasons
    return said[-1] if said else None


def _measure(
    kernel: Kernel, pairs: int, steady_pairs: int
) -> tuple[Comparison, str, Comparison, Comparison, Comparison]:
    """First calls (libtpu compiles), first calls whose compile an earlier run kept, steady calls;
    and what the check said."""
    import pallas_guard

    cache_home = os.environ.get("XDG_CACHE_HOME")
    try:
        pallas_guard.clear_decisions()
        first = interleave(lambda: kernel.first("compile"), lambda: kernel.first("none"), pairs=pairs, warmup=0)
        said = _compiled() or "no compile decision"
        kept = tempfile.mkdtemp(prefix="pallas_guard-bench-kept-")
        kernel.first("compile", kept)  # the earlier run: its compile kept, untimed
        first_kept = interleave(
            lambda: kernel.first("compile", kept), lambda: kernel.first("none"), pairs=pairs, warmup=0
        )
        eager = interleave(
            lambda: kernel.first("compile", eager=True), lambda: kernel.first("none", eager=True), pairs=pairs, warmup=0
        )
        settled = interleave(
            lambda: kernel.steady("compile"), lambda: kernel.steady("none"), pairs=steady_pairs, warmup=1
        )
    finally:
        if cache_home is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = cache_home
    return first, said, first_kept, eager, settled


def worst(ratios: dict[str, float]) -> str:
    name = max(ratios, key=lambda k: ratios[k]) if ratios else None
    return f"worst {ratios[name]:.3f} ({name})" if name else ""


def median_row(name: str, ratios: dict[str, float], target: float, note: str) -> Row:
    median = statistics.median(ratios.values()) if ratios else None
    return Row(name, median, target, pairs=len(ratios), detail=worst(ratios), note=note)


def _unavailable(why: str) -> list[Row]:
    return [
        Row(FIRST_ROW, None, FIRST_TARGET, note=f"not available: {why}"),
        Row(KEPT_ROW, None, FIRST_TARGET, note=f"not available: {why}"),
        Row(EAGER_ROW, None, FIRST_TARGET, note=f"not available: {why}"),
        Row(STEADY_ROW, None, STEADY_TARGET, note=f"not available: {why}"),
    ]


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    import pallas_guard
    from pallas_guard._running import tpu_compile as _tpu_compile

    missing = _tpu_compile.available()
    if missing is not None:
        return _unavailable(missing)
    start = time.perf_counter()
    device = _tpu_compile.topology_device(DEVICE)
    if isinstance(device, str):
        return _unavailable(device)
    started = time.perf_counter() - start

    from tpu_values import recorded

    steady_pairs = pairs or 3  # cheap (0.1 s a sample), and noisier than a first call
    pairs = pairs or (2 if quick else 3)
    was_installed = pallas_guard._surfaces.install.status().requested
    kernels = [Kernel(case, record) for case, record in recorded() if not quick or case.name in QUICK]
    first: dict[str, float] = {}
    first_kept: dict[str, float] = {}
    first_cpu: dict[str, float] = {}
    first_eager: dict[str, float] = {}
    steady: dict[str, float] = {}
    failed: list[str] = []
    unchecked: list[str] = []
    details: list[str] = []
    warm = time.perf_counter()
    with contextlib.suppress(Exception):  # reported where the kernel is timed
        kernels[0].first("compile")  # the compile path's own first use in this process, untimed
    warm = time.perf_counter() - warm
    for kernel in kernels:
        sys.stderr.write(f"  4g. {kernel.name}\n")
        try:
            comparison, said, kept_comparison, eager_comparison, settled = _measure(kernel, pairs, steady_pairs)
        except Exception as error:  # one kernel failing must not hide the others
            lines = str(error).strip().splitlines()
            failed.append(f"{kernel.name}: {type(error).__name__}: {lines[0][:120] if lines else ''}")
            continue
        finally:
            pallas_guard.uninstall()
        if "compiles for" not in said:
            unchecked.append(f"{kernel.name} ({said})")
        first[kernel.name] = comparison.ratio(FIRST_CLOCK)
        first_kept[kernel.name] = kept_comparison.ratio(FIRST_CLOCK)
        first_cpu[kernel.name] = comparison.ratio("cpu")
        first_eager[kernel.name] = eager_comparison.ratio(FIRST_CLOCK)
        steady[kernel.name] = settled.ratio("cpu")
        details.append(
            f"{kernel.name} {first[kernel.name]:.2f} ({comparison.median('a', FIRST_CLOCK) * 1e3:.0f}/"
            f"{comparison.median('b', FIRST_CLOCK) * 1e3:.0f} ms)/{steady[kernel.name]:.3f}"
        )
    pallas_guard._vocabulary.settings.reset()
    pallas_guard.clear_decisions()
    if was_installed:
        pallas_guard.install()

    tail = "".join(
        [
            f"; the check did not compile: {', '.join(unchecked)}" if unchecked else "",
            f"; failed: {'; '.join(failed)}" if failed else "",
        ]
    )
    calls = [k.calls for k in kernels if k.calls]

    once = (
        f"once per process, not timed: the TPU topology {started:.1f} s, "
        f"the first kernel's first checked call {warm:.1f} s (wall)"
    )
    return [
        median_row(
            FIRST_ROW,
            first,
            FIRST_TARGET,
            f"n = kernels; the {FIRST_CLOCK} clock (CPU time, both threads: "
            f"{statistics.median(first_cpu.values()) if first_cpu else float('nan'):.3f}); {once}; "
            f"per kernel first (with/without)/steady: {', '.join(details)}{tail}",
        ),
        median_row(
            KEPT_ROW,
            first_kept,
            FIRST_TARGET,
            f"n = kernels; the {FIRST_CLOCK} clock; as the first call, with the kernel compiled once before, "
            "untimed, its verdict kept",
        ),
        median_row(
            EAGER_ROW,
            first_eager,
            FIRST_TARGET,
            f"n = kernels; the {FIRST_CLOCK} clock; as the first call, the kernel called outside jax.jit: libtpu "
            "compiles beside the whole interpreted run",
        ),
        median_row(
            STEADY_ROW,
            steady,
            STEADY_TARGET,
            f"n = kernels; {min(calls, default=0)}-{max(calls, default=0)} calls a sample ({STEADY_SECONDS} s)",
        ),
    ]


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(table(rows(quick="--quick" in sys.argv)))
