"""Row 1, start-up: ``python -c pass`` with the autoload (``.pth`` line, ``.start`` entry point) vs without.

Throwaway venvs made from this interpreter, identical except for the start-up files (each gets a
path file that makes this checkout and jax importable), so site processing is the real one. Each
sample is a fresh interpreter, interleaved A B, B A, ...

- 1a: ``PALLAS_GUARD_POLICY`` unset: what the ``.pth`` line costs every Python process.
- 1b: ``PALLAS_GUARD_POLICY=interpret``, through the ``.pth`` line (Python < 3.15): the guard
  activated at start-up (the post-import hook registered), Pallas never imported.
- 1b': the same through the PEP 829 ``.start`` entry point (Python >= 3.15). Before 3.15, both
  venvs get a ``sitecustomize`` that does what 3.15's ``site`` does with ``*.start`` files
  (resolve each ``pkg.mod:callable`` line, call it); only A has ours.
- 1c: ``-X importtime`` evidence for 1b: ``pallas_guard_autoload`` is the only module of ours,
  and nothing heavy (jax, jaxlib, wrapt, numpy) is imported.

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
START_NAME = "pallas_guard_autoload.start"
ADDED_TARGET_S = 0.001
HEAVY = {"jax", "jaxlib", "wrapt", "numpy"}
NATIVE_START_FILES = sys.version_info >= (3, 15)

# What CPython 3.15's site does with <name>.start files (PEP 829), for the Pythons before it.
START_FILE_SITECUSTOMIZE = """\
import os, sys
for _directory in [p for p in sys.path if p.endswith("site-packages")]:
    for _name in sorted(os.listdir(_directory)):
        if _name.endswith(".start") and not _name.startswith("."):
            with open(os.path.join(_directory, _name), encoding="utf-8-sig") as _file:
                for _line in _file:
                    _line = _line.strip()
                    if _line and not _line.startswith("#"):
                        _module, _, _attribute = _line.partition(":")
                        getattr(__import__(_module, fromlist=[_attribute]), _attribute)()
"""


def make_venv(root: Path, *, files: tuple[str, ...], emulate_start_files: bool = False) -> Path:
    """A venv without pip whose site-packages sees this checkout and jax, with the start-up
    ``files`` of this checkout; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    paths = [str(REPO_ROOT), *(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))]
    (site_packages / "_paths.pth").write_text("\n".join(paths) + "\n")
    for name in files:
        (site_packages / name).write_text((REPO_ROOT / name).read_text())
    if emulate_start_files and not NATIVE_START_FILES:
        (site_packages / "sitecustomize.py").write_text(START_FILE_SITECUSTOMIZE)
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


def _row(name: str, comparison: Comparison, note: str) -> tuple[Row, Comparison]:
    plain = comparison.median("b")
    row = Row.from_comparison(name, comparison, target=1 + ADDED_TARGET_S / plain, group="startup", note=note)
    row.note = (row.note + "; " if row.note else "") + f"target: <= {ADDED_TARGET_S * 1e3:g} ms added"
    return row, comparison


def _measure(pairs: int) -> list[tuple[Row, Comparison | None]]:
    unset = clean_env()
    unset.pop("PYTHONPATH", None)  # the venvs' path file puts the checkout first
    policy_set = {**unset, "PALLAS_GUARD_POLICY": "interpret"}
    result = []
    with tempfile.TemporaryDirectory(prefix="pallas-guard-startup-") as directory:
        root = Path(directory)
        with_pth = make_venv(root / "autoload", files=(PTH_NAME, START_NAME))
        without = make_venv(root / "plain", files=())
        with_start = make_venv(root / "start", files=(START_NAME,), emulate_start_files=True)
        without_start = make_venv(root / "start-plain", files=(), emulate_start_files=True)
        site_note = "" if NATIVE_START_FILES else " (both venvs: a sitecustomize does what 3.15's site does)"
        for name, a, env, b, note in (
            ("1a. startup: python -c pass, autoload .pth installed vs not (PALLAS_GUARD_POLICY unset)",
             with_pth, unset, without, ""),
            ("1b. startup: python -c pass, PALLAS_GUARD_POLICY=interpret, via the .pth line vs neither",
             with_pth, policy_set, without, "the guard activated at start-up; Pallas never imported"),
            ("1b'. startup: the same via the PEP 829 .start entry point vs none",
             with_start, policy_set, without_start, "Python >= 3.15's route" + site_note),
        ):  # fmt: skip
            comparison = interleave(
                lambda a=a, env=env: _time(a, env),  # type: ignore[misc]
                lambda b=b: _time(b, unset),  # type: ignore[misc]
                pairs=pairs,
                warmup=3,
                progress=name.split()[0],
            )
            result.append(_row(name, comparison, note))
        modules = _importtime(with_pth, policy_set)
        heavy = sorted({m for m in modules if m.split(".")[0] in HEAVY})
        ours = [m for m in modules if m.split(".")[0].startswith("pallas_guard")]
        baseline = set(_importtime(without, unset))
        extra = [m for m in modules if m not in baseline and m not in ours]
        evidence = (
            Row(
                name="1c. -X importtime with PALLAS_GUARD_POLICY set: only the start-up module, nothing heavy",
                ratio=None,
                check=not heavy and ours == ["pallas_guard_autoload"],
                group="startup",
                note=(
                    f"modules of ours: {', '.join(ours) or 'none'}; other modules added: {', '.join(extra) or 'none'}; "
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
