"""Row 4e: interpreted-kernel speed, the guard's plain interpretation vs JAX's interpreter as it ships.

Kernels of our own at 1x, 4x and 16x the data (``--quick``: 1x and 16x), each with blocks small
enough that the grid grows with the data:

- ``elementwise``: o = 2x + y on (256s, 128) float32 in blocks of 8 rows;
- ``matmul``: (64s, 256) @ (256, 128) in (32, 64) x (64, 128) blocks, the output block revisited
  and accumulated over k;
- ``row_reduce``: o[i] = sum_j x[i, j] * w[j] on (256s, 256), the weight one block shared by
  every step;
- ``gather``: blocks of 8 rows of a (256s, 128) table gathered by a scalar-prefetch index;
- ``inplace``: x += d on every other block of (512s, 128), the output aliased to x
  (``input_output_aliases``; the blocks the grid never visits keep x's values).

And each kernel of the corpus (``tests/ops_corpus.py``) that the guard runs in the plain
interpreter, at the corpus shapes only: the corpus builds its inputs at fixed shapes (head counts,
page tables, block sizes tied to them), which do not scale by one factor.

Three variants, each compiled once ahead of time under ``jax.jit`` (steady state), then timed:
the guard (policy ``interpret``, default settings, no ``interpret=``); JAX's own interpreter
forced by hand (our kernels: ``interpret=True`` with the guard uninstalled; the corpus, whose ops
take no ``interpret=``: the guard with ``interpreter="plain", fast_plain=False``, which runs JAX's
interpreter as it ships); and a ``jax.numpy`` reference of the same math. Guard vs JAX and guard
vs reference are interleaved pairs (A B, B A, ...) in one process. The outputs of the guard and of
JAX's interpreter are compared byte for byte in the run; a difference is a MISS.

Targets: guard / JAX <= 1.05 for every kernel and size; the median at 16x <= 0.10; the guard's
time from 1x to 16x grows <= 20x for every kernel; guard / reference median <= 3 (over every
kernel and size measured).
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

from _harness import Row, interleave  # noqa: E402
from kernels import _repeats, _timed  # noqa: E402

EACH_TARGET = 1.05
MEDIAN_16X_TARGET = 0.10
GROWTH_TARGET = 20.0
JNP_MEDIAN_TARGET = 3.0
QUICK_CORPUS = frozenset({"gpu.softmax"})


@dataclass
class Kernel:
    """One of our kernels at one size: ``build(interpret)`` gives the function to jit, ``reference``
    the same math in ``jax.numpy``; both take ``inputs``."""

    name: str
    scale: int
    build: Callable[[bool | None], Callable[..., Any]]
    reference: Callable[..., Any]
    inputs: tuple[Any, ...]


def _call(kernel: Any, interpret: bool | None, **kwargs: Any) -> Any:
    from jax.experimental import pallas as pl

    if interpret:
        kwargs["interpret"] = True
    return pl.pallas_call(kernel, **kwargs)


def _elementwise(s: int) -> Kernel:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    n = 256 * s
    x = jax.random.normal(jax.random.key(0), (n, 128), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (n, 128), jnp.float32)

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = 2.0 * x_ref[...] + y_ref[...]

    def build(interpret: bool | None) -> Callable[..., Any]:
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return _call(
            kernel,
            interpret,
            out_shape=jax.ShapeDtypeStruct((n, 128), jnp.float32),
            grid=(n // 8,),
            in_specs=[spec, spec],
            out_specs=spec,
        )

    return Kernel("elementwise", s, build, lambda x, y: 2.0 * x + y, (x, y))


def _matmul(s: int) -> Kernel:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    m, k, n, bm, bk = 64 * s, 256, 128, 32, 64
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(1) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    def build(interpret: bool | None) -> Callable[..., Any]:
        return _call(
            kernel,
            interpret,
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
            grid=(m // bm, k // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, j)), pl.BlockSpec((bk, n), lambda i, j: (j, 0))],
            out_specs=pl.BlockSpec((bm, n), lambda i, j: (i, 0)),
        )

    return Kernel("matmul", s, build, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), (x, w))


def _row_reduce(s: int) -> Kernel:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    n, d = 256 * s, 256
    x = jax.random.normal(jax.random.key(4), (n, d), jnp.float32)
    w = jax.random.normal(jax.random.key(5), (1, d), jnp.float32)

    def kernel(x_ref: Any, w_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.sum(x_ref[...] * w_ref[...], axis=1, keepdims=True)

    def build(interpret: bool | None) -> Callable[..., Any]:
        return _call(
            kernel,
            interpret,
            out_shape=jax.ShapeDtypeStruct((n, 1), jnp.float32),
            grid=(n // 8,),
            in_specs=[pl.BlockSpec((8, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((8, 1), lambda i: (i, 0)),
        )

    return Kernel("row_reduce", s, build, lambda x, w: jnp.sum(x * w, axis=1, keepdims=True), (x, w))


def _gather(s: int) -> Kernel:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n = 256 * s
    blocks = n // 8
    table = jax.random.normal(jax.random.key(6), (n, 128), jnp.float32)
    index = (jnp.arange(blocks, dtype=jnp.int32) * 7 + 3) % blocks

    def kernel(index_ref: Any, x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    def build(interpret: bool | None) -> Callable[..., Any]:
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(blocks,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, index: (index[i], 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, index: (i, 0)),
        )
        return _call(kernel, interpret, out_shape=jax.ShapeDtypeStruct((n, 128), jnp.float32), grid_spec=grid_spec)

    def reference(index: Any, table: Any) -> Any:
        return table.reshape(blocks, 8, 128)[index].reshape(n, 128)

    return Kernel("gather", s, build, reference, (index, table))


def _inplace(s: int) -> Kernel:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    n = 512 * s  # the grid visits every other block of 8 rows: 256s rows updated
    x = jax.random.normal(jax.random.key(7), (n, 128), jnp.float32)
    d = jax.random.normal(jax.random.key(8), (n // 2, 128), jnp.float32)

    def kernel(x_ref: Any, d_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + d_ref[...]

    def build(interpret: bool | None) -> Callable[..., Any]:
        every_other = pl.BlockSpec((8, 128), lambda i: (2 * i, 0))
        return _call(
            kernel,
            interpret,
            out_shape=jax.ShapeDtypeStruct((n, 128), jnp.float32),
            grid=(n // 16,),
            in_specs=[every_other, pl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=every_other,
            input_output_aliases={0: 0},
        )

    def reference(x: Any, d: Any) -> Any:
        pairs = x.reshape(n // 16, 2, 8, 128)
        return pairs.at[:, 0].set(pairs[:, 0] + d.reshape(n // 16, 8, 128)).reshape(n, 128)

    return Kernel("inplace", s, build, reference, (x, d))


KERNELS = (_elementwise, _matmul, _row_reduce, _gather, _inplace)


# --- compiling and comparing ----------------------------------------------------------------------


def _install(**settings: Any) -> None:
    import pallas_guard

    pallas_guard.uninstall()
    defaults: dict[str, Any] = {"interpreter": "auto", "checks": "none", "max_steps": None, "fast_plain": True}
    pallas_guard.install("interpret", **{**defaults, **settings})


PROGRAMS: dict[int, str] = {}
"""The compiled program's text of each call :func:`_compiled` made (by the call's id)."""


def _compiled(function: Callable[..., Any], inputs: tuple[Any, ...]) -> Callable[[], Any]:
    """``function`` jitted, compiled ahead of time, as a call that waits for its result (a
    reference ``jax.jit`` cannot trace runs eagerly)."""
    import jax

    jax.clear_caches()  # no trace or lowering shared between variants
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compiled = jax.jit(function).lower(*inputs).compile()
        except jax.errors.TracerArrayConversionError:
            return lambda: jax.block_until_ready(function(*inputs))

    def call() -> Any:
        return jax.block_until_ready(compiled(*inputs))

    PROGRAMS[id(call)] = compiled.as_text() or ""
    return call


def _chosen() -> str:
    import pallas_guard

    chosen = {str(d.interpreter) for d in pallas_guard.decisions() if d.action == "interpreted"}
    pallas_guard.clear_decisions()
    return "/".join(sorted(chosen)) or "?"


def _differs(a: Any, b: Any) -> str | None:
    """None where ``a`` and ``b`` are the same bytes leaf for leaf; else what differs."""
    import jax
    import numpy as np

    left, right = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(left) != len(right):
        return f"{len(left)} vs {len(right)} outputs"
    for index, (leaf_x, leaf_y) in enumerate(zip(left, right, strict=True)):
        x, y = np.asarray(leaf_x), np.asarray(leaf_y)
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            worst = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.shape == y.shape else None
            return f"output {index} differs (max abs difference {worst})"
    return None


@dataclass
class Measured:
    name: str
    scale: int | None  # None: a corpus kernel at its own shapes
    guard_vs_jax: float
    guard_vs_jnp: float
    guard_s: float
    jax_s: float
    jnp_s: float
    chosen: str
    differs: str | None
    spread: tuple[float, float]
    wall: float
    same_program: bool


def _measure(
    name: str,
    scale: int | None,
    *,
    guard: Callable[[], Any],
    by_hand: Callable[[], Any],
    reference: Callable[[], Any],
    chosen: str,
    pairs: int,
) -> Measured:
    differs = _differs(guard(), by_hand())
    same_program = PROGRAMS.get(id(guard)) == PROGRAMS.get(id(by_hand))
    g, j, r = (_timed(f, _repeats(f)) for f in (guard, by_hand, reference))
    versus_jax = interleave(g, j, pairs=pairs)
    versus_jnp = interleave(g, r, pairs=pairs)
    return Measured(
        name,
        scale,
        versus_jax.ratio("cpu"),
        versus_jnp.ratio("cpu"),
        statistics.median([s.cpu for s in versus_jax.a + versus_jnp.a]),
        versus_jax.median("b"),
        versus_jnp.median("b"),
        chosen,
        differs,
        versus_jax.spread("cpu"),
        versus_jax.ratio("wall"),
        same_program,
    )


def _own(make: Callable[[int], Kernel], scale: int, pairs: int) -> Measured:
    import pallas_guard

    kernel = make(scale)
    _install()
    pallas_guard.clear_decisions()
    guard = _compiled(kernel.build(None), kernel.inputs)
    chosen = _chosen()
    pallas_guard.uninstall()  # JAX's interpreter as it ships, written by hand
    by_hand = _compiled(kernel.build(True), kernel.inputs)
    reference = _compiled(kernel.reference, kernel.inputs)
    return _measure(kernel.name, scale, guard=guard, by_hand=by_hand, reference=reference, chosen=chosen, pairs=pairs)


def _corpus(quick: bool, pairs: int) -> list[Measured | Row]:
    import jax
    from ops_corpus import cases, check

    import pallas_guard

    measured: list[Measured | Row] = []
    for case in cases():
        if case.xfail or case.skip_reason() or case.devices > len(jax.devices("cpu")):
            continue
        if quick and case.name not in QUICK_CORPUS:
            continue
        module, inputs = case.op_module(), case.inputs()

        def call(*args: Any, case: Any = case, module: Any = module) -> Any:
            return case.call(module, *args)

        try:
            _install(device=case.device)
            pallas_guard.clear_decisions()
            guard = _compiled(call, inputs)
            chosen = _chosen()
            if chosen != "plain":
                continue  # the guard runs it in another interpreter: no plain interpretation to compare
            check(case, guard())
            _install(device=case.device, interpreter="plain", fast_plain=False)
            by_hand = _compiled(call, inputs)
            pallas_guard.uninstall()
            reference = _compiled(case.reference, inputs)
        except Exception as error:  # recorded, not raised: one kernel must not hide the others
            measured.append(Row(f"4e. interpreted: {case.name}", None, EACH_TARGET, note=f"failed: {error!r:.200}"))
            continue
        measured.append(
            _measure(case.name, None, guard=guard, by_hand=by_hand, reference=reference, chosen=chosen, pairs=pairs)
        )
    return measured


def _row(m: Measured) -> Row:
    size = "corpus shapes" if m.scale is None else f"{m.scale}x"
    name = f"4e. interpreted: {m.name} {size}"
    detail = (
        f"guard ({m.chosen}) {m.guard_s * 1e3:.3g} ms, JAX's interpreter {m.jax_s * 1e3:.3g} ms, "
        f"jnp {m.jnp_s * 1e3:.3g} ms; guard/jnp {m.guard_vs_jnp:.2f}"
    )
    if m.differs is not None:
        return Row(name, None, EACH_TARGET, check=False, detail=detail, note=f"MISS: not bit-identical: {m.differs}")
    return Row(
        name,
        m.guard_vs_jax,
        EACH_TARGET,
        spread=m.spread,
        wall_ratio=m.wall,
        detail=detail + "; bit-identical" + ("; the same compiled program as JAX's" if m.same_program else ""),
    )


def _summaries(measured: list[Measured], top: int) -> list[Row]:
    at_top = [m for m in measured if m.scale == top]
    growth = {
        m.name: m.guard_s / first.guard_s
        for m in at_top
        for first in measured
        if first.name == m.name and first.scale == 1
    }
    ratios = [m.guard_vs_jnp for m in measured]
    return [
        Row(
            f"4e. interpreted: guard/JAX at {top}x, median over our kernels",
            statistics.median(m.guard_vs_jax for m in at_top) if at_top else None,
            MEDIAN_16X_TARGET,
            pairs=len(at_top),
            detail=", ".join(f"{m.name} {m.guard_vs_jax:.4f}" for m in at_top),
            note="n = kernels",
        ),
        Row(
            f"4e. interpreted: the guard's time from 1x to {top}x, worst kernel",
            max(growth.values()) if growth else None,
            GROWTH_TARGET,
            pairs=len(growth),
            detail=", ".join(f"{name} {value:.1f}x" for name, value in growth.items()),
            note="n = kernels",
        ),
        Row(
            "4e. interpreted: guard/jnp, median over every kernel and size",
            statistics.median(ratios) if ratios else None,
            JNP_MEDIAN_TARGET,
            pairs=len(ratios),
            detail=f"worst {max(ratios):.2f}" if ratios else "",
            note="n = kernel-sizes",
        ),
    ]


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    import pallas_guard

    pairs = pairs or (3 if quick else 5)
    scales = (1, 16) if quick else (1, 4, 16)
    was_installed = pallas_guard._surfaces.install.status().requested
    measured: list[Measured] = []
    result: list[Row] = []
    try:
        for make in KERNELS:
            for scale in scales:
                measured.append(_own(make, scale, pairs))
                result.append(_row(measured[-1]))
                sys.stderr.write(f"  4e: {result[-1].name} {result[-1].ratio}\n")
        for item in _corpus(quick, pairs):
            result.append(item if isinstance(item, Row) else _row(item))
            if isinstance(item, Measured):
                measured.append(item)
    finally:
        pallas_guard.uninstall()
        pallas_guard._vocabulary.settings.reset()
        if was_installed:
            pallas_guard.install()
    return [*result, *_summaries(measured, scales[-1])]


if __name__ == "__main__":
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for row in rows(quick="--quick" in sys.argv):
        ratio = f"{row.ratio:.4f}" if row.ratio is not None else "n/a"
        print(f"{row.name:62} {ratio:>8} {row.status:5} {row.detail} {row.note}")
