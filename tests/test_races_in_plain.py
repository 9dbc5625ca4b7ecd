"""The race check inside the plain interpretation, held against TPU interpret mode's detector.

Every kernel of ``tests/race_corpus.py`` runs under the guard twice: with ``checks=races`` as a user
gets it (the plain interpreter, following the DMAs in flight) and with the interpreter forced to TPU
interpret mode, whose happens-before detector is on. Every race the detector reports is found, no
kernel it passes as valid gets a finding, and where the two differ the corpus says why (the
detector cannot see a DMA that is never waited, orders every DMA of one core after the other, and
never returns from a wait nothing will signal); the test holds those cases to the check's finding.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_guard
from pallas_guard._checks import dma_jaxpr, dma_stepped, dma_table
from pallas_guard._checks import dma_races as _dma_races
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state
from pallas_guard._vocabulary.errors import PallasGuardError

sys.path.insert(0, str(Path(__file__).parent))
import race_corpus

RACE_KINDS = {  # the corpus's kind -> the check's words for it
    "read_before_wait": "read of a DMA's destination before its wait",
    "write_dst_in_flight": "write to a DMA's destination while the DMA is in flight",
    "write_src_in_flight": "write to a DMA's source while the DMA is in flight",
    "wait_without_start": "a wait that no started DMA can complete",
    "left_in_flight": "a DMA still in flight at the end of the kernel",
    "overlapping_dmas": "two DMAs in flight into overlapping regions",
}
BLIND = {  # why TPU interpret mode's detector does not report a kind the check finds
    "left_in_flight": "a DMA runs only when a wait needs it: one never waited never runs",
    "overlapping_dmas": "one core's DMAs share one clock slot: the second waited counts as after the first",
    "wait_without_start": "the wait blocks forever",
}


def _runs_here(case: race_corpus.RaceCase) -> bool:
    return jax_lookup.jax_release() >= case.min_jax and not case.detector.startswith("error")


CASES = [pytest.param(case, id=case.name) for case in race_corpus.CASES]

WAYS = ["decided_first", "table_way"]
"""How the check follows the DMAs: decided while tracing where it can (what users get), or always
with the table of DMAs in flight (its fallback, held to the same corpus; CI's quick entries leave
it to the full ones, ``-k "not table_way"``)."""


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(_dma_races, "DECIDE_WHILE_TRACING", request.param == "decided_first")
    return str(request.param)


@pytest.fixture
def guarded() -> Iterator[Callable[..., None]]:
    def install(**settings: Any) -> None:
        pallas_guard.uninstall()
        jax.clear_caches()
        pallas_guard.install("interpret", device="tpu-v5e", **settings)

    yield install
    pallas_guard.uninstall()
    jax_pallas.reset_interpreter("tpu")


def _run(case: race_corpus.RaceCase, *, jit: bool = False) -> tuple[Any, str | None]:
    """(the outputs, None), or (None, the finding's first line)."""
    fn, args = case.build(None)
    try:
        return jax.block_until_ready((jax.jit(fn) if jit else fn)(*args)), None
    except PallasGuardError as error:
        return None, str(error).splitlines()[0]


DETECTOR_FROM = (0, 10)
"""The first jax whose TPU interpret mode runs the corpus with its detector (measured on 0.10.2 and
0.12.0.1; before, XLA's verifier refuses its host callbacks inside a branch on some kernels, and 0.7.2
misses a write into a DMA's destination)."""


def _tpu_detector_has_races() -> bool:
    params = jax_pallas.tpu_params_class()
    fields = getattr(params, "__dataclass_fields__", {})
    return "detect_races" in fields and jax_lookup.jax_release() >= DETECTOR_FROM


@pytest.mark.parametrize("case", CASES)
def test_the_race_check_in_plain_finds_what_tpu_interpret_modes_detector_finds(
    case: race_corpus.RaceCase, guarded: Callable[..., None], way: str
) -> None:
    if not _runs_here(case):
        pytest.skip(f"{case.name}: needs jax {case.min_jax} and a CPU run ({case.detector})")
    guarded(checks="races")
    _, finding = _run(case)
    decisions = pallas_guard.decisions()
    assert {d.interpreter for d in decisions} == {"plain"}, decisions  # never moved off plain
    # The check ran: a failure of its own would leave the kernel unchecked, with a note alone.
    assert not [n for d in decisions for n in d.notes if "could not be checked" in n], decisions
    if case.kind is None:
        assert finding is None, finding
    else:
        assert finding is not None, f"{case.name}: no finding"
        assert finding.startswith(f"pallas_guard: a race ({RACE_KINDS[case.kind]}"), finding
    if case.detector == "hangs" or not _tpu_detector_has_races() or way == "table_way":
        return
    # The same kernel in TPU interpret mode with its detector, through the guard's old route.
    guarded(checks="races", interpreter="tpu")
    _, detected = _run(case)
    assert (detected is not None) == (case.detector == "race"), (case.name, detected)
    if detected is not None:
        assert finding is not None  # every race the detector reports, the check finds
    elif finding is not None:
        assert case.kind in BLIND, (case.name, finding)  # a finding the detector misses: said why


@pytest.mark.parametrize("case", [c for c in CASES if c.values[0].kind is None])
def test_with_no_race_the_checked_run_gives_the_unchecked_bits_eager_and_under_jit(
    case: race_corpus.RaceCase, guarded: Callable[..., None], way: str
) -> None:
    if not _runs_here(case):
        pytest.skip(f"{case.name}: needs jax {case.min_jax} and a CPU run ({case.detector})")
    guarded(checks="none")
    unchecked, _ = _run(case)
    for jit in (False, True):
        guarded(checks="races")
        checked, finding = _run(case, jit=jit)
        assert finding is None, finding
        for a, b in zip(jax.tree.leaves(unchecked), jax.tree.leaves(checked), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_race_finding_names_the_kernel_both_lines_the_region_and_the_grid_step(
    jit: bool, guarded: Callable[..., None], way: str
) -> None:
    guarded(checks="races")
    case = race_corpus.case("read_before_wait.overlapping_rows")
    fn, args = case.build(None)
    with pytest.raises(PallasGuardError) as info:
        jax.block_until_ready((jax.jit(fn) if jit else fn)(*args))
    text = str(info.value)
    assert "in Pallas kernel '_read_before_wait_part'" in text
    assert "found by the races check (checks=races from install(" in text
    # The read (rows 4-11) and the DMA (rows 0-7) share rows 4-7 of the scratch buffer.
    assert "the read at race_corpus.py:" in text and "o_ref[...] = buf[pl.ds(R // 2, R)]" in text
    assert "the DMA started at race_corpus.py:" in text and "copy.start()" in text
    assert "both touch `buf`[4:8, 0:128] at grid step (0,)" in text
    assert "To fix:" in text
    [found] = [d for d in pallas_guard.decisions() if d.action == "found"]
    assert found.check == "races" and found.interpreter == "plain"


def test_a_race_in_a_later_grid_step_names_that_step(guarded: Callable[..., None]) -> None:
    guarded(checks="races")
    _, finding = _run(race_corpus.case("left_in_flight.unguarded_prefetch"))
    assert finding is not None and finding.startswith("pallas_guard: a race (a DMA still in flight at the end")
    assert "at grid step (2,)" in finding  # the last of three steps, where the kernel ends


def _instrumented(name: str) -> tuple[dict[str, Any], dict[str, Any], dma_table.Instrumented]:
    """(the kernel's params, what the check makes of them, what its findings refer to)."""
    fn, args = race_corpus.case(name).build(True)
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    [eqn] = [e for e in jax_state.jaxpr_equations(jaxpr) if e.primitive.name == "pallas_call"]
    params = jax_state.private_params(dict(eqn.params))
    instrumented = dma_table.Instrumented()
    return params, _dma_races.instrument(params, instrumented), instrumented


@pytest.mark.parametrize(
    "name", ["valid.reuse_after_wait", "valid.staging_loop_waited", "valid.cond_branch", "valid.run_scoped"]
)
def test_a_kernel_that_waits_its_dmas_in_the_same_step_is_decided_while_tracing_and_left_as_it_is(name: str) -> None:
    # Its DMAs in flight are the same whichever way it runs, and none is where it touches a buffer.
    params, checked, instrumented = _instrumented(name)
    assert checked is params and not instrumented.points


def test_a_kernel_that_races_for_certain_is_decided_while_tracing_with_one_check_and_no_table() -> None:
    params, checked, instrumented = _instrumented("read_before_wait.overlapping_rows")
    assert [p.kind for p in instrumented.points] == [1]  # the read, against the one DMA in flight
    assert len(checked["jaxpr"].invars) == len(params["jaxpr"].invars)


def _read_at(offset: int) -> tuple[Any, tuple[Any, ...]]:
    """A kernel that reads 8 rows of its scratch buffer at ``offset`` (a scalar-prefetch operand)
    while a DMA into rows 0-7 is in flight: a race for offsets 1-7, none from 8 on."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    rows = race_corpus.R

    def kernel(offset_ref, x_hbm, o_ref, buf, sem):  # type: ignore[no-untyped-def]
        buf[pl.ds(rows, rows)] = jnp.full((rows, 128), 2.0, jnp.float32)
        copy = pltpu.make_async_copy(x_hbm, buf.at[pl.ds(0, rows)], sem)
        copy.start()
        o_ref[...] = buf[pl.ds(offset_ref[0], rows)]
        copy.wait()

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, 128), lambda i, offset: (0, 0)),
        scratch_shapes=[pltpu.VMEM((2 * rows, 128), jnp.float32), pltpu.SemaphoreType.DMA],
    )
    call = pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32))
    return call, (np.array([offset], np.int32), np.ones((rows, 128), np.float32))


def test_a_read_whose_overlap_with_the_dma_in_flight_is_traced_gets_one_check_of_its_index(
    guarded: Callable[..., None],
) -> None:
    call, args = _read_at(8)
    [eqn] = [e for e in jax.make_jaxpr(call)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"]
    params = jax_state.private_params(dict(eqn.params))
    instrumented = dma_table.Instrumented()
    checked = _dma_races.instrument(params, instrumented)
    assert [p.kind for p in instrumented.points] == [1]  # decided while tracing: no table
    assert len(checked["jaxpr"].invars) == len(params["jaxpr"].invars)
    guarded(checks="none")
    unchecked = np.asarray(call(*args)).tobytes()
    guarded(checks="races")
    for jit in (False, True):
        out = jax.block_until_ready((jax.jit(call) if jit else call)(*args))
        assert np.asarray(out).tobytes() == unchecked  # rows 8-15: disjoint, no finding
        call_racing, racing_args = _read_at(4)
        with pytest.raises(PallasGuardError) as info:
            jax.block_until_ready((jax.jit(call_racing) if jit else call_racing)(*racing_args))
        text = str(info.value)
        assert text.startswith("pallas_guard: a race (read of a DMA's destination before its wait)")
        assert "both touch `buf`[4:8, 0:128] at grid step (0,)" in text


STEPPED = ["valid.cross_step_prefetch", "valid.double_buffer_fori", "valid.emit_pipeline"]
"""Valid kernels whose DMAs cross a grid step or loop iteration, placed by program ids and loop
counters alone: followed step by step while lowering."""


SLOTS_AS_VALUES_FROM = (0, 10)
"""The first jax (of those measured: 0.7.2, 0.10.2, 0.12.1) whose `emit_pipeline` carries its buffer
slots as values; before, it keeps them in SMEM scratch, whose loads the step-by-step evaluation
leaves unknown (the table follows it there)."""


@pytest.mark.parametrize("name", STEPPED)
def test_a_kernel_whose_dmas_cross_steps_by_program_ids_alone_is_followed_step_by_step_and_left_as_it_is(
    name: str,
) -> None:
    if name == "valid.emit_pipeline" and jax_lookup.jax_release() < SLOTS_AS_VALUES_FROM:
        pytest.skip("this jax's emit_pipeline keeps its slots in SMEM scratch: the table follows it")
    params, checked, instrumented = _instrumented(name)
    assert checked is params and not instrumented.points and not instrumented.sites


@pytest.mark.parametrize("name", STEPPED)
def test_past_the_step_by_step_budget_the_table_follows_the_kernel(
    name: str, monkeypatch: pytest.MonkeyPatch, guarded: Callable[..., None]
) -> None:
    monkeypatch.setattr(dma_stepped, "BUDGET", 10)
    _, checked, _ = _instrumented(name)
    assert _has_table(checked)
    guarded(checks="races")
    assert _run(race_corpus.case(name))[1] is None


def test_a_kernel_whose_dmas_depend_on_values_it_loads_gets_the_table() -> None:
    # Paged attention: which page each DMA moves is read from a scalar-prefetch operand.
    _, checked, _ = _instrumented("valid.paged_attention")
    assert _has_table(checked)


def _has_table(checked: dict[str, Any]) -> bool:
    """Whether the checked kernel carries the table of DMAs in flight (its last scratch operand)."""
    return tuple(checked["jaxpr"].invars[-1].aval.shape) == (dma_table.SLOTS + 1, dma_table.FIELDS)


@pytest.mark.parametrize("case", [c for c in CASES if c.values[0].kind is not None])
def test_every_racy_kernel_gets_a_check_whichever_way_it_is_decided(case: race_corpus.RaceCase) -> None:
    # Following the steps only ever leaves a kernel unchecked when no step races.
    if jax_lookup.jax_release() < case.min_jax:
        pytest.skip(f"{case.name}: needs jax {case.min_jax}")
    params, checked, instrumented = _instrumented(case.name)
    assert checked is not params and instrumented.points


def test_a_kernel_without_dmas_is_not_traced_again() -> None:
    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] * 2

    from jax.experimental import pallas as pl

    x = np.ones((8, 128), np.float32)
    jaxpr = jax.make_jaxpr(functools.partial(pl.pallas_call(kernel, out_shape=x, interpret=True)))(x)
    [eqn] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert not dma_jaxpr.has_dmas(eqn.params["jaxpr"])  # the checked lowering leaves it as it is


def test_the_table_is_one_scratch_buffer_more_and_changes_no_block() -> None:
    params, instrumented, _ = _instrumented("read_before_wait.next_grid_step")
    before, after = params["jaxpr"].invars, instrumented["jaxpr"].invars
    assert len(after) == len(before) + 1  # the table of DMAs in flight
    assert [v.aval for v in after[:-1]] == [v.aval for v in before]
    assert instrumented["grid_mapping"].block_mappings == params["grid_mapping"].block_mappings


def test_a_kernel_whose_dmas_the_check_cannot_follow_runs_unchecked_and_its_decision_says_why(
    guarded: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A primitive the check does not descend into holds the DMAs: here `cond`, made unknown to it.
    monkeypatch.setattr(dma_jaxpr, "_HANDLED", dma_jaxpr._HANDLED - {"cond"})
    guarded(checks="races")
    out, finding = _run(race_corpus.case("read_before_wait.in_cond_branch"))
    assert finding is None and out is not None  # the race goes unseen: the note must say so
    [decision] = pallas_guard.decisions()
    assert decision.interpreter == "plain"
    assert decision.notes == (
        "runs unchecked: races could not be checked: it has DMAs inside `cond`, which the check does not follow",
    )


# --- the corpus on a real TPU v5e: what a race does to the chip's answer ----------------------------

TPU_RECORDS = Path(__file__).parent / "data" / "race_corpus_tpu_v5e"
"""Each corpus kernel compiled and run on a TPU v5e (``benchmarks/race_tpu.py``): its outputs (``.npz``,
``<case>/arr_<i>``) and its fate (``.json``: ran, failed with the chip's error, or not run)."""


def _chip(case: race_corpus.RaceCase) -> tuple[str, list[np.ndarray]]:
    import json

    fate = json.loads(TPU_RECORDS.with_suffix(".json").read_text())["status"][case.name]
    with np.load(TPU_RECORDS.with_suffix(".npz")) as recorded:
        outputs = [recorded[k] for k in sorted(recorded.files) if k.startswith(f"{case.name}/")]
    return fate, outputs


def test_on_the_tpu_every_valid_kernel_gives_the_plain_interpreters_bytes_and_the_races_change_the_answer(
    guarded: Callable[..., None],
) -> None:
    """The check's verdicts held against the chip: a kernel it passes computes on the TPU what the
    plain interpreter computes on the CPU (paged attention: within the MXU's rounding), and of the
    kernels it finds a race in, the chip computed something else or halted for most (a race's
    outcome depends on timing: a few land the same bytes)."""
    guarded(checks="races")
    changed, runs = 0, 0
    for case in race_corpus.CASES:
        if not _runs_here(case):
            continue
        fate, chip = _chip(case)
        if case.kind == "wait_without_start":
            assert fate.startswith("not run")  # the core would wait forever
            continue
        mine, finding = _run(case)
        if case.kind is None:
            assert fate == "ran" and finding is None, (case.name, fate, finding)
            ours = [np.asarray(o) for o in jax.tree.leaves(mine)]
            assert len(ours) == len(chip)
            if case.name == "valid.paged_attention":
                for a, b in zip(ours, chip, strict=True):
                    np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)
            else:
                assert all(a.tobytes() == b.tobytes() for a, b in zip(ours, chip, strict=True)), case.name
            continue
        assert finding is not None, case.name
        runs += 1
        if fate != "ran":
            changed += 1  # the chip refused or halted
            continue
        fn, args = case.build(True)  # the plain interpreter, unchecked: what a CPU run returns
        with pallas_guard.policy(checks=()):
            plain = [np.asarray(o) for o in jax.tree.leaves(jax.block_until_ready(fn(*args)))]
        changed += any(a.tobytes() != b.tobytes() for a, b in zip(plain, chip, strict=True))
    assert runs == 17
    assert changed >= 13  # measured: 13 different answers and one core halt of 17


def _whole_and_part_on_one_semaphore(interpret: Any = None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Step 0 starts a DMA of 16 rows into all of `whole` and one of 8 rows into `part`, on one
    semaphore; step 1 waits for 8 rows' bytes, which the older DMA's bytes cover, so the DMA into
    `part` may still be in flight when step 1 reads it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    rows = race_corpus.R

    def kernel(x_hbm, o_ref, whole, part, sem):  # type: ignore[no-untyped-def]
        i = pl.program_id(0)
        into_whole = pltpu.make_async_copy(x_hbm, whole, sem)
        into_part = pltpu.make_async_copy(x_hbm.at[pl.ds(0, rows)], part, sem)

        @pl.when(i == 0)
        def _() -> None:
            into_whole.start()
            into_part.start()

        @pl.when(i == 1)
        def _() -> None:
            into_part.wait()
            o_ref[...] = part[...]  # the DMA into `part` is waited only below
            into_whole.wait()

    call = pl.pallas_call(
        kernel,
        grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32),
        scratch_shapes=[
            pltpu.VMEM((2 * rows, 128), jnp.float32),
            pltpu.VMEM((rows, 128), jnp.float32),
            race_corpus.DMA,
        ],
        interpret=interpret,
    )
    return call, (np.ones((2 * rows, 128), np.float32),)


def test_a_wait_counts_the_bytes_of_a_dma_of_a_whole_buffer_when_the_grid_is_followed_step_by_step(
    guarded: Callable[..., None],
) -> None:
    # Counted wrongly, the wait would complete the DMA into `part` too, and the read would pass.
    guarded(checks="races")
    call, args = _whole_and_part_on_one_semaphore()
    with pytest.raises(PallasGuardError) as info:
        jax.block_until_ready(call(*args))
    text = str(info.value)
    assert text.startswith("pallas_guard: a race (read of a DMA's destination before its wait)"), text
    assert "`part`[0:8, 0:128] at grid step (1,)" in text, text
