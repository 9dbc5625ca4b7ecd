"""Row 4l: the peak memory of a checked run against an unchecked one, at model shapes.

JAX's shipped attention kernels and its TPU matmul at the shapes a model calls them with (a
1024-token sequence, 128-wide heads, a KV cache of 64 pages of 16 tokens for each of 8 sequences),
each called once, as a first call, in a fresh process per variant: ``none``, the set a CI job leaves
on (``all``: every check but ``agree``) and every check (``all,agree``). The memory of a run is the
process's peak resident set (``ru_maxrss``) at its end: jax, the inputs, the call, and what the
checks bring into the process (libtpu and its TPU topology, which the compile check starts and an
unchecked run never does).
Target: each kernel's checked run at most 1.5x the unchecked run's. Beside it, the growth of the
peak over the call alone (the peak after, against the resident set just before), which counts a
process's one-time costs (libtpu's compiler at its first compile, about 110 MiB) against the one
kernel. A variant that fails or runs past its time is reported, not counted. Each process starts
with an empty cache folder: its compile check compiles.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, clean_env  # noqa: E402

TARGET = 1.5
VARIANTS = ("none", "all", "all,agree")
KERNELS = ("tpu.flash_attention", "tpu.paged_attention", "tpu.splash_attention", "tpu.matmul", "gpu.attention.mha")
QUICK = ("tpu.paged_attention", "tpu.matmul")
TIMEOUT = 600

CHILD = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
import importlib
import jax, jax.numpy as jnp
import pallas_guard

name, checks = sys.argv[1], sys.argv[2]
OPS = "jax.experimental.pallas.ops"

def rand(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)

def flash():
    m = importlib.import_module(f"{OPS}.tpu.flash_attention")
    inputs = [rand(s, 1, 4, 1024, 128) for s in (1, 2, 3)]
    return lambda q, k, v: m.flash_attention(q, k, v, causal=True, sm_scale=0.125), inputs

def paged():
    m = importlib.import_module(f"{OPS}.tpu.paged_attention.paged_attention_kernel")
    batch, heads, kv_heads, d, page, pages = 8, 16, 2, 128, 16, 64
    q = rand(1, batch, heads, d)
    k_pages, v_pages = rand(2, kv_heads, batch * pages, page, d), rand(3, kv_heads, batch * pages, page, d)
    tables = jax.random.permutation(jax.random.key(4), batch * pages).reshape(batch, pages).astype(jnp.int32)
    lengths = jnp.full((batch,), page * pages - 7, jnp.int32)
    inputs = [q, k_pages, v_pages, lengths, tables]
    return lambda *a: m.paged_attention(*a, pages_per_compute_block=8), inputs

def splash():
    m = importlib.import_module(f"{OPS}.tpu.splash_attention.splash_attention_kernel")
    mask_lib = importlib.import_module(f"{OPS}.tpu.splash_attention.splash_attention_mask")
    heads, seq = 4, 1024
    inputs = [rand(s, heads, seq, 128) for s in (1, 2, 3)]
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((seq, seq)) for _ in range(heads)])
    sizes = m.BlockSizes(block_q=256, block_kv=256, block_kv_compute=256)
    kernel = m.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    return kernel, inputs

def matmul():
    m = importlib.import_module(f"{OPS}.tpu.matmul")
    inputs = [rand(1, 1024, 1024), rand(2, 1024, 1024)]
    return lambda x, y: m.matmul(x, y, block_shape=(256, 256), block_k=256), inputs

def mha():
    m = importlib.import_module(f"{OPS}.gpu.attention")
    inputs = [rand(s, 1, 1024, 4, 64) for s in (1, 2, 3)]
    return lambda q, k, v: m.mha(q, k, v, segment_ids=None, causal=True), inputs

BUILD = {"tpu.flash_attention": flash, "tpu.paged_attention": paged, "tpu.splash_attention": splash,
         "tpu.matmul": matmul, "gpu.attention.mha": mha}
pallas_guard.install("interpret", checks=checks, max_steps=None, device="tpu-v5e")
call, inputs = BUILD[name]()
jax.block_until_ready(inputs)
page_size = os.sysconf("SC_PAGE_SIZE")
with open("/proc/self/statm") as statm:
    before = int(statm.read().split()[1]) * page_size
start = time.perf_counter()
jax.block_until_ready(call(*inputs))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak": peak, "grown": max(peak - before, 0), "before": before, "seconds": seconds}))
"""


def _child(name: str, checks: str) -> dict[str, Any] | str:
    # A cold compile: no verdict kept on disk by an earlier child.
    env = clean_env({"JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": tempfile.mkdtemp(prefix="pallas_guard-memory-")})
    try:
        completed = subprocess.run(
            [sys.executable, "-c", CHILD, name, checks],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"ran past {TIMEOUT} s"
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines()
        return f"failed: {lines[-1][:160] if lines else completed.returncode}"
    report: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return report


def _mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    del pairs  # one process per variant: a peak is not noisy as a time is
    result: list[Row] = []
    ratios: dict[str, dict[str, float]] = {variant: {} for variant in VARIANTS[1:]}
    for name in QUICK if quick else KERNELS:
        sys.stderr.write(f"  4l. {name}\n")
        runs = {variant: _child(name, variant) for variant in VARIANTS}
        base = runs["none"]
        if isinstance(base, str):
            result.append(Row(f"4l. peak memory of a checked run: {name}", None, note=f"unchecked {base}"))
            continue
        details = [f"none {_mib(base['peak'])} (the call {_mib(base['grown'])}, {base['seconds']:.1f} s)"]
        for variant in VARIANTS[1:]:
            run = runs[variant]
            if isinstance(run, str):
                details.append(f"{variant} {run}")
                continue
            ratios[variant][name] = run["peak"] / base["peak"]
            grown = run["grown"] / max(base["grown"], 1)
            details.append(
                f"{variant} {_mib(run['peak'])} ({ratios[variant][name]:.2f}; the call {_mib(run['grown'])}, "
                f"{grown:.2f}, {run['seconds']:.1f} s)"
            )
        worst = max((r[name] for r in ratios.values() if name in r), default=None)
        result.append(
            Row(
                f"4l. peak memory of a checked run: {name}",
                worst,
                TARGET,
                pairs=1,
                detail="; ".join(details),
                note="the larger of all and all,agree, over none (the process's peak)",
            )
        )
    for variant, values in ratios.items():
        worst_name = max(values, key=lambda k: values[k]) if values else None
        result.append(
            Row(
                f"4l. peak memory, {variant} vs none: median over the kernels",
                statistics.median(values.values()) if values else None,
                TARGET,
                pairs=len(values),
                detail=f"worst {values[worst_name]:.2f} ({worst_name})" if worst_name else "",
                note="n = kernels",
            )
        )
    return result


if __name__ == "__main__":
    from _harness import table

    print(table(rows(quick="--quick" in sys.argv)))
