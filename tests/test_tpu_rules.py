"""The guard's CPU rules for TPU primitives no JAX interpreter runs on a CPU (``pltpu.pack_elementwise``,
``pltpu.unpack_elementwise``): every packing kernel of ``tests/tpu_corpus.py`` gives, in each CPU
interpreter, eager and under ``jit``, the bytes a TPU v5e gave (``tests/data/tpu_v5e_records.json``);
the rules live only while the guard is installed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_corpus
from jax.experimental import pallas as pl

import pallas_guard
from pallas_guard import _interpreters

RECORDS = json.loads((Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json").read_text())["cases"]
PACKING = [case for case in tpu_corpus.cases() if case.name.startswith(("pack.", "unpack."))]
INTERPRETERS = [name for name in ("plain", "tpu") if _interpreters.available(name)]

pytestmark = pytest.mark.skipif(not PACKING, reason="this jax has no pltpu.pack_elementwise")


def _digest(out: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(out)).tobytes()).hexdigest()


def test_every_packing_kind_is_in_the_corpus_and_recorded_on_the_tpu() -> None:
    names = {case.name for case in PACKING}
    assert {"pack.f32_bf16", "pack.f32_bf16_edges", "pack.i32_i4", "unpack.f32_bf16_1", "unpack.i8_i4_1"} <= names
    assert all(RECORDS[name]["status"] == "done" and RECORDS[name]["phase"] is None for name in names)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", PACKING, ids=lambda case: case.name)
def test_the_tpus_bytes_in_every_interpreter(guard: Any, case: Any, traced: bool, interpreter: str) -> None:
    guard("interpret", interpreter=interpreter)
    kernel = case.build()
    out = (jax.jit(kernel) if traced else kernel)(*case.inputs())
    (recorded,) = RECORDS[case.name]["outputs"]
    assert (list(out.shape), str(out.dtype)) == (recorded["shape"], recorded["dtype"])
    assert _digest(out) == recorded["sha256"]


def test_the_rules_are_the_guards_and_leave_with_it(guard: Any) -> None:
    """A kernel interpreted by hand (``interpret=True``) fails without the guard, as JAX ships, and
    runs while the guard is installed; ``uninstall()`` takes the rules away again."""
    from jax.experimental.pallas import tpu as pltpu

    def packs(xs_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = pltpu.pack_elementwise([xs_ref[0], xs_ref[1]], packed_dtype=jnp.int16)

    call = pl.pallas_call(packs, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.uint32), interpret=True)
    sources = jnp.stack([jnp.full((8, 128), 0x12345678, jnp.int32), jnp.full((8, 128), -2, jnp.int32)])
    with pytest.raises(NotImplementedError, match="pack_elementwise"):
        call(sources)
    guard("interpret")
    np.testing.assert_array_equal(call(sources), np.full((8, 128), 0xFFFE5678, np.uint32))
    pallas_guard.uninstall()
    jax.clear_caches()
    with pytest.raises(NotImplementedError, match="pack_elementwise"):
        call(sources)
