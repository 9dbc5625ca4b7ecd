"""Row 1, start-up: ``python -c pass`` with the ``.pth`` autoload vs without it.

Two throwaway venvs made from this interpreter, identical except for ``pallas_guard_autoload.pth``
(both get a path file that makes this checkout and jax importable), so site processing is the
real one. Each sample is a fresh interpreter, interleaved A B, B A, ...

- 1a: ``PALLAS_GUARD_POLICY`` unset: what the ``.pth`` line costs every Python process.
- 1b: ``PALLAS_GUARD_POLICY=interpret``: the guard installed at start-up, Pallas never imported.
- 1c: ``-X importtime`` evidence for 1b: nothing heavy (jax, jaxlib, wrapt, numpy) is imported.

Target: at most 1 ms added (the row's target ratio is computed from the plain start-up time).

    python benchmarks/startup.py [--pairs N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import REPO_ROOT, Comparison, Row, clean_env, imported_modules, interleave, table, time_python

PTH_NAME = "pallas_guard_autoload.pth"
ADDED_TARGET_S = 0.001
HEAVY = {"jax", "jaxlib", "wrapt", "numpy"}


def make_venv(root: Path, *, autoload: bool) -> Path:
    """A venv without pip whose site-packages sees this checkout and jax; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    paths = [str(REPO_ROOT), *(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))]
    (site_packages / "_paths.pth").write_text("\n".join(paths) + "\n")
    if autoload:
        (site_packages / PTH_NAME).write_text((REPO_ROOT / PTH_NAME).read_text())
    return root / "bin" / "python"


def _time(python: Path, env: dict[str, str]) -> Any:
    # time_python runs sys.executable; run the venv's python instead, same measurement.
    saved = sys.executable
    sys.executable = str(python)
    try:
        return time_python(("-c", "pass"), env)
    finally:
        sys.executable = saved


def _importtime(python: Path, env: dict[str, str]) -> list[str]:
    saved = sys.executable
    sys.executable = str(python)
    try:
        return imported_modules(("-c", "pass"), env)
    finally:
        sys.executable = saved


def _measure(pairs: int) -> list[tuple[Row, Comparison | None]]:
    unset = clean_env()
    unset.pop("PYTHONPATH", None)  # the venvs' path file puts the checkout first
    policy_set = {**unset, "PALLAS_GUARD_POLICY": "interpret"}
    result = []
    with tempfile.TemporaryDirectory(prefix="pallas-guard-startup-") as directory:
        with_pth = make_venv(Path(directory) / "autoload", autoload=True)
        without = make_venv(Path(directory) / "plain", autoload=False)
        for name, env, note in (
            ("1a. startup: python -c pass, autoload .pth installed vs not (PALLAS_GUARD_POLICY unset)", unset, ""),
            (
                "1b. startup: python -c pass, PALLAS_GUARD_POLICY=interpret + .pth vs neither",
                policy_set,
                "the guard installed at start-up; Pallas never imported",
            ),
        ):
            comparison = interleave(
                lambda env=env: _time(with_pth, env),  # type: ignore[misc]
                lambda: _time(without, unset),
                pairs=pairs,
                warmup=3,
                progress=name[:3],
            )
            plain = comparison.median("b")
            row = Row.from_comparison(name, comparison, target=1 + ADDED_TARGET_S / plain, group="startup", note=note)
            row.note = (row.note + "; " if row.note else "") + f"target: <= {ADDED_TARGET_S * 1e3:g} ms added"
            result.append((row, comparison))
        modules = _importtime(with_pth, policy_set)
        heavy = sorted({m for m in modules if m.split(".")[0] in HEAVY})
        ours = [m for m in modules if m.split(".")[0] == "pallas_guard"]
        baseline = set(_importtime(without, unset))
        extra = [m for m in modules if m not in baseline and m.split(".")[0] != "pallas_guard"]
        evidence = (
            Row(
                name="1c. -X importtime with PALLAS_GUARD_POLICY set: nothing heavy imported at start-up",
                ratio=None,
                check=not heavy and bool(ours),
                group="startup",
                note=(
                    f"pallas_guard modules: {', '.join(ours)}; other modules added: {', '.join(extra) or 'none'}; "
                    + (f"HEAVY: {', '.join(heavy)}" if heavy else "none of jax, jaxlib, wrapt, numpy")
                ),
            ),
            None,
        )
        result.append(evidence)
    return result


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    """The rows ``benchmarks/run.py`` prints."""
    return [row for row, _ in _measure(pairs or (30 if quick else 150))]


def measure_startup(repeats: int) -> list[dict[str, Any]]:
    """The rows as plain dicts: name, ratio, median_a, median_b (CPU seconds), spread, and the rest."""
    out = []
    for row, comparison in _measure(repeats):
        data = row.as_json()
        data["median_a"] = comparison.median("a") if comparison else None
        data["median_b"] = comparison.median("b") if comparison else None
        out.append(data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=None, help="interleaved pairs per row (default 150)")
    parser.add_argument("--quick", action="store_true", help="30 pairs per row")
    args = parser.parse_args()
    result = rows(quick=args.quick, pairs=args.pairs)
    print(table(result))
    for row in result:
        if row.note:
            print(f"{row.name.split()[0]} {row.note}")


if __name__ == "__main__":
    main()
