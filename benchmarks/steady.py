"""Row 5, steady state: a jitted function containing a guarded kernel, called many times.

A: traced with the guard installed (policy ``interpret``), the kernel written for GPU.
B: traced with the guard uninstalled, the kernel written with ``interpret=True`` by hand.
The guard acts only while tracing and lowering; after that JAX's dispatch runs the compiled
executable and the guard is not on the path, so the target is parity. The row checks that too:
no retrace and no guard decision happen during the timed calls.

One pair is ``CALLS`` calls of each (each call waited for), alternated in chunks of ``CHUNK``
(A B, B A, ...): a chunk lasts a millisecond or two, so bursts of load from other processes
land on both variants alike. The guard stays installed while both are timed, as in a process
that installed it. (Installing and uninstalling it around every chunk instead charged A with
the garbage collections its allocations trigger, ~5-10% of a 50-call chunk: an artefact of the
toggling that no program pays.)
"""

from __future__ import annotations

import sys
from typing import Any

from _harness import Comparison, Row, Sample, Stopwatch

CALLS = 1000
CHUNK = 50
TARGET = 1.01


def _total(samples: list[Sample]) -> Sample:
    return Sample(sum(s.wall for s in samples), sum(s.cpu for s in samples))


def measure(*, pairs: int, calls: int = CALLS) -> tuple[Comparison, int]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    import pallas_guard

    traces = {"guarded": 0, "by_hand": 0}

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

    def guarded_fn(x: Any, y: Any) -> Any:
        traces["guarded"] += 1
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)

    def by_hand_fn(x: Any, y: Any) -> Any:
        traces["by_hand"] += 1
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)

    guarded_jit, by_hand_jit = jax.jit(guarded_fn), jax.jit(by_hand_fn)
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)

    def loop(function: Any, count: int) -> Sample:
        with Stopwatch() as watch:
            for _ in range(count):
                function(x, x).block_until_ready()
        return watch.sample

    def guarded(count: int) -> Sample:
        return loop(guarded_jit, count)

    def by_hand(count: int) -> Sample:
        return loop(by_hand_jit, count)

    def pair() -> tuple[Sample, Sample]:
        a, b = [], []
        for chunk in range(max(1, calls // CHUNK)):
            if chunk % 2 == 0:
                a.append(guarded(CHUNK))
                b.append(by_hand(CHUNK))
            else:
                b.append(by_hand(CHUNK))
                a.append(guarded(CHUNK))
        return _total(a), _total(b)

    # Each traced and compiled once, B without the guard, as written by hand.
    pallas_guard.uninstall()
    by_hand(2)
    # Every setting named: a row run before (kernels) may have pinned checks or an interpreter.
    pallas_guard.install("interpret", interpreter="auto", checks="none")
    guarded(2)
    for _ in range(2):  # warm-up: dispatch caches
        pair()
    decisions = len(pallas_guard.decisions())
    comparison = Comparison([], [])
    for index in range(pairs):
        a, b = pair()
        comparison.a.append(a)
        comparison.b.append(b)
        sys.stderr.write(f"\r  steady: {index + 1}/{pairs} pairs")
        sys.stderr.flush()
    sys.stderr.write("\n")
    # Each function is traced exactly once, in the warm-up; a retrace would be a real cost.
    retraces = traces["guarded"] - 1 + traces["by_hand"] - 1
    retraces += len(pallas_guard.decisions()) - decisions  # the guard ran while timed
    pallas_guard.uninstall()
    pallas_guard.clear_decisions()
    return comparison, retraces


def rows(*, quick: bool, pairs: int | None = None) -> list[Row]:
    pairs = pairs or (40 if quick else 200)
    comparison, retraces = measure(pairs=pairs)
    return [
        Row.from_comparison(
            f"5. steady: jitted fn with a guarded kernel, {CALLS} calls, vs interpret=True by hand",
            comparison,
            target=TARGET,
            unit="us",
            per=CALLS,
            per_label="call",
            group="steady",
            note=f"n = pairs of {CALLS} calls each, in alternating chunks of {CHUNK}"
            + (f"; {retraces} UNEXPECTED retrace(s)/guard decision(s)" if retraces else "; no retrace"),
        )
    ]
