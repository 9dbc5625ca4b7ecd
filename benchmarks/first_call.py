"""Row 4c: the first call of a kernel (build, trace, verify, compile, run), guard vs best forced.

Each sample is one first call: JAX's caches cleared and the guard installed afresh (its settled
choices forgotten), then the kernel built and called once, its result checked. The guard
(``interpreter=auto``: it verifies where a kernel's facts leave the choice open) is interleaved with
the interpreter that runs the kernel's first call fastest when forced by hand (``plain``/``tpu``/
``gpu``, no verification). Kernels: the test corpus (``tests/ops_corpus.py``: JAX's shipped kernels,
jitted ops) and Mosaic-TPU kernels of our own that need verification, called eagerly and under
``jax.jit``. Targets: each kernel <= 1.25, the median over them <= 1.10.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, Sample, Stopwatch, interleave  # noqa: E402

FORCED = ("plain", "tpu", "gpu")
EACH_TARGET = 1.25
MEDIAN_TARGET = 1.10
MEDIAN_ROW = "4c. first call: median over the kernels, guard vs best forced"
QUICK = frozenset({"gpu.softmax", "tpu.example_kernel.double", "tpu.matmul", "own.dma_copy (eager)"})


@dataclass(frozen=True)
class FirstCall:
    name: str
    call: Callable[[], Any]
    """Builds the kernel and calls it once (no ``interpret=`` anywhere)."""
    check: Callable[[Any], None]
    device: str | None = None
    """The guard's device setting (host code that asks which GPU/TPU it runs on)."""


def _own_kernels() -> list[FirstCall]:
    """Mosaic-TPU kernels the guard verifies (their facts leave plain vs TPU interpret mode open)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def dma_copy(x_hbm, o_hbm, buffer, sem):  # type: ignore[no-untyped-def]
        pltpu.make_async_copy(x_hbm, buffer, sem).start()
        pltpu.make_async_copy(x_hbm, buffer, sem).wait()
        buffer[...] = buffer[...] * 2
        pltpu.make_async_copy(buffer, o_hbm, sem).start()
        pltpu.make_async_copy(buffer, o_hbm, sem).wait()

    x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)

    def build_dma() -> Callable[..., Any]:
        return pl.pallas_call(
            dma_copy,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
        )

    def blocked(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = jnp.tanh(x_ref[...]) + pl.program_id(0).astype(jnp.float32)

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

    def build_blocked() -> Callable[..., Any]:
        return pl.pallas_call(
            blocked,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(8,),
            in_specs=[spec],
            out_specs=spec,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        )

    def looped(x_ref, o_ref):  # type: ignore[no-untyped-def]
        total = jax.lax.fori_loop(0, 4, lambda i, acc: acc + pl.program_id(0), 0)  # plain cannot lower it
        o_ref[...] = x_ref[...] + total.astype(jnp.float32)

    def build_looped() -> Callable[..., Any]:
        return pl.pallas_call(
            looped, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,), in_specs=[spec], out_specs=spec
        )

    doubled = np.asarray(x) * 2
    rows = np.arange(64) // 8
    tanh_plus = np.tanh(np.asarray(x)) + rows[:, None]
    looped_out = np.asarray(x) + 4 * rows[:, None]

    def close(expected: Any) -> Callable[[Any], None]:
        return lambda out: np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)

    return [
        FirstCall("own.dma_copy (eager)", lambda: build_dma()(x), close(doubled)),
        FirstCall("own.dma_copy (jit)", lambda: jax.jit(build_dma())(x), close(doubled)),
        FirstCall("own.blocked_tpu_params (jit)", lambda: jax.jit(build_blocked())(x), close(tanh_plus)),
        FirstCall("own.program_id_in_loop (eager)", lambda: build_looped()(x), close(looped_out)),
    ]


def _corpus() -> list[FirstCall]:
    import jax
    from ops_corpus import cases, check

    calls = []
    for case in cases():
        if case.xfail or case.skip_reason() or case.devices > len(jax.devices("cpu")):
            continue
        inputs = case.inputs()

        def call(case: Any = case, inputs: Any = inputs) -> Any:
            return case.call(case.op_module(), *inputs)

        calls.append(FirstCall(case.name, call, lambda out, case=case: check(case, out), case.device))
    return calls


def _first_call(kernel: FirstCall, interpreter: str) -> Sample:
    """One first call with ``interpreter`` (``auto``: the guard chooses): caches and choices cleared."""
    import jax

    import pallas_guard

    jax.clear_caches()
    pallas_guard.uninstall()  # forgets the settled choices
    pallas_guard.install("interpret", interpreter=interpreter, checks="none", max_steps=None, device=kernel.device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Stopwatch() as watch:
                out = jax.block_until_ready(kernel.call())
        kernel.check(out)
    finally:
        pallas_guard.uninstall()
    return watch.sample


def _passes(kernel: FirstCall, interpreter: str) -> Sample | None:
    try:
        return _first_call(kernel, interpreter)
    except Exception:  # an interpreter that cannot run this kernel (or gets it wrong) is no candidate
        return None


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    import pallas_guard

    pairs = pairs or (3 if quick else 7)
    was_installed = pallas_guard._surfaces.install.status().requested
    kernels = [k for k in (*_corpus(), *_own_kernels()) if not quick or k.name in QUICK]
    result: list[Row] = []
    ratios: list[float] = []
    for kernel in kernels:
        name = f"4c. first call: {kernel.name}"
        guard = _passes(kernel, "auto")
        forced = {mode: _passes(kernel, mode) for mode in FORCED}
        passing = {mode: sample for mode, sample in forced.items() if sample is not None}
        if guard is None or not passing:
            result.append(Row(name, None, EACH_TARGET, note=f"guard runs it: {guard is not None}; forced: {passing}"))
            continue
        best = min(passing, key=lambda mode: passing[mode].cpu)
        comparison = interleave(
            lambda kernel=kernel: _first_call(kernel, "auto"),
            lambda kernel=kernel, best=best: _first_call(kernel, best),
            pairs=pairs,
            warmup=0,
        )
        ratios.append(comparison.ratio("cpu"))
        result.append(
            Row(
                name,
                comparison.ratio("cpu"),
                EACH_TARGET,
                spread=comparison.spread("cpu"),
                wall_ratio=comparison.ratio("wall"),
                pairs=pairs,
                detail=(
                    f"guard {comparison.median('a') * 1e3:.0f} ms vs {best} {comparison.median('b') * 1e3:.0f} ms; "
                    + ", ".join(
                        f"{mode} {sample.cpu * 1e3:.0f} ms" if sample else f"{mode} fails"
                        for mode, sample in forced.items()
                    )
                ),
            )
        )
    summary = statistics.median(ratios) if ratios else None
    result.append(
        Row(
            MEDIAN_ROW,
            summary,
            MEDIAN_TARGET,
            pairs=len(ratios),
            detail=f"worst {max(ratios):.3f}" if ratios else "",
            note="n = kernels",
        )
    )
    pallas_guard._vocabulary.settings.reset()
    if was_installed:
        pallas_guard.install()
    return result


if __name__ == "__main__":
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for row in rows(quick="--quick" in sys.argv):
        ratio = f"{row.ratio:.3f}" if row.ratio is not None else "n/a"
        print(f"{row.name:60} {ratio:>7}  {row.detail or row.note}")
