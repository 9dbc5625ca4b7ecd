"""Interpreted kernel speed: the guard's choice vs every interpreter forced by hand.

For each kernel of the test corpus (``tests/ops_corpus.py``: JAX's shipped Pallas kernels), each
mode compiles the kernel once (ahead of time, so no cache is shared between modes) and checks it
against the corpus reference; a mode that fails or is wrong is "not passing". Then the second and
later calls are timed: the guard (``interpreter=auto``) interleaved with the fastest passing forced
mode (``plain``/``tpu``/``gpu``), giving the row's ratio guard / best (target <= 1.05), plus JAX's
own ``pltpu.force_tpu_interpret_mode()`` for comparison.

Row 4b (what ``PALLAS_GUARD_CHECKS=bounds`` costs) is ``benchmarks/bounds.py``.

``rows(quick=...)`` is what ``benchmarks/run.py`` calls; ``python benchmarks/kernels.py`` prints
the table (and forces 4 host devices so the multi-device all-gather kernel runs too).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before jax starts its CPU backend
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, Sample, Stopwatch, interleave  # noqa: E402

FORCED = ("plain", "tpu", "gpu")
TARGET = 1.05


@contextlib.contextmanager
def _mode(mode: str, device: str | None = None) -> Iterator[None]:
    """``guard``: the guard, choosing; ``bounds``: the guard with ``checks="bounds"``;
    ``plain``/``tpu``/``gpu``: that interpreter forced for every kernel; ``jax-tpu``: JAX's own
    ``force_tpu_interpret_mode()`` with the guard off. ``device``: the guard's device setting."""
    import pallas_guard

    if mode == "jax-tpu":
        from jax.experimental.pallas import tpu as pltpu

        pallas_guard.uninstall()
        with pltpu.force_tpu_interpret_mode():
            yield
        return
    interpreter = "auto" if mode in ("guard", "bounds") else mode
    checks = "bounds" if mode == "bounds" else "none"
    pallas_guard.install("interpret", interpreter=interpreter, checks=checks, device=device)
    try:
        yield
    finally:
        pallas_guard.uninstall()


def _compile(case: Any, mode: str) -> tuple[Callable[[], Any] | None, str]:
    """The case compiled under ``mode`` and checked: (callable, "") or (None, why it does not pass)."""
    import jax
    from ops_corpus import check

    module = case.op_module()
    inputs = case.inputs()
    jax.clear_caches()  # the ops are jitted themselves: their traces must not leak between modes
    try:
        with _mode(mode, case.device), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bounds: "much slower than plain", which is what this measures
            compiled = jax.jit(lambda *a: case.call(module, *a)).lower(*inputs).compile()
        check(case, jax.block_until_ready(compiled(*inputs)))
    except Exception as error:  # a mode that cannot run this kernel: recorded, not raised
        return None, f"{type(error).__name__}"
    return (lambda: jax.block_until_ready(compiled(*inputs))), ""


def _compile_choosing(case: Any, mode: str) -> tuple[Callable[[], Any] | None, str, str]:
    """As :func:`_compile` for a mode under the guard, with the interpreters it chose ("/"-joined)."""
    import pallas_guard

    pallas_guard.clear_decisions()
    compiled, why = _compile(case, mode)
    chosen = {str(d.interpreter) for d in pallas_guard.decisions() if d.action == "interpreted"}
    pallas_guard.clear_decisions()
    return compiled, why, "/".join(sorted(chosen))


def _timed(function: Callable[[], Any], repeats: int = 1) -> Callable[[], Sample]:
    def run() -> Sample:
        with Stopwatch() as watch:
            for _ in range(repeats):
                function()
        return Sample(watch.sample.wall / repeats, watch.sample.cpu / repeats)

    return run


def _repeats(function: Callable[[], Any], at_least: float = 0.05) -> int:
    """Calls per sample so that one sample lasts ``at_least`` seconds: sub-ms kernels are noise otherwise."""
    one = max(_timed(function)().wall, 1e-6)
    return max(1, min(1000, int(at_least / one) + 1))


def _median_seconds(function: Callable[[], Any], repeats: int) -> float:
    function()  # the second call
    timed = _timed(function, _repeats(function))
    samples = [timed().cpu for _ in range(repeats)]
    return statistics.median(samples)


QUICK_CASES = frozenset({"gpu.softmax", "tpu.example_kernel.double"})


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    """One row per corpus kernel any interpreter can run: guard / best passing forced mode."""
    import jax
    from ops_corpus import cases

    import pallas_guard

    pairs = pairs or (3 if quick else 7)
    result: list[Row] = []
    # --quick: one kernel of each family keeps the row under a minute (compiling every kernel in
    # every mode, TPU interpret mode above all, is what takes the time).
    selected = [case for case in cases() if not quick or case.name in QUICK_CASES]
    was_installed = pallas_guard._surfaces.install.status().requested
    for case in selected:
        if case.xfail or case.skip_reason():
            continue
        name = f"kernels: {case.name}"
        if case.devices > len(jax.devices("cpu")):
            result.append(
                Row(name, None, TARGET, note=f"needs {case.devices} CPU devices: python benchmarks/kernels.py")
            )
            continue
        guard, why, chosen = _compile_choosing(case, "guard")
        forced = {mode: _compile(case, mode) for mode in FORCED}
        jax_tpu, _ = _compile(case, "jax-tpu")
        passing = {mode: fn for mode, (fn, _) in forced.items() if fn is not None}
        if guard is None or not passing:
            result.append(
                Row(name, None, TARGET, note=f"guard: {why or 'ok'}; passing forced modes: {sorted(passing)}")
            )
            continue
        seconds = {mode: _median_seconds(fn, 3 if quick else 5) for mode, fn in passing.items()}
        best = min(seconds, key=seconds.__getitem__)
        repeats = _repeats(guard)
        comparison = interleave(_timed(guard, repeats), _timed(passing[best], repeats), pairs=pairs)
        times = ", ".join(
            f"{mode} {seconds[mode] * 1e3:.1f} ms" if mode in seconds else f"{mode} fails ({forced[mode][1]})"
            for mode in FORCED
        )
        jax_tpu_text = f"{_median_seconds(jax_tpu, 3) * 1e3:.1f} ms" if jax_tpu is not None else "fails"
        result.append(
            Row(
                name,
                comparison.ratio("cpu"),
                TARGET,
                spread=comparison.spread("cpu"),
                wall_ratio=comparison.ratio("wall"),
                pairs=pairs,
                detail=(
                    f"guard chose {chosen} "
                    f"{comparison.median('a') * 1e3:.1f} ms; best forced: {best}; {times}; "
                    f"force_tpu_interpret_mode {jax_tpu_text}"
                ),
            )
        )
    pallas_guard._vocabulary.settings.reset()  # the interpreters and checks the modes pinned: rows after see none
    if was_installed:
        pallas_guard.install()
    return result


def main() -> int:
    import pallas_guard

    pallas_guard.uninstall()
    quick = "--quick" in sys.argv
    table = rows(quick=quick)
    print(f"{'kernel':42} {'guard/best':>10} {'target':>6}  detail")
    for row in table:
        ratio = f"{row.ratio:.3f}" if row.ratio is not None else "n/a"
        target = "-" if row.target is None else row.target
        print(f"{row.name.removeprefix('kernels: '):42} {ratio:>10} {target:>6}  {row.detail or row.note}")
    return 0 if all(row.status != "MISS" for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
