"""Row 4f: the first call of a kernel with ``checks=all`` vs with none.

``all`` is every check but ``agree``; ``all,agree`` (every check) is timed beside it.

Each sample is one first call, as in row 4c: JAX's caches cleared, the guard installed afresh
(policy ``interpret``, its settled choices forgotten), no compile kept on disk (each call gets an
empty ``XDG_CACHE_HOME``: a verdict an earlier call or run kept would spare the compile check its
libtpu compile), the kernel built and called once, its result checked. Kernels: the test corpus
(``tests/ops_corpus.py``, as row 4c calls it) and a few Mosaic-TPU kernels of ``tests/tpu_corpus.py``
that ran on a TPU v5e, called eagerly with the device setting ``tpu-v5e``, their outputs checked
against the chip's. Per kernel, nine variants run in one round,
in an order that rotates from round to round: ``none``, ``all``, ``all,agree``, ``all`` less
``races`` and each check alone; each round's ratio is a variant's time over that round's
``none``. Target: the median over the kernels of ``all`` / ``none`` <= 1.5, reported by kernel
family as well. ``all`` less ``races`` and each check alone are reported beside it, so the table
shows where the time goes.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Comparison, Row, Sample, Stopwatch, table  # noqa: E402
from first_call import FirstCall  # noqa: E402

MEDIAN_TARGET = 1.5
ALL = "all"
EVERY = "all,agree"
WITHOUT_RACES = "bounds,lowering,compile"
DEVICE = "tpu-v5e"
"""The corpus's own kernels run with the device they were recorded on: most use nothing only a
Mosaic-TPU kernel has, and a generic kernel is lowered and compiled for a TPU only where one is set."""
ALONE = ("races", "bounds", "agree", "lowering", "compile")
VARIANTS = ("none", ALL, EVERY, WITHOUT_RACES, *ALONE)
TPU_CASES = ("matmul.small_8x8", "prim.transcendental", "index.prefetch_gather", "dma.double_buffer", "control.when")
"""Mosaic-TPU kernels of tests/tpu_corpus.py: a dot, the TPU's transcendentals, scalar prefetch, DMAs
and semaphores, pl.when over a grid; each runs in well under a second."""
QUICK = frozenset(
    {"gpu.softmax", "gpu.layer_norm", "tpu.megablox.gmm", "tpu.matmul", "tpu_corpus.index.prefetch_gather"}
)
"""Kernels whose checks cost little (Triton) and much (Mosaic-TPU, in TPU interpret mode), mixed as in
the whole corpus, so that the quick median lands near the full one."""
WARM = ("tpu.example_kernel.double", "gpu.softmax")
"""Cheap kernels (one per family) run once in every variant before timing: the checks' modules and
interpreters are imported once per process, which would otherwise fall on the first kernel timed."""


def _corpus(names: frozenset[str] | None) -> list[FirstCall]:
    """Row 4c's corpus kernels (``first_call._corpus``), inputs built only for those asked for."""
    import jax
    from ops_corpus import cases, check

    calls = []
    for case in cases():
        if names is not None and case.name not in names:
            continue
        if case.xfail or case.skip_reason() or case.devices > len(jax.devices("cpu")):
            continue
        inputs = case.inputs()

        def call(case: Any = case, inputs: Any = inputs) -> Any:
            return case.call(case.op_module(), *inputs)

        calls.append(FirstCall(case.name, call, lambda out, case=case: check(case, out), case.device))
    return calls


def _tpu_kernels(names: frozenset[str] | None) -> list[FirstCall]:
    from tpu_values import check, recorded

    calls = []
    for case, record in recorded():
        name = f"tpu_corpus.{case.name}"
        if case.name not in TPU_CASES or (names is not None and name not in names):
            continue
        inputs = case.inputs()

        def call(case: Any = case, inputs: Any = inputs) -> Any:
            return case.build()(*inputs)

        calls.append(FirstCall(name, call, check(case, record), DEVICE))
    return calls


def _first_call(kernel: FirstCall, checks: str, kept: str | None = None) -> Sample:
    """One first call with ``checks``: JAX's caches and the guard's choices cleared, and no compile
    kept on disk (an empty ``XDG_CACHE_HOME``: the compile check's libtpu compiles the kernel), or
    those an earlier call kept in ``kept`` (a CI job whose cache folder is restored)."""
    import jax

    import pallas_guard

    cache_home = os.environ.get("XDG_CACHE_HOME")
    jax.clear_caches()
    pallas_guard.uninstall()  # forgets the settled choices, lowerings and compiles
    pallas_guard.install("interpret", checks=checks, max_steps=None, device=kernel.device)
    try:
        with tempfile.TemporaryDirectory(prefix="pallas_guard-bench-") as empty:
            os.environ["XDG_CACHE_HOME"] = kept or empty
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Stopwatch() as watch:
                    out = jax.block_until_ready(kernel.call())
            kernel.check(out)
    finally:
        pallas_guard.uninstall()
        if cache_home is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = cache_home
    return watch.sample


def _why(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160] if lines else ''}"


def _rounds(kernel: FirstCall, rounds: int) -> tuple[dict[str, Comparison], dict[str, str]]:
    """Every variant once per round, the order rotated and reversed from round to round so that
    none always runs first or next to ``none``; a variant that fails is dropped (its reason kept)."""
    samples: dict[str, list[Sample]] = {variant: [] for variant in VARIANTS}
    failed: dict[str, str] = {}
    for index in range(rounds):
        shift = index % len(VARIANTS)
        order = [*VARIANTS[shift:], *VARIANTS[:shift]]
        for variant in order if index % 2 == 0 else reversed(order):
            if variant in failed:
                continue
            try:
                samples[variant].append(_first_call(kernel, variant))
            except Exception as error:  # one variant failing must not hide the others
                failed[variant] = _why(error)
    if "none" in failed:
        return {}, failed
    baseline = samples["none"]
    return {v: Comparison(s, baseline) for v, s in samples.items() if v != "none" and v not in failed}, failed


FAMILIES = ("Triton", "Mosaic-TPU", "Mosaic-GPU")


def _family(name: str) -> str:
    """The kernel family a corpus kernel belongs to, by its name in the corpus."""
    if name.startswith("gpu."):
        return "Mosaic-GPU" if name.endswith("_mgpu") else "Triton"
    return "Mosaic-TPU"


def _median_row(name: str, ratios: dict[str, float], target: float | None, note: str) -> Row:
    values = list(ratios.values())
    worst = max(ratios, key=lambda k: ratios[k]) if ratios else None
    return Row(
        name,
        statistics.median(values) if values else None,
        target,
        spread=None,
        pairs=len(values),
        detail=f"worst {ratios[worst]:.3f} ({worst})" if worst else "",
        note=note,
    )


def _family_rows(title: str, ratios: dict[str, float]) -> list[Row]:
    """``title`` (``4f. checks=all first call``)'s median over each kernel family's kernels."""
    rows = []
    for family in FAMILIES:
        of_family = {name: ratio for name, ratio in ratios.items() if _family(name) == family}
        if of_family:
            rows.append(_median_row(f"{title}: median over the {family} kernels", of_family, None, "n = kernels"))
    return rows


@contextlib.contextmanager
def restored_guard() -> Iterator[None]:
    """The guard as the benchmark found it once the block is done (rows install and uninstall it)."""
    import pallas_guard

    was_installed = pallas_guard._surfaces.install.status().requested
    try:
        yield
    finally:
        pallas_guard._vocabulary.settings.reset()
        pallas_guard.uninstall()
        if was_installed:
            pallas_guard.install()


def _warm(kernels: list[FirstCall]) -> str:
    """Runs each variant once on the cheap kernels and makes the TPU compiler's topology, untimed
    (a process pays both once); says how long the topology took."""
    from pallas_guard._running import tpu_compile as _tpu_compile

    note = ""
    if _tpu_compile.available() is None:
        start = time.perf_counter()
        device = _tpu_compile.topology_device("tpu-v5e")
        if not isinstance(device, str):
            note = f"the TPU topology, made once per process before timing: {time.perf_counter() - start:.1f} s"
    for kernel in kernels:
        if kernel.name in WARM:
            for variant in VARIANTS:
                with contextlib.suppress(Exception):  # reported where the kernel is timed
                    _first_call(kernel, variant)
    return note


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    with restored_guard():
        return _rows(quick, pairs)


def _rows(quick: bool, pairs: int | None) -> list[Row]:
    rounds = pairs or (1 if quick else 3)
    names = QUICK | frozenset(WARM) if quick else None
    kernels = [*_corpus(names), *_tpu_kernels(names)]
    warm_note = _warm(kernels)
    if quick:
        kernels = [k for k in kernels if k.name in QUICK]
    result: list[Row] = []
    medians: dict[str, dict[str, float]] = {variant: {} for variant in VARIANTS if variant != "none"}
    failures: dict[str, list[str]] = {variant: [] for variant in medians}
    for kernel in kernels:
        sys.stderr.write(f"  4f. {kernel.name}\n")
        compared, failed = _rounds(kernel, rounds)
        for variant in failed:
            if variant != "none":
                failures[variant].append(kernel.name)
        for variant, comparison in compared.items():
            medians[variant][kernel.name] = comparison.ratio("cpu")
        name = f"4f. checks=all first call: {kernel.name}"
        if "none" in failed:
            result.append(Row(name, None, note=f"fails without checks: {failed['none']}"))
            continue
        others = ", ".join(
            f"{variant} {compared[variant].ratio('cpu'):.2f}" if variant in compared else f"{variant} fails"
            for variant in (EVERY, WITHOUT_RACES, *ALONE)
        )
        base = compared[next(iter(compared))].median("b") * 1e3 if compared else 0.0
        if ALL in failed:
            result.append(
                Row(
                    name,
                    None,
                    check=False,
                    pairs=rounds,
                    detail=f"none {base:.0f} ms; vs none: {others}",
                    note=f"fails with checks=all: {failed[ALL]}",
                )
            )
            continue
        comparison = compared[ALL]
        result.append(
            Row(
                name,
                comparison.ratio("cpu"),
                spread=comparison.spread("cpu"),
                wall_ratio=comparison.ratio("wall"),
                pairs=rounds,
                detail=f"all {comparison.median('a') * 1e3:.0f} ms vs none {base:.0f} ms; vs none: {others}",
            )
        )

    def failing(variant: str) -> str:
        return f"; fails on {', '.join(failures[variant])} (not in the median)" if failures[variant] else ""

    everything = _median_row(
        "4f. checks=all first call: median over the kernels, vs checks=none",
        medians[ALL],
        MEDIAN_TARGET,
        "n = kernels" + failing(ALL) + (f"; {warm_note}" if warm_note else ""),
    )
    without = medians[WITHOUT_RACES]
    verdict = ""
    if without:
        met = statistics.median(without.values()) <= MEDIAN_TARGET
        verdict = f"; against the same {MEDIAN_TARGET:.1f}: {'would pass' if met else 'would MISS'}"
    result.append(everything)
    result.extend(_family_rows("4f. checks=all first call", medians[ALL]))
    result.append(
        _median_row(
            f"4f. checks=all minus races ({WITHOUT_RACES}): median over the kernels",
            without,
            None,
            "n = kernels" + verdict + failing(WITHOUT_RACES),
        )
    )
    result.append(
        _median_row(
            f"4f. checks={EVERY} (every check) first call: median over the kernels",
            medians[EVERY],
            None,
            "n = kernels; agree, asked for by name, runs a second interpreter: TPU interpret mode on a "
            "Mosaic-TPU kernel" + failing(EVERY),
        )
    )
    for check in ALONE:
        result.append(
            _median_row(
                f"4f. breakdown: checks={check} alone vs none, median over the kernels",
                medians[check],
                None,
                "n = kernels" + failing(check),
            )
        )
    return result


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(table(rows(quick="--quick" in sys.argv)))
