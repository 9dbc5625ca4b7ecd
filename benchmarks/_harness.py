"""Shared benchmark machinery: interleaved A/B runs, medians and spread, the table, JSON.

Every row of ``benchmarks/run.py`` is a ratio ``A / B`` (guarded / unguarded), measured side by
side in one run: the two variants alternate (A B, B A, A B, ...), so machine-wide drift and load
on this shared machine hit both alike. The row reports the median of the per-pair ratios and
their interquartile range as the spread. Absolute times are printed for context only: they vary
between machines and runs; the ratios are what to compare.

A benchmark module exposes ``rows(*, quick: bool) -> list[Row]``; ``run.py`` calls it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent


# --- statistics ---------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (the same as ``numpy.quantile``'s default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile() of no values")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Sample(NamedTuple):
    """One timed region: wall-clock seconds and CPU seconds (user + system, all threads)."""

    wall: float
    cpu: float


class Stopwatch:
    """``with Stopwatch() as watch: ...`` then ``watch.sample``: wall and process CPU time."""

    sample: Sample

    def __enter__(self) -> Stopwatch:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample = Sample(time.perf_counter() - self._wall, time.process_time() - self._cpu)


CLOCKS = ("cpu", "wall")
"""``cpu``: what the work costs, robust to other processes competing for the 2 cores (the row's
verdict); ``wall``: what a user waits, shown beside it, noisier on a shared machine."""


@dataclasses.dataclass
class Comparison:
    """Interleaved samples of two variants; the i-th ratio is ``a[i] / b[i]`` (one pair)."""

    a: list[Sample]
    b: list[Sample]

    def ratios(self, clock: str = "cpu") -> list[float]:
        return [getattr(x, clock) / getattr(y, clock) for x, y in zip(self.a, self.b, strict=True)]

    def ratio(self, clock: str = "cpu") -> float:
        return statistics.median(self.ratios(clock))

    def spread(self, clock: str = "cpu") -> tuple[float, float]:
        ratios = self.ratios(clock)
        return quantile(ratios, 0.25), quantile(ratios, 0.75)

    def median(self, variant: str, clock: str = "cpu") -> float:
        samples = self.a if variant == "a" else self.b
        return statistics.median(getattr(s, clock) for s in samples)


def interleave(
    a: Callable[[], Sample],
    b: Callable[[], Sample],
    *,
    pairs: int,
    warmup: int = 1,
    progress: str | None = None,
) -> Comparison:
    """Run ``a`` and ``b`` alternately ``pairs`` times each (after ``warmup`` unrecorded pairs).

    Each callable returns the :class:`Sample` of its own timed region (set-up stays outside it).
    The order flips every pair (A B, B A, ...) so neither variant always runs second.
    """
    for _ in range(warmup):
        a()
        b()
    result = Comparison([], [])
    for index in range(pairs):
        if index % 2 == 0:
            result.a.append(a())
            result.b.append(b())
        else:
            result.b.append(b())
            result.a.append(a())
        if progress:
            sys.stderr.write(f"\r  {progress}: {index + 1}/{pairs} pairs")
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return result


# --- fresh interpreters -------------------------------------------------------------------------


PYCACHE_PREFIX = Path(tempfile.gettempdir()) / "pallas_guard_bench_pycache"


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without any ``PALLAS_GUARD_*`` variable, plus ``extra``.

    Children cache bytecode, as after ``pip install`` (which compiles ``.pyc`` files): where
    ``PYTHONDONTWRITEBYTECODE`` is set or the installer wrote no ``.pyc`` (uv's default), every
    fresh interpreter would otherwise compile each module it imports from source, and that
    compile time, not the import, would dominate the startup rows. The cache goes to a prefix
    in the temp directory, so nothing is written into site-packages or the checkout.
    The checkout (where it holds the package) goes first on ``PYTHONPATH`` in every variant
    alike, so the benchmark measures this pallas_guard, installed or not.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(PYCACHE_PREFIX))
    if (REPO_ROOT / "pallas_guard" / "__init__.py").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def time_python(args: Sequence[str], env: Mapping[str, str]) -> Sample:
    """Wall and CPU seconds of ``python *args`` in a fresh interpreter (spawn to exit); raises on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, *args], env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} failed ({completed.returncode}): {completed.stderr.decode()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Sample(wall, cpu)


def imported_modules(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The modules ``python -X importtime *args`` imported, in order (evidence, not timing)."""
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", *args], env=dict(env), capture_output=True, text=True, check=True
    )
    names = []
    for line in completed.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.append(name)
    return names


# --- rows ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One line of the table: a ratio (guarded / unguarded) against its target."""

    name: str
    ratio: float | None
    """Median of the per-pair ratios of CPU time (the verdict); or another ratio a row defines."""
    target: float | None = None
    """The ratio must be at most this; None for a row that only reports (e.g. a speedup)."""
    spread: tuple[float, float] | None = None
    """Interquartile range of the per-pair ratios."""
    wall_ratio: float | None = None
    """Median of the per-pair ratios of wall-clock time, for comparison."""
    pairs: int = 0
    detail: str = ""
    """Absolute medians and anything else worth a glance; varies between machines."""
    note: str = ""
    """Why the row is not available, or what it is evidence of."""
    group: str = ""
    check: bool | None = None
    """The verdict of a row that checks a fact instead of a ratio (e.g. "jax is not imported")."""

    @property
    def status(self) -> str:
        if self.ratio is None:
            return "n/a" if self.check is None else ("pass" if self.check else "MISS")
        if self.target is None:
            return "info"
        return "pass" if self.ratio <= self.target else "MISS"

    @classmethod
    def from_comparison(
        cls,
        name: str,
        comparison: Comparison,
        *,
        target: float | None,
        unit: str = "ms",
        per: int = 1,
        per_label: str = "",
        group: str = "",
        note: str = "",
    ) -> Row:
        """The row for an A/B comparison; ``detail`` gives the CPU medians in ``unit``, divided by ``per``."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit] / per
        a, b = comparison.median("a") * scale, comparison.median("b") * scale
        wall_a, wall_b = comparison.median("a", "wall") * scale, comparison.median("b", "wall") * scale
        suffix = f" {unit}{' per ' + per_label if per_label else ''}"
        return cls(
            name=name,
            ratio=comparison.ratio("cpu"),
            target=target,
            spread=comparison.spread("cpu"),
            wall_ratio=comparison.ratio("wall"),
            pairs=len(comparison.a),
            detail=f"cpu {a:.4g} vs {b:.4g}{suffix} ({a - b:+.3g}); wall {wall_a:.4g} vs {wall_b:.4g}",
            group=group,
            note=note,
        )

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table (also valid Markdown)."""
    header = ("row", "ratio", "spread (IQR)", "wall", "target", "result", "n", "guarded vs unguarded (medians)")
    lines = []
    for row in rows:
        spread = "-" if row.spread is None else f"{row.spread[0]:.3f}-{row.spread[1]:.3f}"
        target = "-" if row.target is None else f"<= {row.target:.2f}"
        detail = "; ".join(filter(None, [row.detail, row.note]))
        cells = (row.name, _fmt(row.ratio), spread, _fmt(row.wall_ratio), target, row.status, str(row.pairs or "-"))
        lines.append((*cells, detail))
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) for i in range(len(header) - 1)]

    def render(cells: Sequence[str]) -> str:
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(cells[:-1])]
        return "| " + " | ".join([*padded, cells[-1]]) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|---|"
    return "\n".join([render(header), separator, *(render(line) for line in lines)])


def environment() -> dict[str, Any]:
    """What the table was measured on (printed above it and stored in the JSON)."""
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    try:
        from importlib import metadata

        info["jax"] = metadata.version("jax")
        info["jaxlib"] = metadata.version("jaxlib")
    except Exception:
        info["jax"] = "unknown"
    return info


def write_json(path: str, rows: Sequence[Row], meta: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps({**meta, "rows": [row.as_json() for row in rows]}, indent=2) + "\n")
