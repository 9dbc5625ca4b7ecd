"""The race corpus on a real TPU: does each race change what the chip computes?

    python benchmarks/race_tpu.py --out DIR            # on a machine with a TPU: one process per case
    python benchmarks/race_tpu.py --compare DIR        # on a CPU: the plain interpreter's outputs vs the chip's

``tests/data/race_corpus_tpu_v5e.{npz,json}`` hold one such run (every ``DIR/<case>.npz`` as
``<case>/arr_<i>`` in one file, and ``status.json``), which ``tests/test_races_in_plain.py`` replays.

Each kernel of ``tests/race_corpus.py`` (those that do not wait forever) is compiled for the TPU and
run there, with a time limit (those that leave a DMA in flight one process each, last); its outputs
are saved as ``DIR/<case>.npz`` and its fate in ``DIR/status.json``. ``--compare`` runs every case in JAX's
plain interpreter on the CPU (which copies a DMA's data when it starts, so a race there changes
nothing) and says, per case, whether the chip's outputs are the same bytes: a race the check reports
whose outputs differ on the chip is a race the TPU does not survive.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def _run_one(name: str, out: Path) -> None:
    import jax
    import numpy as np
    import race_corpus

    fn, args = race_corpus.case(name).build(None)
    outputs = jax.tree_util.tree_leaves(jax.block_until_ready(fn(*args)))
    np.savez(out / f"{name}.npz", *[np.asarray(o) for o in outputs])


def _batch(names: list[str], out: Path) -> None:
    """Runs ``names`` one after the other in this process (opening the chip once), recording each."""
    status_file = out / "status.json"
    for name in names:
        status = json.loads(status_file.read_text()) if status_file.exists() else {}
        status[name] = "started"  # left as is if the process dies on it
        status_file.write_text(json.dumps(status, indent=1))
        try:
            _run_one(name, out)
            status[name] = "ran"
        except Exception as error:  # the chip's refusal is a result too
            first = (str(error).strip().splitlines() or [""])[0]
            status[name] = f"failed: {type(error).__name__}: {first[:200]}"
        status_file.write_text(json.dumps(status, indent=1))
        print(name, status[name], flush=True)


def record(out: Path) -> None:
    """The cases that cannot halt the chip in one process; a DMA left in flight, each in its own."""
    import race_corpus

    out.mkdir(parents=True, exist_ok=True)
    names = [c.name for c in race_corpus.CASES if c.kind not in ("wait_without_start", "left_in_flight")]
    risky = [c.name for c in race_corpus.CASES if c.kind == "left_in_flight"]
    for group in [names, *[[name] for name in risky]]:
        try:
            subprocess.run(
                [sys.executable, __file__, "--batch", ",".join(group), "--out", str(out)], timeout=240, check=False
            )
        except subprocess.TimeoutExpired:
            print(f"{group}: timed out", flush=True)
    status = json.loads((out / "status.json").read_text())
    for case in race_corpus.CASES:
        status.setdefault(case.name, "not run: the core would wait forever")
        if status[case.name] == "started":
            status[case.name] = "did not finish (the process died or timed out on it)"
    (out / "status.json").write_text(json.dumps(status, indent=1))


def compare(recorded: Path) -> None:
    import jax
    import numpy as np
    import race_corpus

    status = json.loads((recorded / "status.json").read_text())
    for case in race_corpus.CASES:
        fate = status.get(case.name, "not recorded")
        if fate != "ran":
            print(f"{case.name:45s} kind={case.kind}: on the TPU {fate}")
            continue
        fn, args = case.build(True)
        mine = [np.asarray(o) for o in jax.tree_util.tree_leaves(jax.block_until_ready(fn(*args)))]
        with np.load(recorded / f"{case.name}.npz") as chip:
            theirs = [chip[f"arr_{i}"] for i in range(len(chip.files))]
        same = all(a.tobytes() == b.tobytes() for a, b in zip(mine, theirs, strict=True))
        close = all(np.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True) for a, b in zip(mine, theirs, strict=True))
        verdict = "same bytes" if same else ("within 1e-5" if close else "DIFFERENT")
        print(f"{case.name:45s} kind={case.kind}: the chip's outputs vs the plain interpreter's: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch")
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    if args.batch:
        _batch(args.batch.split(","), args.out)
    elif args.compare:
        compare(args.compare)
    else:
        record(args.out)


if __name__ == "__main__":
    main()
