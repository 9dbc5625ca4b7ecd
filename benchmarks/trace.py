"""Row 3, trace overhead: build, trace and run small distinct ``pallas_call``s.

A: the guard installed with policy ``interpret``, kernels written for GPU (no ``interpret=``).
B: the guard uninstalled, the same kernels written with ``interpret=True`` by hand.

Both run in this process, interleaved kernel by kernel (A B, B A, ...): one kernel takes ~0.1 s
to trace, lower and compile, so alternating per kernel cancels the drift of a shared machine far
better than alternating per batch of 200. Every kernel is a fresh function, so nothing is served
from JAX's caches (each is traced, lowered and compiled anew, as in a test suite). The ratio is
the median over blocks of ``BLOCK`` kernels of ``sum(A) / sum(B)``; the spread is its IQR.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from _harness import Comparison, Row, Sample, Stopwatch

KERNELS = 200
BLOCK = 10
TARGET = 1.02


def _make_kernel(index: int) -> Callable[..., None]:
    scale = float(index % 7 + 1)

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * scale + y_ref[...]

    kernel.__name__ = kernel.__qualname__ = f"kernel_{index}"
    return kernel


def _shape(index: int) -> tuple[int, int]:
    # Distinct shapes too, so kernels differ in more than their constants.
    return (8, 8 * (index % 4 + 1))


def _one_kernel(index: int, *, by_hand: bool) -> Sample:
    """Seconds to build, trace, lower, compile and run kernel ``index`` once."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    x = jnp.ones(_shape(index), jnp.float32)
    kernel = _make_kernel(index)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if by_hand:

        def call(x: Any, y: Any) -> Any:
            return pl.pallas_call(kernel, out_shape=out_shape, interpret=True)(x, y)
    else:

        def call(x: Any, y: Any) -> Any:
            return pl.pallas_call(kernel, out_shape=out_shape)(x, y)

    with Stopwatch() as watch:
        jax.jit(call)(x, x).block_until_ready()
    return watch.sample


def _total(samples: list[Sample]) -> Sample:
    return Sample(sum(s.wall for s in samples), sum(s.cpu for s in samples))


def measure(*, kernels: int, passes: int, progress: bool = True) -> Comparison:
    import sys

    import pallas_guard

    def guarded(index: int) -> Sample:
        pallas_guard.install("interpret", interpreter="auto", checks="none")  # whatever a row before pinned
        try:
            return _one_kernel(index, by_hand=False)
        finally:
            pallas_guard.uninstall()

    def by_hand(index: int) -> Sample:
        return _one_kernel(index, by_hand=True)

    pallas_guard.uninstall()
    for index in range(4):  # warm-up: JAX's first compilations and lazy imports
        guarded(index)
        by_hand(index)
    blocks = Comparison([], [])
    a_block: list[Sample] = []
    b_block: list[Sample] = []
    total = kernels * passes
    gc.collect()
    gc.disable()  # collections run between blocks, outside the timed regions
    try:
        for step in range(total):
            index = step % kernels
            if step % 2 == 0:
                a_block.append(guarded(index))
                b_block.append(by_hand(index))
            else:
                b_block.append(by_hand(index))
                a_block.append(guarded(index))
            if (step + 1) % BLOCK == 0:
                blocks.a.append(_total(a_block))
                blocks.b.append(_total(b_block))
                a_block, b_block = [], []
                gc.enable()
                gc.collect()
                gc.disable()
            if progress:
                sys.stderr.write(f"\r  trace: {step + 1}/{total} kernel pairs")
                sys.stderr.flush()
    finally:
        gc.enable()
        pallas_guard.clear_decisions()
    if progress:
        sys.stderr.write("\n")
    return blocks


def rows(*, quick: bool, pairs: int | None = None) -> list[Row]:
    """``pairs``: how many blocks of kernel pairs (overrides the kernel count; one pass)."""
    kernels, passes = (100, 1) if quick else (KERNELS, 2)
    if pairs:
        kernels, passes = pairs * BLOCK, 1
    comparison = measure(kernels=kernels, passes=passes)
    return [
        Row.from_comparison(
            f"3. trace: {kernels} distinct pallas_calls built+traced+run x{passes}, guard vs interpret=True",
            comparison,
            target=TARGET,
            unit="ms",
            per=BLOCK,
            per_label="kernel",
            group="trace",
            note=f"n = blocks of {BLOCK} kernel pairs",
        )
    ]
