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
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard._deciding import interpreters as _interpreters

RECORDS = json.loads((Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json").read_text())["cases"]
PACKING = [case for case in tpu_corpus.cases() if case.name.startswith(("pack.", "unpack."))]
INTERPRETERS = [name for name in ("plain", "tpu") if _interpreters.available(name)]

needs_packing = pytest.mark.skipif(
    not PACKING, reason=f"the packing kernels cannot be built here: {tpu_corpus._no_packing()}"
)


def _digest(out: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(out)).tobytes()).hexdigest()


@needs_packing
def test_every_packing_kind_is_in_the_corpus_and_recorded_on_the_tpu() -> None:
    names = {case.name for case in PACKING}
    assert {"pack.f32_bf16", "pack.f32_bf16_edges", "pack.i32_i4", "unpack.f32_bf16_1"} <= names
    recorded = {"pack.i8_i4", "unpack.i8_i4_1", "unpack.i16_i8_0", *names}  # narrow words: built from jax 0.10
    assert all(RECORDS[name]["status"] == "done" and RECORDS[name]["phase"] is None for name in recorded)


@needs_packing
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


@pytest.mark.skipif(not hasattr(pltpu, "pack_elementwise"), reason="this jax has no pltpu.pack_elementwise")
def test_the_rules_are_the_guards_and_leave_with_it(guard: Any) -> None:
    """A kernel interpreted by hand (``interpret=True``) fails without the guard, as JAX ships, and
    runs while the guard is installed; ``uninstall()`` takes the rules away again."""

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


# --- PRNG ------------------------------------------------------------------------------------------


def _bits_of(out: Any) -> np.ndarray:
    return np.unpackbits(np.asarray(out).view(np.uint8))


def test_tpu_interpret_mode_draws_zeros_so_the_guard_keeps_prng_kernels_out_of_it(guard: Any) -> None:
    """The gap the interpreter table records: forced by hand, TPU interpret mode returns zeros."""
    case = tpu_corpus.by_name("prng.bits")
    guard("interpret", interpreter="tpu")
    assert not np.asarray(case.build()(*case.inputs())).any()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_seeded_draws_are_random_repeatable_and_said_not_to_be_the_tpus(guard: Any, traced: bool) -> None:
    guard("interpret", checks="races")
    per_step = tpu_corpus.by_name("prng.per_block")  # seeds with (seed, program_id) at each of 4 steps
    kernel = per_step.build()
    call = jax.jit(kernel) if traced else kernel
    (seed,) = per_step.inputs()
    first, again, other = (np.asarray(call(s)) for s in (seed, seed, seed + 1))
    np.testing.assert_array_equal(first, again)
    assert 0.48 < _bits_of(first).mean() < 0.52  # 131072 bits
    assert (first != other).mean() > 0.99
    blocks = first.reshape(4, 8, 128)
    assert all((blocks[i] != blocks[j]).mean() > 0.99 for i in range(4) for j in range(i))
    decision = pallas_guard.decisions()[-1]
    assert decision.interpreter == "plain"
    assert any(note.endswith("not the TPU's generator's") for note in decision.notes), decision.notes
    # Checked for races where it runs: the plain interpretation follows its DMAs (it has none).
    assert not any("could not be checked" in note for note in decision.notes), decision.notes


def test_each_draw_after_a_seed_gives_new_bits(guard: Any) -> None:
    def twice(seed_ref, o_ref):  # type: ignore[no-untyped-def]
        pltpu.prng_seed(seed_ref[0])
        o_ref[0] = pltpu.prng_random_bits((8, 128))
        o_ref[1] = pltpu.prng_random_bits((8, 128))

    guard("interpret")
    call = pl.pallas_call(
        twice,
        out_shape=jax.ShapeDtypeStruct((2, 8, 128), jnp.int32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
    )
    out = np.asarray(call(jnp.array([3], jnp.int32)))
    assert (out[0] != out[1]).mean() > 0.99


def test_a_draw_with_no_seed_before_it_is_refused_not_given_zeros(guard: Any) -> None:
    def seeded_at_the_first_step(seed_ref, o_ref):  # type: ignore[no-untyped-def]
        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            pltpu.prng_seed(seed_ref[0])

        o_ref[...] = pltpu.prng_random_bits(o_ref.shape)

    guard("interpret")
    call = pl.pallas_call(
        seeded_at_the_first_step,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.int32),
        grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
    )
    with pytest.raises(NotImplementedError, match=r"no pltpu\.prng_seed before it in the same block"):
        call(jnp.array([1], jnp.int32))


def test_a_stateful_sampler_is_refused_with_the_reason_not_given_zeros(guard: Any) -> None:
    if not hasattr(pltpu, "stateful_uniform"):
        pytest.skip("this jax has no pltpu.stateful_uniform")

    def uniform(seed_ref, o_ref):  # type: ignore[no-untyped-def]
        pltpu.prng_seed(seed_ref[0])
        o_ref[...] = pltpu.stateful_uniform(o_ref.shape, minval=0.0, maxval=1.0)

    guard("interpret")
    call = pl.pallas_call(
        uniform, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)]
    )
    with pytest.raises(NotImplementedError, match=r"pltpu\.stateful_uniform and the other stateful_\* samplers"):
        call(jnp.array([1], jnp.int32))
