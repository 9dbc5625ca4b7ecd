"""On a TPU the guard changes nothing: the corpus recorded on a TPU v5e with the guard installed
(policy strict, every check; ``benchmarks/tpu_record.py --guarded strict``) has, kernel by kernel,
the phase and the output bytes of the records made without it."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def test_the_guarded_tpu_records_equal_the_unguarded_ones() -> None:
    plain = json.loads((DATA / "tpu_v5e_records.json").read_text())
    guarded = json.loads((DATA / "tpu_v5e_guarded_records.json").read_text())
    assert guarded["meta"]["mode"] == plain["meta"]["mode"] == "tpu"
    assert guarded["meta"]["guard"].startswith("policy strict, checks all")
    assert (guarded["meta"]["jax"], guarded["meta"]["libtpu"]) == (plain["meta"]["jax"], plain["meta"]["libtpu"])
    assert guarded["cases"].keys() == plain["cases"].keys()
    for name, without in plain["cases"].items():
        with_guard = guarded["cases"][name]
        assert with_guard["phase"] == without["phase"], name
        digests = [[o["sha256"] for o in record.get("outputs") or ()] for record in (with_guard, without)]
        assert digests[0] == digests[1], name
