"""One entry point for the benchmarks that show the guard is free.

    python benchmarks/run.py [--quick] [--json out.json] [--only startup,trace,...]

Prints one table; each row is a ratio guarded / unguarded with its median and spread over
repeated interleaved runs (A B, B A, ...), its target and pass/MISS. Absolute times vary between
machines and runs; the ratios are what to compare. ``--quick`` (about 3 minutes on 2 cores, 70 s
of it rows 4f-4h) is for before every change; the full run takes under 15 minutes, plus about 30
for rows 4f-4h (``--only checks`` alone about 27: eight first calls a kernel a round).

Exit status: 0 when every row with a target passes, 1 when one misses, 2 when one failed to run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
if (BENCH_DIR.parent / "pallas_guard" / "__init__.py").is_file():
    # This checkout's pallas_guard, here as in every child interpreter (_harness.clean_env).
    sys.path.insert(1, str(BENCH_DIR.parent))

import _harness  # noqa: E402
from _harness import Row  # noqa: E402

# key -> (module in benchmarks/, title for "not available" rows)
GROUPS: dict[str, tuple[str, str]] = {
    "startup": ("startup", "1. startup: python -c pass, guard autoload vs none"),
    "pallas_import": ("pallas_import", "2. import jax.experimental.pallas, guard active vs not"),
    "trace": ("trace", "3. trace: distinct pallas_calls, guard vs interpret=True"),
    "kernels": ("kernels", "4. interpreted kernel speed, guard vs best hand-forced interpreter"),
    "bounds": ("bounds", "4b. bounds check: PALLAS_GUARD_CHECKS=bounds vs the plain interpreter"),
    "first_call": ("first_call", "4c. first call (build, trace, verify, compile, run), guard vs best forced"),
    "lowering": ("lowering", "4d. lowering check: first call and steady, with the check vs without"),
    "interpreted": ("interpreted", "4e. interpreted-kernel speed: the guard vs JAX's interpreter as it ships, 1x-16x"),
    "steady": ("steady", "5. steady: jitted fn with a guarded kernel vs interpret=True"),
    # Numbered 4f-4h but listed last: the smoke test expects the keys above first, in this order.
    "checks": ("checks", "4f. checks=all first call vs unchecked"),
    "compile_check": ("compile_check", "4g. compile check: first call and steady vs unchecked"),
    "tpu_values": ("tpu_values", "4h. CPU values vs the TPU's"),
    "races": ("races", "4i. race check in the plain interpretation: first call and steady vs unchecked"),
    "sharded": ("sharded", "4j-4k. shard_map on 2, 4, 8 CPU devices: the compile check, the interpreted run"),
    "memory": ("memory", "4l. peak memory of a checked run vs unchecked, at model shapes"),
    "checks_wide": ("checks_wide", "4m. checks=all first call vs unchecked, every corpus, one round"),
}


def _load(module_name: str) -> ModuleType:
    """``benchmarks/<module_name>.py``, loaded by path (``trace`` is also a stdlib name)."""
    path = BENCH_DIR / f"{module_name}.py"
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


# --- the run ------------------------------------------------------------------------------------


def run_group(key: str, *, quick: bool, pairs: int | None = None) -> list[Row]:
    module_name, _title = GROUPS[key]
    module = _load(module_name)
    rows: list[Row] = module.rows(quick=quick, pairs=pairs)  # each row module's one entry point
    for row in rows:
        row.group = row.group or key  # --json groups rows by the benchmark that made them
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="benchmarks/run.py")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions: under 2 minutes")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    parser.add_argument(
        "--only",
        metavar="KEYS",
        action="append",
        help=f"comma-separated rows to run, of: {', '.join(GROUPS)} (repeatable; default all)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        metavar="N",
        help="override the number of interleaved pairs of rows that take one (a smoke test's shortcut)",
    )
    args = parser.parse_args(argv)
    if args.pairs is not None and args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    selected = [key.strip() for value in args.only or [",".join(GROUPS)] for key in value.split(",") if key.strip()]
    unknown = [key for key in selected if key not in GROUPS]
    if unknown:
        parser.error(f"--only: unknown row(s) {', '.join(map(repr, unknown))}; choose from {', '.join(GROUPS)}")
    args.selected = list(dict.fromkeys(selected))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    meta = _harness.environment()
    meta["mode"] = "quick" if args.quick else "full"
    started = time.perf_counter()
    rows: list[Row] = []
    failed = False
    for key in args.selected:
        group_start = time.perf_counter()
        sys.stderr.write(f"[{key}] ...\n")
        try:
            rows.extend(run_group(key, quick=args.quick, pairs=args.pairs))
        except Exception as error:  # one broken row must not hide the others
            failed = True
            traceback.print_exc()
            rows.append(Row(name=GROUPS[key][1], ratio=None, note=f"failed: {type(error).__name__}: {error}"))
        sys.stderr.write(f"[{key}] {time.perf_counter() - group_start:.0f} s\n")
    meta["seconds"] = round(time.perf_counter() - started, 1)
    header = ", ".join(f"{k} {v}" for k, v in meta.items())
    print(f"pallas_guard benchmarks ({header})")
    print("ratio = guarded / unguarded CPU time (median of interleaved pairs); wall = the same for wall-clock time")
    print(_harness.table(rows))
    if args.json:
        _harness.write_json(args.json, rows, meta)
    if failed:
        return 2
    return 1 if any(row.status == "MISS" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
