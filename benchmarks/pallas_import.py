"""Row 2, import of Pallas: ``import jax.experimental.pallas`` with the guard active vs without.

A: ``PALLAS_GUARD_POLICY=interpret``, ``import pallas_guard; import jax.experimental.pallas`` (so
the patch is applied: wrapt, the front door, the lowering net all load).
B: no ``PALLAS_GUARD_*`` variable, ``import jax.experimental.pallas``.
Each sample is a fresh interpreter (spawn to exit), interleaved A B, B A, ...
"""

from __future__ import annotations

import subprocess
import sys

from _harness import Row, clean_env, interleave, time_python

TARGET = 1.05

GUARDED = ("-c", "import pallas_guard; import jax.experimental.pallas")
PLAIN = ("-c", "import jax.experimental.pallas")
_CHECK = (
    "import pallas_guard, jax.experimental.pallas as pl; from pallas_guard._surfaces import install as _install; "
    "s = _install.status(); assert s.active and s.patched and s.lowering_rules, s; "
    "print(len(s.patched), 'entry points patched,', len(s.lowering_rules), 'CPU rules')"
)


def evidence() -> str:
    """That A really has the guard active once Pallas is imported (else the row measures nothing)."""
    completed = subprocess.run(
        [sys.executable, "-c", _CHECK],
        env=clean_env({"PALLAS_GUARD_POLICY": "interpret"}),
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the guard is not active after importing Pallas: {completed.stderr.strip()}")
    return completed.stdout.strip()


def rows(*, quick: bool, pairs: int | None = None) -> list[Row]:
    pairs = pairs or (3 if quick else 12)
    guarded_env = clean_env({"PALLAS_GUARD_POLICY": "interpret"})
    plain_env = clean_env()
    active = evidence()
    comparison = interleave(
        lambda: time_python(GUARDED, guarded_env),
        lambda: time_python(PLAIN, plain_env),
        pairs=pairs,
        warmup=1,
        progress="pallas import",
    )
    return [
        Row.from_comparison(
            "2. import jax.experimental.pallas, guard active vs not (fresh interpreters)",
            comparison,
            target=TARGET,
            unit="ms",
            group="pallas_import",
            note=f"guard active in A: {active}",
        )
    ]
