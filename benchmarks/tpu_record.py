"""Record the TPU's verdict on every kernel of ``tests/tpu_corpus.py``: on a TPU, or deviceless on a CPU.

On a TPU machine (the one command; it writes the records as JSON)::

    python benchmarks/tpu_record.py --out "$OUT/tpu_records.json"

On a TPU, with the guard installed (policy strict, every check), compared with the records made
without it (same phase for every kernel, the run's included, and the same output bytes)::

    python benchmarks/tpu_record.py --guarded strict --out "$OUT/guarded.json" --compare tests/data/tpu_v5e_records.json

On a CPU with libtpu installed (the TPU compiler, deviceless; no run phase)::

    JAX_PLATFORMS=cpu python benchmarks/tpu_record.py --deviceless tpu-v5e --out /tmp/deviceless.json

and to compare deviceless verdicts with a TPU's records (prints the agreement, exits 1 on any
disagreement)::

    JAX_PLATFORMS=cpu python benchmarks/tpu_record.py --deviceless tpu-v5e --compare tests/data/tpu_v5e_records.json

Per case, in the corpus's order: the phase of a refusal (``lower``: JAX's Python lowering;
``compile``: libtpu; ``run``: the TPU), the error's type and first line, the compiler's scoped VMEM
for the kernel, the lower and compile times, and on a TPU each output's sha256 (outputs of at most
4096 elements also whole) and the steady time (median of ``--calls`` calls after a warm-up). The
run is resumable: each case is written before it runs (``started``) and after (``done``); a rerun
with the same ``--out`` skips finished cases, and a case whose process died is recorded as such.
Cases that halt a TPU core (block indices past an array) run last, each in a process of its own;
the others share one process. This script imports no jax itself: workers do.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for path in (REPO_ROOT / "tests", REPO_ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

WHOLE = 4096
"""Outputs of at most this many elements are recorded whole."""
HALTING_TIMEOUT = 90.0
"""Seconds the process of one halting case may take (a hung TPU is recorded, not waited for)."""
WORKER_TIMEOUT = 300.0
"""Seconds the process of the other cases may take before the case it is on is recorded as hung."""
RESTART = 3
"""A worker's exit status after a case failed on the TPU: the rest go on in a fresh process."""


# --- the records file -------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    if path.exists():
        data: dict[str, Any] = json.loads(path.read_text())
        data.setdefault("cases", {})
        return data
    return {"meta": {}, "cases": {}}


def save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    # One line per case: the file stays readable and a diff shows which cases changed.
    cases = ",\n".join(f"  {json.dumps(name)}: {json.dumps(record)}" for name, record in data["cases"].items())
    meta = json.dumps(data.get("meta", {}), indent=2).replace("\n", "\n ")
    partial.write_text(f'{{\n "meta": {meta},\n "cases": {{\n{cases}\n }}\n}}\n')
    partial.replace(path)  # a kill mid-write leaves the previous file whole


def update(path: Path, name: str, record: dict[str, Any]) -> None:
    data = load(path)
    data["cases"][name] = record
    save(path, data)


# --- one case ---------------------------------------------------------------------------------------


def _error_type(error: BaseException) -> str:
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def _refusal(phase: str, error: BaseException) -> dict[str, Any]:
    import tpu_corpus

    from pallas_guard._running import tpu_compile as _tpu_compile

    message = _tpu_compile.first_line(error)
    return {
        "phase": phase,
        "error_type": _error_type(error),
        "message": message,
        "signature": tpu_corpus.signature(message),
    }


def _outputs(out: Any) -> list[dict[str, Any]]:
    import jax
    import numpy as np

    described = []
    for leaf in jax.tree_util.tree_leaves(out):
        array = np.asarray(leaf)
        entry: dict[str, Any] = {
            "shape": list(array.shape),
            "dtype": str(array.dtype),
            "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
        }
        if array.size <= WHOLE:
            flat = array.reshape(-1)
            # Nine significant digits give a float32 (and narrower floats) back exactly.
            entry["values"] = (
                flat.tolist() if array.dtype.kind in "biu" else [float(f"{v:.9g}") for v in flat.astype(np.float64)]
            )
        described.append(entry)
    return described


def _memory(text: str, generation: str) -> dict[str, Any]:
    from pallas_guard._running import tpu_compile as _tpu_compile

    usage = _tpu_compile.memory(text, generation)
    return {"vmem_used": usage.vmem_used, "vmem_limit": usage.vmem_limit, "smem_declared": usage.smem_used}


def run_on_tpu(case: Any, generation: str, calls: int) -> dict[str, Any]:
    """Lower, compile and run ``case`` on this process's default device (a TPU)."""
    import jax

    args = jax.tree_util.tree_map(jax.device_put, case.inputs())
    record: dict[str, Any] = {"phase": None}
    start = time.perf_counter()
    try:
        lowered = jax.jit(case.build()).lower(*args)
    except Exception as error:
        return record | _refusal("lower", error) | {"lower_s": time.perf_counter() - start}
    record["lower_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as error:
        return record | _refusal("compile", error) | {"compile_s": time.perf_counter() - start}
    record["compile_s"] = time.perf_counter() - start
    record |= _memory(compiled.as_text(), generation)
    try:
        out = jax.block_until_ready(compiled(*args))
        record["outputs"] = _outputs(out)
        times = []
        for _ in range(calls):
            begin = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - begin)
    except Exception as error:
        return record | _refusal("run", error)
    record["steady_ms"] = statistics.median(times) * 1e3
    return record


def compile_deviceless(case: Any, generation: str) -> dict[str, Any]:
    from pallas_guard._running import tpu_compile as _tpu_compile

    outcome = _tpu_compile.compile_kernel(case.build, case.inputs(), {}, generation)
    if outcome.unchecked is not None:
        return {"phase": None, "unchecked": outcome.unchecked}
    record: dict[str, Any] = {"phase": None, "compile_s": outcome.seconds}
    if outcome.error is not None and outcome.phase is not None:
        return record | _refusal(outcome.phase, outcome.error)
    return record | {
        "vmem_used": outcome.vmem_used,
        "vmem_limit": outcome.vmem_limit,
        "smem_declared": outcome.smem_used,
    }


# --- the worker: one process, the given cases in order ------------------------------------------------


def meta(deviceless: str | None) -> dict[str, Any]:
    import jax

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": f"deviceless {deviceless}" if deviceless else "tpu",
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "libtpu": version("libtpu") or version("libtpu-nightly"),
        "python": platform.python_version(),
        "device_kind": deviceless or device.device_kind,
        "platform_version": None if deviceless else getattr(device.client, "platform_version", None),
    }


def _generation(kind: str) -> str:
    from pallas_guard_autoload import DEVICES

    return next((name for name, (k, _, _) in DEVICES.items() if k == kind), kind)


def worker(out: Path, names: list[str], deviceless: str | None, calls: int, guarded: str | None = None) -> int:
    import warnings

    import jax

    import pallas_guard

    generation = deviceless or _generation(jax.devices()[0].device_kind)
    if guarded:  # on a TPU the guard must change nothing: the same outcomes and bytes as without it
        pallas_guard.install(guarded, checks="all,agree", device=generation)
    else:
        pallas_guard.uninstall()  # the record is JAX's own behaviour, with no guard in the way
    import tpu_corpus

    data = load(out)
    if not data.get("meta"):
        data["meta"] = meta(deviceless)
        if guarded:
            data["meta"]["guard"] = f"policy {guarded}, checks all,agree, device {generation}"
        save(out, data)
    for name in names:
        case = tpu_corpus.by_name(name)
        update(out, name, {"status": "started", "halts": case.halts})
        print(f"{name} ...", end=" ", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record = compile_deviceless(case, generation) if deviceless else run_on_tpu(case, generation, calls)
        record = {"status": "done", "halts": case.halts, **record}
        update(out, name, record)
        print(record.get("phase") or "ok", record.get("message", "")[:100], flush=True)
        if record.get("phase") == "run" and name != names[-1]:
            # A kernel that failed on the chip may have left it unusable to this process (a core
            # halt fails every later kernel): the rest run in a fresh one.
            return RESTART
    return 0


# --- the driver ---------------------------------------------------------------------------------------


def _case_names() -> list[tuple[str, bool]]:
    """The corpus for this jax, listed in a subprocess on the CPU (this process holds no TPU)."""
    code = "import tpu_corpus, json; print(json.dumps([[c.name, c.halts] for c in tpu_corpus.cases()]))"
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": _pythonpath()}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [(name, bool(halts)) for name, halts in json.loads(done.stdout.strip().splitlines()[-1])]


def _pythonpath() -> str:
    parts = [str(REPO_ROOT / "tests"), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(part for part in parts if part)


def _spawn(out: Path, names: list[str], args: argparse.Namespace, timeout: float | None) -> int:
    command = [sys.executable, __file__, "--out", str(out), "--calls", str(args.calls), "--worker", ",".join(names)]
    if args.deviceless:
        command += ["--deviceless", args.deviceless]
    if args.guarded:
        command += ["--guarded", args.guarded]
    env = os.environ | {"PYTHONPATH": _pythonpath()}
    try:
        return subprocess.run(command, env=env, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        return -1


def _died(out: Path, rc: int) -> None:
    """A case left ``started`` by a worker that died: recorded as its process's end."""
    data = load(out)
    for name, record in data["cases"].items():
        if record.get("status") == "started":
            why = "timed out" if rc == -1 else f"exit status {rc}"
            data["cases"][name] = record | {
                "status": "done",
                "phase": "run",
                "error_type": "process died",
                "message": f"the recording process died ({why})",
                "signature": None,
            }
    save(out, data)


def drive(args: argparse.Namespace) -> int:
    out = Path(args.out)
    listed = _case_names()
    if args.only:
        listed = [(name, halts) for name, halts in listed if any(name.startswith(p) for p in args.only)]
    begin = time.perf_counter()

    def remaining(halting: bool) -> list[str]:
        cases = load(out)["cases"]
        return [n for n, h in listed if h == halting and cases.get(n, {}).get("status") != "done"]

    def left() -> float | None:
        return None if args.budget is None else args.budget - (time.perf_counter() - begin)

    # The cases that do not halt share a process; one that kills it is recorded, and the rest go on.
    while todo := remaining(halting=False):
        budget = left()
        if budget is not None and budget <= 0:
            break
        rc = _spawn(out, todo, args, timeout=WORKER_TIMEOUT if budget is None else min(WORKER_TIMEOUT, budget))
        if rc != RESTART:
            _died(out, rc)
        if remaining(halting=False) == todo:  # no progress: do not loop
            break
    for name in remaining(halting=True):
        budget = left()
        if budget is not None and budget <= 0:
            break
        _died(
            out, _spawn(out, [name], args, timeout=HALTING_TIMEOUT if budget is None else min(HALTING_TIMEOUT, budget))
        )
    data = load(out)
    data["meta"]["wall_s"] = round(time.perf_counter() - begin + data["meta"].get("wall_s", 0.0), 1)
    data["meta"]["counts"] = counts(data)
    save(out, data)
    print(json.dumps(data["meta"], indent=1))
    return compare(args, data) if args.compare else 0


def counts(data: dict[str, Any]) -> dict[str, int]:
    tally: dict[str, int] = {}
    for record in data["cases"].values():
        phase = record.get("phase") or ("unchecked" if record.get("unchecked") else "ok")
        tally[phase] = tally.get(phase, 0) + 1
    return tally


def verdict(record: dict[str, Any]) -> tuple[str | None, str | None]:
    """What a deviceless compile can tell: the phase before running, and the message's signature."""
    phase = record.get("phase")
    return (phase, record.get("signature")) if phase in ("lower", "compile") else (None, None)


def compare(args: argparse.Namespace, data: dict[str, Any]) -> int:
    reference = load(Path(args.compare))
    agree_phase = agree_message = total = 0
    for name, record in data["cases"].items():
        tpu = reference["cases"].get(name)
        if tpu is None or tpu.get("status") != "done":
            continue
        total += 1
        (phase, sign), (want_phase, want_sign) = verdict(record), verdict(tpu)
        agree_phase += phase == want_phase
        agree_message += phase == want_phase and sign == want_sign
        if (phase, sign) != (want_phase, want_sign):
            print(f"DIFFERS {name}: here {phase} {sign!r}; recorded {want_phase} {want_sign!r}")
    print(f"phase agrees: {agree_phase} of {total}; phase and message: {agree_message} of {total}")
    if data.get("meta", {}).get("mode") != "tpu":
        return 0 if agree_message == total else 1
    # Both ran on a TPU: every phase (the run's too) and every output's bytes.
    same_phase = same_outputs = ran = 0
    for name, record in data["cases"].items():
        tpu = reference["cases"].get(name)
        if tpu is None or tpu.get("status") != "done":
            continue
        same_phase += record.get("phase") == tpu.get("phase")
        if tpu.get("outputs") is not None:
            ran += 1
            digests = [o["sha256"] for o in record.get("outputs") or ()]
            same_outputs += digests == [o["sha256"] for o in tpu["outputs"]]
            if digests != [o["sha256"] for o in tpu["outputs"]]:
                print(f"OUTPUTS DIFFER {name}")
    print(f"on the TPU: same phase (run included): {same_phase} of {total}; same output bytes: {same_outputs} of {ran}")
    return 0 if agree_message == same_phase == total and same_outputs == ran else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(os.environ["OUT"]) / "tpu_records.json" if os.environ.get("OUT") else BENCH_DIR / "tpu_records.json"
    parser.add_argument("--out", default=str(default), help="the records file (resumed where it exists)")
    parser.add_argument("--deviceless", metavar="GENERATION", help="compile for this TPU on a CPU (e.g. tpu-v5e)")
    parser.add_argument("--calls", type=int, default=10, help="steady calls timed per case (median)")
    parser.add_argument("--only", nargs="*", help="cases whose names start with these")
    parser.add_argument("--compare", metavar="RECORDS", help="a TPU's records to compare the verdicts with")
    parser.add_argument("--budget", type=float, help="seconds after which no further process is started")
    parser.add_argument(
        "--guarded", metavar="POLICY", help="on a TPU: record with pallas_guard installed (POLICY, every check)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(Path(args.out), args.worker.split(","), args.deviceless, args.calls, args.guarded)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
