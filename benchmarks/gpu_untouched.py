"""On a machine with an NVIDIA GPU: the guard changes nothing there.

    PYTHONPATH=. python benchmarks/gpu_untouched.py

For a Triton kernel and (where this jax ships it) JAX's Mosaic-GPU Hopper matmul: the lowered
module and the result with the guard installed (policies interpret, warn, strict; a device set;
checks on) are byte-identical to those without it, nothing is recorded, and no abstract device is
presented. A ``jax.default_device(cpu)`` scope on the GPU host still gets the CPU's interpreter.
Last, the cost of the guard on an eager GPU call (the kernel callable's wrapper decides at every
call): the median of interleaved runs, guarded / unguarded. Exit status 0 when every check holds,
1 when one fails; without a GPU it says so and exits 0 (CI never has one).
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_guard

FAILURES: list[str] = []


def check(what: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
    if not ok:
        FAILURES.append(what)


def kernels() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1

    x = jnp.arange(1024, dtype=jnp.float32)
    found: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "pallas_call (GPU default backend)": (
            lambda x: pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x),
            (x,),
        )
    }
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

        a = jax.random.uniform(jax.random.key(0), (256, 256), jnp.float16)
        b = jax.random.uniform(jax.random.key(1), (256, 256), jnp.float16)
        c = jax.random.uniform(jax.random.key(2), (256, 256), jnp.float32)
        spec = hopper.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2)
        found["Mosaic-GPU hopper_matmul_mgpu"] = (lambda a, b, c: hopper.matmul(a, b, c, spec), (a, b, c))
    except Exception as error:  # an older jax, another signature: the Triton kernel still checks
        print(f"note: hopper_matmul_mgpu not used ({type(error).__name__}: {error})")
    return found


# JAX's Mosaic-GPU lowering serialises its kernel differently each time (the same kernel lowered
# twice without the guard gives another `kernel_hash` and `module` payload): compared without them.
_MOSAIC_GPU_PAYLOAD = re.compile(r'(kernel_hash|module) = "(?:[^"\\]|\\.)*"')


def observe(name: str, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, bytes]:
    jax.clear_caches()
    text = jax.jit(function).lower(*args).as_text()
    if "mosaic_gpu" in text:
        text = _MOSAIC_GPU_PAYLOAD.sub(r'\1 = "…"', text)
    out = np.asarray(jax.block_until_ready(jax.jit(function)(*args)))
    return text, out.tobytes()


def eager_seconds(function: Callable[..., Any], args: tuple[Any, ...], calls: int = 300) -> float:
    jax.block_until_ready(function(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = function(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def main() -> int:
    if jax.default_backend() != "gpu":
        print(f"no GPU here (default backend {jax.default_backend()!r}): nothing to check")
        return 0
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    pallas_guard.uninstall()
    cases = kernels()
    unguarded = {name: observe(name, f, args) for name, (f, args) in cases.items()}
    for name, (f, args) in cases.items():  # the comparison is only as good as JAX's own determinism
        check(f"{name} without the guard: lowering the same twice", observe(name, f, args)[0] == unguarded[name][0])
    settings: list[dict[str, Any]] = [
        {"policy": "interpret"},
        {"policy": "warn", "device": "h100", "checks": "all,agree"},
        {"policy": "strict"},
    ]
    for given in settings:
        pallas_guard.install(**given)
        pallas_guard.clear_decisions()
        for name, (f, args) in cases.items():
            text, out = observe(name, f, args)
            check(f"{name} under {given}: lowering byte-identical", text == unguarded[name][0])
            check(f"{name} under {given}: result bit-identical", out == unguarded[name][1])
        check(f"under {given}: nothing recorded", pallas_guard.decisions() == [], str(pallas_guard.decisions()))
        device = jax.sharding.get_abstract_mesh().abstract_device
        check(f"under {given}: no abstract device presented on a GPU target", device is None, str(device))
        pallas_guard.uninstall()

    # A CPU scope on the GPU host: the guard's business again.
    pallas_guard.install("interpret")
    pallas_guard.clear_decisions()
    name = "pallas_call (GPU default backend)"
    function, args = cases[name]
    with jax.default_device(jax.devices("cpu")[0]):
        cpu_args = tuple(jax.device_put(a, jax.devices("cpu")[0]) for a in args)
        out = np.asarray(function(*cpu_args))
    check("a jax.default_device(cpu) scope runs the kernel interpreted", bool(np.all(out == np.asarray(args[0]) + 1)))
    decisions = pallas_guard.decisions()
    check("... and records it", [d.action for d in decisions] == ["interpreted"], str(decisions))
    pallas_guard.uninstall()

    # The wrapper decides at every eager call: what that costs on a GPU target.
    ratios = []
    for _ in range(5):
        pallas_guard.uninstall()
        plain = eager_seconds(function, args)
        pallas_guard.install("interpret")
        guarded = eager_seconds(function, args)
        ratios.append(guarded / plain)
    pallas_guard.uninstall()
    print(f"eager call on the GPU, guarded / unguarded: median {statistics.median(ratios):.3f} (runs {ratios})")
    print(f"{len(FAILURES)} failed" if FAILURES else "all checks hold")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
