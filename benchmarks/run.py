"""One entry point for the benchmarks that show the guard is free.

    python benchmarks/run.py [--quick] [--json out.json] [--only startup,trace,...]

Prints one table; each row is a ratio guarded / unguarded with its median and spread over
repeated interleaved runs (A B, B A, ...), its target and pass/MISS. Absolute times vary between
machines and runs; the ratios are what to compare. ``--quick`` (under 2 minutes on 2 cores) is
for before every change; the full run takes under 15 minutes.

Exit status: 0 when every row with a target passes, 1 when one misses, 2 when one failed to run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

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
    "steady": ("steady", "5. steady: jitted fn with a guarded kernel vs interpret=True"),
}
# The public function a benchmark module exposes, by the names the helpers may have used.
_ROW_FUNCTIONS = ("rows", "run", "benchmark", "bench")


def _load(module_name: str) -> ModuleType | None:
    """``benchmarks/<module_name>.py``, loaded by path (``trace`` is also a stdlib name); None if absent."""
    path = BENCH_DIR / f"{module_name}.py"
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _row_function(module: ModuleType) -> Callable[..., Any] | None:
    for name in _ROW_FUNCTIONS:
        function = getattr(module, name, None)
        if callable(function):
            return function  # type: ignore[no-any-return]
    return None


def _call(function: Callable[..., Any], quick: bool, pairs: int | None) -> Any:
    try:
        parameters = set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        parameters = set()
    kwargs: dict[str, Any] = {}
    if "quick" in parameters:
        kwargs["quick"] = quick
    if pairs is not None and "pairs" in parameters:
        kwargs["pairs"] = pairs
    return function(**kwargs)


def _as_rows(result: Any, group: str) -> list[Row]:
    if result is None:
        return []
    if isinstance(result, Row | dict) or not isinstance(result, list | tuple):
        result = [result]
    return [Row.coerce(item, group=group) for item in result]


# --- row 1 fallback, used until benchmarks/startup.py exists -------------------------------------

_PTH_NAME = "pallas_guard_autoload.pth"


def _autoload_pth() -> Path | None:
    import site

    directories = [*site.getsitepackages(), site.getusersitepackages()]
    return next((Path(d) / _PTH_NAME for d in directories if (Path(d) / _PTH_NAME).is_file()), None)


def startup_fallback_rows(*, quick: bool, pairs: int | None = None) -> list[Row]:
    """Row 1 without benchmarks/startup.py: fresh ``python -c`` interpreters, interleaved."""
    pairs = pairs or (40 if quick else 200)
    plain_env = _harness.clean_env()
    guard_env = _harness.clean_env({"PALLAS_GUARD_POLICY": "interpret"})
    pth = _autoload_pth()
    rows = []
    if pth is not None:
        activated = ("-c", "pass")
        what = f"the .pth autoload ({pth.name})"
    else:
        activated = ("-c", "import pallas_guard")  # what the .pth line does once installed
        what = "import pallas_guard (no .pth autoload installed here)"
    comparison = _harness.interleave(
        lambda: _harness.time_python(activated, guard_env),
        lambda: _harness.time_python(("-c", "pass"), plain_env),
        pairs=pairs,
        warmup=3,
        progress="startup",
    )
    rows.append(
        Row.from_comparison(
            "1. startup: python -c pass, PALLAS_GUARD_POLICY set vs unset",
            comparison,
            target=1.02,
            group="startup",
            note=f"activated by {what}",
        )
    )
    comparison = _harness.interleave(
        lambda: _harness.time_python(("-c", "import pallas_guard"), guard_env),
        lambda: _harness.time_python(("-c", "pass"), plain_env),
        pairs=max(1, pairs // 2),
        warmup=2,
        progress="import pallas_guard",
    )
    rows.append(
        Row.from_comparison(
            '1b. python -c "import pallas_guard" vs python -c pass', comparison, target=None, group="startup"
        )
    )
    modules = _harness.imported_modules(activated, guard_env)
    heavy = sorted({m for m in modules if m.split(".")[0] in {"jax", "jaxlib", "wrapt", "numpy"}})
    ours = [m for m in modules if m.split(".")[0] == "pallas_guard"]
    rows.append(
        Row(
            name="1c. -X importtime: jax/wrapt imported at startup with the guard active",
            ratio=None,
            check=not heavy and bool(ours),
            group="startup",
            note=(
                f"{len(modules)} modules imported, {len(ours)} of them pallas_guard's; "
                + (f"heavy: {', '.join(heavy)}" if heavy else "none of jax, jaxlib, wrapt, numpy")
            ),
        )
    )
    return rows


# --- the run ------------------------------------------------------------------------------------


def run_group(key: str, *, quick: bool, pairs: int | None = None) -> list[Row]:
    module_name, title = GROUPS[key]
    module = _load(module_name)
    if module is None:
        if key == "startup":
            return startup_fallback_rows(quick=quick, pairs=pairs)
        return [Row.unavailable(title, f"benchmarks/{module_name}.py does not exist yet", group=key)]
    function = _row_function(module)
    if function is None:
        names = " or ".join(f"{name}(quick=...)" for name in _ROW_FUNCTIONS)
        return [Row.unavailable(title, f"benchmarks/{module_name}.py has no {names}", group=key)]
    return _as_rows(_call(function, quick, pairs), key)


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
