"""Rows 4j and 4k: kernels inside ``shard_map``, on 2, 4 and 8 CPU devices.

4j. The compile check of a sharded program: what the check adds to a kernel's first call (with
``checks=compile`` minus without, cold compile cache) against libtpu compiling the whole program for
the same topology, per case of ``tests/sharded_corpus.py`` that libtpu compiles; target: the median
at most 1 (no more than the program's own compile).

4k. The interpreted run of an N-device kernel (a ring of remote DMAs, an axis-index kernel; a block
of the same size per device, so the data grows with N): a steady call's time per device at 8 and 4
devices against 2; linear in N is 1, N^2 would be 4 at 8. Target: at most 1.5.

Each device count runs in a child interpreter (``XLA_FLAGS`` must be set before the CPU backend
starts).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent / "tests", BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _harness import Row, clean_env  # noqa: E402

COMPILE_TARGET = 1.0
SCALING_TARGET = 1.5
COMPILE_ROW = "4j. sharded compile check: first-call cost / libtpu compiling the whole program, median"
SCALING_ROWS = {
    "ring": "4k. interpreted ring of remote DMAs: time per device, N devices vs 2",
    "axis_index": "4k. interpreted axis-index kernel: time per device, N devices vs 2",
}
COUNTS = (2, 4, 8)

CHILD = r"""
import json, os, statistics, sys, tempfile, time, warnings
import numpy as np
import jax
import pallas_guard
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import sharded_corpus

devices, rounds, with_compile = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
mesh = Mesh(np.array(jax.devices()), ("x",))
report = {"compile": {}, "steady": {}}
warnings.simplefilter("ignore")

def first_call(case, checks):
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()
    jax.clear_caches()
    pallas_guard.uninstall()
    pallas_guard.install("interpret", checks=checks, device=case.generation)
    inputs = case.inputs(case.devices)
    start = time.perf_counter()
    jax.block_until_ready(case.program(mesh)(*inputs))
    return time.perf_counter() - start

def whole_program(case):
    from pallas_guard._running import tpu_compile
    pallas_guard.uninstall()
    topology = tpu_compile.topology_devices(case.generation, case.devices)
    tmesh = Mesh(np.array(topology, dtype=object), ("x",))
    shard = NamedSharding(tmesh, P("x"))
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard) for x in case.inputs(case.devices)]
    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(case.program(tmesh)).lower(*avals).compile()
    return time.perf_counter() - start

recorded = sharded_corpus.recorded() if with_compile else {}
compiled = [
    c for c in sharded_corpus.CASES if c.devices == devices and recorded.get(c.name, {}).get("verdict") == "compiles"
]
if compiled:  # the compile path's own first use in this process (imports, libtpu), untimed
    whole_program(compiled[0])
    first_call(compiled[0], "compile")
for case in sharded_corpus.CASES:
    if case.devices != devices:
        continue
    if with_compile and recorded.get(case.name, {}).get("verdict") == "compiles":
        whole_program(case)  # libtpu and the topology started, untimed
        costs, programs = [], []
        for _ in range(rounds):
            checked, unchecked = first_call(case, "compile"), first_call(case, "none")
            costs.append(max(checked - unchecked, 0.0))
            programs.append(whole_program(case))
        report["compile"][case.name] = [statistics.median(costs), statistics.median(programs)]

pallas_guard.uninstall()
pallas_guard.install("interpret", device="tpu-v5e")
for kind in ("ring", "axis_index"):
    case = sharded_corpus.by_name()[f"{kind}.v5e.2"]._replace(devices=devices)
    function = case.program(mesh)
    inputs = case.inputs(devices)
    jax.block_until_ready(function(*inputs))
    times = []
    for _ in range(max(5, rounds * 3)):
        start = time.perf_counter()
        jax.block_until_ready(function(*inputs))
        times.append(time.perf_counter() - start)
    report["steady"][kind] = statistics.median(times)
print(json.dumps(report))
"""


def _child(devices: int, rounds: int, with_compile: bool) -> dict[str, Any] | str:
    env = clean_env({"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"})
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, str(devices), str(rounds), "1" if with_compile else "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=BENCH_DIR.parent / "tests",
        timeout=1800,
        check=False,
    )
    if completed.returncode != 0:
        return f"the {devices}-device run failed: {completed.stderr.strip().splitlines()[-1:]}"
    report: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return report


def rows(*, quick: bool = False, pairs: int | None = None) -> list[Row]:
    from pallas_guard._running import tpu_compile as _tpu_compile

    missing = _tpu_compile.available()
    rounds = pairs or (1 if quick else 3)
    reports: dict[int, dict[str, Any]] = {}
    for devices in COUNTS:
        report = _child(devices, rounds, missing is None)
        if isinstance(report, str):
            note = f"not available: {report}"
            return [Row(COMPILE_ROW, None, COMPILE_TARGET, note=note)] + [
                Row(name, None, SCALING_TARGET, note=note) for name in SCALING_ROWS.values()
            ]
        reports[devices] = report
    result = []
    costs = {name: cost / program for r in reports.values() for name, (cost, program) in r["compile"].items()}
    if missing is not None:
        result.append(Row(COMPILE_ROW, None, COMPILE_TARGET, note=f"not available: {missing}"))
    else:
        detail = ", ".join(
            f"{name} {cost * 1e3:.0f}/{program * 1e3:.0f} ms"
            for r in reports.values()
            for name, (cost, program) in r["compile"].items()
        )
        median = statistics.median(costs.values()) if costs else None
        result.append(
            Row(
                COMPILE_ROW,
                median,
                COMPILE_TARGET,
                pairs=len(costs),
                detail=f"worst {max(costs.values()):.3f}; the check's cost / the program's compile: {detail}"
                if costs
                else "",
                note="n = compiled cases; cost = checked first call minus unchecked, cold cache (wall)",
            )
        )
    for kind, name in SCALING_ROWS.items():
        per_device = {n: reports[n]["steady"][kind] / n for n in COUNTS}
        ratio = per_device[COUNTS[-1]] / per_device[COUNTS[0]]
        detail = ", ".join(f"{n} devices {reports[n]['steady'][kind] * 1e3:.1f} ms" for n in COUNTS)
        result.append(
            Row(
                f"{name} (N={COUNTS[-1]})",
                ratio,
                SCALING_TARGET,
                pairs=rounds,
                detail=f"{detail}; at 4: {per_device[4] / per_device[2]:.2f}",
                note="linear in N is 1, N^2 would be 4",
            )
        )
    return result
