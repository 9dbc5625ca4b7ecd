"""Row 4i: the race check in the plain interpretation, first call and steady calls vs unchecked.

Kernels with DMAs: JAX's paged attention (``tests/ops_corpus.py``), the DMA kernels of
``tests/tpu_corpus.py`` that ran on a TPU v5e (their outputs checked against the chip's), and the
valid kernels of ``tests/race_corpus.py`` (manual pipelines, prefetch across grid steps,
``pl.run_scoped`` buffers). A first call is row 4f's (JAX's caches cleared, the guard installed
afresh, the kernel built and called once); variants per round, the order rotated: ``none``,
``races``, and ``races,bounds,compile`` (the set a CI job would leave on). Steady calls: one jitted
call of the kernel, timed over repeated calls after its first, checked vs unchecked. Targets
(medians over the kernels): races first call <= 1.5x, steady <= 1.5x; races,bounds,compile first call
<= 2x; races first call on the kernels whose DMAs cross grid steps (followed step by step while
lowering, or by the check's table at run time) <= 2x.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Comparison, Row, Sample, Stopwatch, table  # noqa: E402
from checks import DEVICE, _first_call, _median_row, _why  # noqa: E402
from first_call import FirstCall  # noqa: E402

FIRST_TARGET, STEADY_TARGET, CI_SET_TARGET, CROSSING_TARGET = 1.5, 1.5, 2.0, 2.0
CI_SET = "races,bounds,compile"
VARIANTS = ("none", "races", CI_SET)
OPS_CASES = ("tpu.paged_attention",)
QUICK = frozenset({"tpu.paged_attention", "tpu_corpus.dma.double_buffer", "race_corpus.valid.double_buffer_fori"})
STEADY_CALLS = 20


def _kernels(names: frozenset[str] | None) -> list[FirstCall]:
    import race_corpus
    from ops_corpus import cases, check
    from tpu_values import check as tpu_check
    from tpu_values import recorded

    kernels = []
    for case in cases():
        if case.name in OPS_CASES and (names is None or case.name in names) and not case.skip_reason():
            inputs = case.inputs()
            kernels.append(
                FirstCall(
                    case.name,
                    lambda case=case, inputs=inputs: case.call(case.op_module(), *inputs),
                    lambda out, case=case: check(case, out),
                    DEVICE,
                )
            )
    for case, record in recorded():
        name = f"tpu_corpus.{case.name}"
        if case.name.startswith("dma.") and (names is None or name in names):
            inputs = case.inputs()
            kernels.append(
                FirstCall(name, lambda case=case, inputs=inputs: case.build()(*inputs), tpu_check(case, record), DEVICE)
            )
    for race_case in race_corpus.CASES:
        name = f"race_corpus.{race_case.name}"
        if race_case.kind is None and not race_case.detector.startswith("error") and (names is None or name in names):
            kernels.append(FirstCall(name, lambda c=race_case: _call(c), lambda out: None, DEVICE))
    return kernels


def _call(case: Any) -> Any:
    fn, args = case.build(None)
    return fn(*args)


def _steady(kernel: FirstCall, checks: str) -> Sample:
    """``STEADY_CALLS`` calls of the kernel, jitted, after its first (its compile), under ``checks``."""
    import jax

    import pallas_guard

    jax.clear_caches()
    pallas_guard.uninstall()
    pallas_guard.install("interpret", checks=checks, max_steps=None, device=kernel.device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call = jax.jit(kernel.call)
            jax.block_until_ready(call())
            with Stopwatch() as watch:
                for _ in range(STEADY_CALLS):
                    jax.block_until_ready(call())
    finally:
        pallas_guard.uninstall()
    return watch.sample


def _followed_by_table(kernel: FirstCall, *, steps: bool = True) -> bool:
    """Whether the race check follows the kernel's DMAs with its table at run time; with ``steps``
    off (the grid not followed step by step while lowering), whether its DMAs are in flight across
    a grid step or a loop iteration, which tracing one step cannot decide."""
    import jax

    import pallas_guard
    from pallas_guard._checks import dma_races

    tables: list[object] = []

    class Counted(dma_races.Evaluator):  # type: ignore[misc]
        def __init__(self, *args: Any) -> None:
            tables.append(self)
            super().__init__(*args)

    original, stepping = dma_races.Evaluator, dma_races.FOLLOW_STEPS
    dma_races.Evaluator, dma_races.FOLLOW_STEPS = Counted, steps
    jax.clear_caches()
    pallas_guard.uninstall()
    pallas_guard.install("interpret", checks="races", max_steps=None, device=kernel.device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.block_until_ready(kernel.call())
    finally:
        dma_races.Evaluator, dma_races.FOLLOW_STEPS = original, stepping
        pallas_guard.uninstall()
    return bool(tables)


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    rounds = pairs or (1 if quick else 3)
    kernels = _kernels(QUICK if quick else None)
    first: dict[str, dict[str, float]] = {"races": {}, CI_SET: {}}
    steady: dict[str, float] = {}
    crossing: set[str] = set()
    by_table: set[str] = set()
    result: list[Row] = []
    for kernel in kernels:
        sys.stderr.write(f"  4i. {kernel.name}\n")
        try:
            if _followed_by_table(kernel, steps=False):
                crossing.add(kernel.name)
                if _followed_by_table(kernel):
                    by_table.add(kernel.name)
        except Exception:  # the timed calls below report the failure
            pass
        samples: dict[str, list[Sample]] = {v: [] for v in VARIANTS}
        steady_samples: dict[str, list[Sample]] = {"none": [], "races": []}
        try:
            for index in range(rounds):
                order = VARIANTS[index % 3 :] + VARIANTS[: index % 3]
                for variant in order:
                    samples[variant].append(_first_call(kernel, variant))
                for variant in ("none", "races") if index % 2 == 0 else ("races", "none"):
                    steady_samples[variant].append(_steady(kernel, variant))
        except Exception as error:  # reported, and left out of the medians
            result.append(Row(f"4i. races: {kernel.name}", None, check=False, note=f"fails: {_why(error)}"))
            continue
        compared = {v: Comparison(samples[v], samples["none"]) for v in ("races", CI_SET)}
        steady_compared = Comparison(steady_samples["races"], steady_samples["none"])
        for variant, comparison in compared.items():
            first[variant][kernel.name] = comparison.ratio("cpu")
        steady[kernel.name] = steady_compared.ratio("cpu")
        base = compared["races"].median("b") * 1e3
        result.append(
            Row(
                f"4i. races first call: {kernel.name}",
                compared["races"].ratio("cpu"),
                spread=compared["races"].spread("cpu"),
                pairs=rounds,
                detail=(
                    f"none {base:.0f} ms; {CI_SET} {compared[CI_SET].ratio('cpu'):.2f}; "
                    f"steady {steady[kernel.name]:.2f} ({STEADY_CALLS} calls)"
                    + (f"; DMAs across steps: {_how(kernel.name, by_table)}" if kernel.name in crossing else "")
                ),
            )
        )
    result.append(_median_row("4i. races first call: median over the DMA kernels", first["races"], FIRST_TARGET, ""))
    across = {name: ratio for name, ratio in first["races"].items() if name in crossing}
    result.append(
        _median_row(
            "4i. races first call: median over the kernels whose DMAs cross grid steps",
            across,
            CROSSING_TARGET,
            "DMAs in flight across a grid step or loop iteration: followed step by step while lowering where"
            " program ids and loop counters place them, else by the table at run time",
        )
    )
    result.append(_median_row("4i. races steady calls: median over the DMA kernels", steady, STEADY_TARGET, ""))
    result.append(
        _median_row(f"4i. {CI_SET} first call: median over the DMA kernels", first[CI_SET], CI_SET_TARGET, "")
    )
    return result


def _how(name: str, by_table: set[str]) -> str:
    return "the table" if name in by_table else "followed step by step"


def main() -> None:
    print(table(rows(quick="--quick" in sys.argv)))


if __name__ == "__main__":
    main()
