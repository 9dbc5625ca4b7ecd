"""The compile check: a Mosaic-TPU kernel the guard interprets is also compiled by libtpu for the
device's TPU generation, on this CPU; a refusal is a finding of the TPU's own error type.

Needs libtpu next to jax (``.ci/run tpu`` installs it); elsewhere only the note that says how to
install it is tested.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard import PallasGuardError
from pallas_guard._running import tpu_compile as _tpu_compile

needs_libtpu = pytest.mark.skipif(_tpu_compile.available() is not None, reason=str(_tpu_compile.available()))


def add_one(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


def _kernel(shape: tuple[int, int], dtype: Any, block: tuple[int, int] | None = None) -> Any:
    block = block or shape
    spec = pl.BlockSpec(block, lambda i: (i, 0))
    return pl.pallas_call(
        add_one,
        out_shape=jax.ShapeDtypeStruct(shape, dtype),
        grid=(shape[0] // block[0],),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=pltpu.CompilerParams(),
    )


def _unchecked(call: Any, x: Any) -> bytes:
    with pallas_guard.policy(checks="none"):
        return np.asarray(call(x)).tobytes()


@needs_libtpu
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_kernel_that_compiles_is_silent_bit_identical_and_says_what_it_spends(guard: Any, traced: bool) -> None:
    guard("interpret", checks="compile")
    call = _kernel((64, 128), jnp.float32, (8, 128))
    x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
    out = (jax.jit(call) if traced else call)(x)
    assert np.asarray(out).tobytes() == _unchecked(call, x)
    notes = [n for d in pallas_guard.decisions() for n in d.notes if n.startswith("compile:")]
    assert notes and notes[0].startswith("compile: compiles for tpu-v5e: VMEM ") and " of 16.0 MiB" in notes[0]


@needs_libtpu
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("shape", "dtype", "said"),
    [
        ((4096, 8192), jnp.float32, "Ran out of memory in memory space vmem"),
        ((64, 128), jnp.float16, "Invalid vector type for load"),
    ],
    ids=["vmem overflow", "float16 on v5e"],
)
def test_what_the_tpu_compiler_refuses_is_a_finding_of_its_type(
    guard: Any, traced: bool, shape: tuple[int, int], dtype: Any, said: str
) -> None:
    guard("interpret", checks="compile")
    call = _kernel(shape, dtype)
    from jax._src.pallas.mosaic.error_handling import MosaicError

    # As the TPU raises it: MosaicError or JaxRuntimeError, by jax version (the TPU records agree).
    with pytest.raises((jax.errors.JaxRuntimeError, MosaicError)) as raised:
        (jax.jit(call) if traced else call)(jnp.zeros(shape, dtype))
    assert isinstance(raised.value, PallasGuardError)
    text = str(raised.value)
    assert "found by the compile check" in text and "for tpu-v5e" in text and said in text
    assert "add_one" in text and "test_compile_check.py" in text
    found = [d for d in pallas_guard.decisions() if d.action == "found"]
    assert [d.check for d in found] == ["compile"]


@needs_libtpu
def test_each_generation_has_its_own_limit() -> None:
    """One 32 MiB block in and one out need 64 MiB of scoped VMEM: v5e refuses them at its default
    16 MiB scoped limit, and so does v4 (the compiler's own verdict and message, per generation)."""
    x = jnp.zeros((2048, 4096), jnp.float32)
    verdicts = {}
    for device in ("tpu-v5e", "tpu-v4"):
        pallas_guard.install("interpret", checks="compile", device=device)
        call = _kernel((2048, 4096), jnp.float32)  # built under the guard, as a user's kernel is
        try:
            call(x)
            verdicts[device] = "compiles"
        except PallasGuardError as error:
            verdicts[device] = str(error)
        pallas_guard.uninstall()
    for device, verdict in verdicts.items():
        assert f"for {device}" in verdict and "vmem" in verdict.lower(), verdicts
    assert "limit 16.00M" in verdicts["tpu-v5e"], verdicts


def test_without_libtpu_the_decision_says_how_to_install_it(guard: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tpu_compile, "available", lambda: "libtpu is not installed: pip install 'libtpu==0.0.1'")
    guard("interpret", checks="compile")
    call = _kernel((64, 128), jnp.float32)
    call(jnp.zeros((64, 128)))
    notes = [n for n in pallas_guard.decisions()[-1].notes if n.startswith("compile:")]
    assert notes == ["compile: not checked: libtpu is not installed: pip install 'libtpu==0.0.1'"]


def test_a_triton_kernel_is_compiled_for_a_gpu_not_for_the_tpu_of_the_device_setting(guard: Any) -> None:
    from jax.experimental.pallas import triton as pltriton

    guard("interpret", checks="compile", device="tpu-v5e")
    spec = pl.BlockSpec((16, 128), lambda i: (i, 0))
    call = pl.pallas_call(
        add_one,
        out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=pltriton.CompilerParams(num_warps=4),
    )
    call(jnp.zeros((32, 128)))
    from pallas_guard._running import gpu_compile

    missing = gpu_compile.available()
    notes = [n for n in pallas_guard.decisions()[-1].notes if n.startswith("compile:")]
    # The device setting names no GPU: the family's default one (an H100) is compiled for.
    (note,) = notes
    assert note == f"compile: not checked: {missing}" if missing else note.startswith("compile: compiles for h100: ")


def test_operands_libtpu_aborts_on_are_not_compiled_in_this_process() -> None:
    """libtpu ends the process (a fatal check) on a semaphore output or host operands: such a
    kernel is left uncompiled, with a note, rather than taking the user's program down."""
    from pallas_guard._checks import compile as _compile_check

    semaphore_out = {"out_shape": pltpu.SemaphoreType.DMA(()), "out_specs": pl.BlockSpec(memory_space=pltpu.SEMAPHORE)}
    assert _compile_check._aborting_memory_space(semaphore_out) is not None
    vmem = {"in_specs": [pl.BlockSpec((8, 128), lambda i: (i, 0))], "out_specs": pl.BlockSpec(memory_space=pltpu.VMEM)}
    assert _compile_check._aborting_memory_space(vmem) is None


@needs_libtpu
def test_a_verdict_is_kept_per_generation(guard: Any) -> None:
    """What compiled for one generation is not taken for another's verdict in the same session."""
    guard("interpret", checks="compile")
    call = _kernel((2048, 4096), jnp.float32)
    x = jnp.zeros((2048, 4096), jnp.float32)
    with pallas_guard.policy(device="tpu-v5e"), pytest.raises(PallasGuardError, match="for tpu-v5e"):
        call(x)
    small = _kernel((64, 128), jnp.float32)
    with pallas_guard.policy(device="tpu-v6e"):
        small(jnp.zeros((64, 128)))
    with pallas_guard.policy(device="tpu-v4"):
        small(jnp.zeros((64, 128)))
    notes = [n for d in pallas_guard.decisions() for n in d.notes if n.startswith("compile: compiles")]
    assert [n.split(":")[1].strip() for n in notes] == ["compiles for tpu-v6e", "compiles for tpu-v4"]


@needs_libtpu
def test_a_list_of_generations_says_which_compile_it_and_which_refuse(guard: Any) -> None:
    """Two 12 MiB blocks (in and out, double-buffered: 24 MiB of scoped VMEM) fit v6e's 32 MiB
    default and overflow v4's and v5e's 16 MiB: the finding names the generation that refuses
    first in the list, the one that compiles, and the other that refuses too."""
    guard("interpret", checks="compile", device=["tpu-v4", "tpu-v6e", "tpu-v5e"])
    call = _kernel((3072, 1024), jnp.float32, (1536, 1024))
    with pytest.raises(PallasGuardError) as raised:
        call(jnp.zeros((3072, 1024), jnp.float32))
    text = str(raised.value)
    assert "compile for tpu-v4 (the device setting; it compiles for tpu-v6e; tpu-v5e refuses it too)" in text
    assert "Ran out of memory in memory space vmem" in text

    small = _kernel((64, 128), jnp.float32)
    small(jnp.zeros((64, 128)))
    note = next(n for n in pallas_guard.decisions()[-1].notes if n.startswith("compile:"))
    assert [part.split(":")[0] for part in note.removeprefix("compile: compiles for ").split("; ")] == [
        "tpu-v4",
        "tpu-v6e",
        "tpu-v5e",
    ]


@needs_libtpu
def test_a_compile_that_succeeded_is_kept_on_disk_and_a_refusal_is_not(
    guard: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A later run (here: the guard reinstalled, JAX's caches cleared) reads the kept compile, with
    the same numbers, and says so; a refusal is not kept on disk (a later run compiles it again);
    a damaged entry is compiled again and rewritten."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kept = tmp_path / "pallas_guard" / "tpu-compiles"

    def first_call_note() -> str:
        jax.clear_caches()
        pallas_guard.uninstall()
        guard("interpret", checks="compile")
        _kernel((64, 128), jnp.float32, (8, 128))(jnp.zeros((64, 128)))  # built where the guard sees it
        return [n for d in pallas_guard.decisions() for n in d.notes if n.startswith("compile:")][-1]

    compiled = first_call_note()
    assert "cached" not in compiled
    assert len(list(kept.glob("*.json"))) == 1
    assert first_call_note() == compiled + " (cached: an earlier run compiled it)"

    entry = next(kept.glob("*.json"))
    entry.write_text("{not json")
    assert first_call_note() == compiled
    assert first_call_note() == compiled + " (cached: an earlier run compiled it)"

    for _ in range(2):
        with pytest.raises(PallasGuardError, match="Invalid vector type for load"):
            _kernel((64, 128), jnp.float16)(jnp.zeros((64, 128), jnp.float16))
        pallas_guard.uninstall()
        guard("interpret", checks="compile")
    assert len(list(kept.glob("*.json"))) == 1

    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=16384")  # other compiler flags
    assert first_call_note() == compiled
    assert len(list(kept.glob("*.json"))) == 2


@needs_libtpu
def test_a_vmem_overflow_says_which_operands_window_overflows(guard: Any) -> None:
    """The TPU compiler's list of allocations, summed up: the largest three by operand and window
    (what JAX's own VMEM tests look for), in a finding of at most 15 lines. Lowered only: nothing
    is allocated."""
    guard("interpret", checks="compile")
    block, shape = (2048, 8192), (4096, 16384)  # 64 MiB windows, double-buffered, in and out: 256 of 128 MiB
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    call = pl.pallas_call(
        add_one,
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        grid=(2, 2),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=pltpu.CompilerParams(),
    )
    with pytest.raises(jax.errors.JaxRuntimeError) as raised:
        jax.jit(call).lower(jax.ShapeDtypeStruct(shape, jnp.float32))
    text = str(raised.value)
    assert isinstance(raised.value, PallasGuardError)
    assert "for input 0 (window f32[2048,8192])" in text and "for output 0 (window f32[2048,8192])" in text
    assert "more lines" not in text and len(text.splitlines()) <= 15


@needs_libtpu
def test_the_kernels_own_lower_goes_through_the_checks(guard: Any) -> None:
    """``kernel.lower(...)`` (a kernel JAX returns jitted) is checked as ``jax.jit(kernel).lower(...)``
    is: the TPU compiler's refusal at the user's line, not a CPU lowering that skips the check."""
    guard("interpret", checks="compile")
    call = _kernel((2048, 4096), jnp.float32)  # 32 MiB blocks, in and out: over v5e's 16 MiB
    if not hasattr(call, "lower"):
        pytest.skip("this jax's pallas_call returns a plain function")
    with pytest.raises(PallasGuardError, match="for tpu-v5e"):
        call.lower(jax.ShapeDtypeStruct((2048, 4096), jnp.float32))
    with pallas_guard.policy(checks="none"):
        call.lower(jax.ShapeDtypeStruct((2048, 4096), jnp.float32))  # JAX's own stage, unchecked


@needs_libtpu
def test_a_kernel_without_inputs_is_compiled_for_the_tpu(guard: Any) -> None:
    """Nothing of its own places such a kernel on the TPU: its outputs are. Two 10 MiB windows of an
    output revisited at every step exceed v5e's 16 MiB (JAX's test_automatic_single_buffering); the
    same output with one window a step compiles."""

    def writes_nothing(o_ref):  # type: ignore[no-untyped-def]
        del o_ref

    guard("interpret", checks="compile", device="tpu-v5e")
    out = jax.ShapeDtypeStruct((100 * 1024 * 1024,), jnp.int8)
    window = 10 * 1024 * 1024

    def kernel(index_map: Any) -> Any:
        return pl.pallas_call(writes_nothing, grid=(4, 1), out_shape=out, out_specs=pl.BlockSpec((window,), index_map))

    with pytest.raises(jax.errors.JaxRuntimeError, match="Ran out of memory in memory space vmem"):
        jax.jit(kernel(lambda i, j: (j + i,))).lower()
    jax.jit(kernel(lambda i, j: (j,))).lower()
    note = [n for d in pallas_guard.decisions() for n in d.notes if n.startswith("compile:")][-1]
    assert note.startswith("compile: compiles for tpu-v5e: VMEM 10.0 MiB of 16.0 MiB"), note


_COMPILES: list[list[str]] = []
"""Where XLA's compiles are counted: the list of the test counting them, if any (JAX keeps a
listener for the life of the process: one is registered, once)."""


def _count_compiles(event: str, duration: float, **_: Any) -> None:
    import threading

    if (
        event == "/jax/core/compile/backend_compile_duration"
        and _COMPILES
        and threading.current_thread().name == "MainThread"
    ):
        _COMPILES[-1].append("xla")


@pytest.fixture
def judged(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """Events in order, from ``judged.clear()`` on: "verdict" when the compile check asks for
    libtpu's verdict, "xla" when XLA has compiled a program in the main thread (libtpu compiles in a
    thread of its own). A fresh cache folder: every verdict is compiled, none read from disk."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    events: list[str] = []
    start = _tpu_compile.start_compile

    def started(*args: Any, **kwargs: Any) -> _tpu_compile.Compiling:
        compiling = start(*args, **kwargs)

        def outcome() -> _tpu_compile.Outcome:
            events.append("verdict")
            return compiling.outcome()

        return _tpu_compile.Compiling(outcome, compiling.ready)

    monkeypatch.setattr(_tpu_compile, "start_compile", started)
    if not _COMPILES:
        jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    _COMPILES.append(events)
    yield events
    _COMPILES.remove(events)


@needs_libtpu
@pytest.mark.parametrize("how", ["jit call", "lower", "vmap of a jitted function"])
def test_a_jit_call_waits_for_the_verdict_just_before_its_program_runs(guard: Any, judged: list[str], how: str) -> None:
    """A jit call lowers, compiles and runs its program before it returns: the compile check waits
    for libtpu's verdict just before the program runs, so that libtpu compiles while JAX lowers the
    program and XLA compiles it. A trace alone (``.lower()``), or a jitted function transformed after
    it was traced (``vmap``), waits as the kernel is traced."""
    guard("interpret", checks="compile", device="tpu-v5e")
    call = jax.jit(_kernel((64, 128), jnp.float32))
    x = jnp.ones((64, 128), jnp.float32)
    xs = jnp.stack([x, 2 * x])
    expected = np.asarray(xs) + 1
    events = judged
    events.clear()
    if how == "jit call":
        np.testing.assert_array_equal(np.asarray(call(x)), np.asarray(x) + 1)
        assert events[-2:] == ["xla", "verdict"], events
    elif how == "lower":
        call.lower(x)
        assert events == ["verdict"], events
    else:
        np.testing.assert_array_equal(np.asarray(jax.vmap(call)(xs)), expected)
        assert events[0] == "verdict" and "xla" in events, events
    [decision] = [d for d in pallas_guard.decisions() if d.action == "interpreted"]
    assert decision.notes[-1].startswith("compile: compiles for tpu-v5e: VMEM "), decision.notes


@needs_libtpu
def test_a_refusal_waited_for_before_the_run_stops_the_program_before_it_runs(guard: Any, judged: list[str]) -> None:
    """The verdict of a kernel in a jit call arrives after the program was lowered and compiled: a
    refusal is raised before anything of the program runs (a host callback beside the kernel never
    fires), as the refusal's own finding, and the decision the program's lowering recorded for the
    kernel is taken back: it was never interpreted."""
    guard("interpret", checks="compile", device="tpu-v5e")
    x = jnp.zeros((8192, 1024), jnp.float32)
    events = judged
    events.clear()
    ran: list[Any] = []
    refused = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8192, 1024), jnp.float32))

    def program(x: Any) -> Any:
        jax.debug.callback(lambda: ran.append("the program ran"))
        return refused(x)

    with pytest.raises(PallasGuardError, match=r"Scoped allocation with size 64\.00M and limit 16\.00M"):
        jax.jit(program)(x)
    assert events[-2:] == ["xla", "verdict"], events
    assert ran == []
    assert [d.action for d in pallas_guard.decisions()] == ["found"]
    # JAX would keep the call's trace and executable, and run them at the next call of the same
    # shapes without a trace: the next call is traced again and refused there, before any compile.
    again = x + 1
    judged.clear()
    with pytest.raises(PallasGuardError, match="Scoped allocation"):
        jax.jit(program)(again)
    assert ran == []
    assert judged == ["verdict"], judged


@needs_libtpu
def test_a_jit_call_that_fails_before_its_program_runs_leaves_no_verdict_to_another(
    guard: Any, judged: list[str]
) -> None:
    """A wait belongs to the jit call that traced the kernel: where that call fails before its
    program runs (here its function raises after the kernel), the verdict is never asked for, and
    the next program (another call, with nothing refused in it) runs."""
    guard("interpret", checks="compile", device="tpu-v5e")
    x = jnp.zeros((8192, 1024), jnp.float32)
    refused = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
    judged.clear()

    def program(x: Any) -> Any:
        refused(x)
        raise ValueError("the program's own failure, after the kernel")

    with pytest.raises(ValueError, match="the program's own failure"):
        jax.jit(program)(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x * 2)(x + 1)), np.full(x.shape, 2.0))
    assert "verdict" not in judged, judged
    assert [d.action for d in pallas_guard.decisions()] == []


@needs_libtpu
def test_under_a_mesh_of_this_hosts_devices_the_kernel_is_compiled_for_the_tpu(guard: Any) -> None:
    """`jax.set_mesh` puts this host's devices in force, where jit refuses operands placed on a TPU
    topology (JAX's test_shard_map_check_vma): the check lowers the kernel with no mesh of the
    host's in force, inside ``shard_map`` and outside it (where the whole kernel runs on each chip)."""
    if not hasattr(jax, "set_mesh") or not hasattr(jax, "shard_map"):
        pytest.skip("this jax has no jax.set_mesh / jax.shard_map")
    from jax.sharding import PartitionSpec as P

    guard("interpret", checks="compile", device="tpu-v5e")
    auto: Any = getattr(jax.sharding, "AxisType", None)
    mesh = jax.make_mesh((1,), ("x",), **({"axis_types": (auto.Auto,)} if auto else {}))
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
        inner = jax.shard_map(
            lambda x: pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
        mapped = jax.jit(inner)(x)
        whole = jax.jit(pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype)))(x)
        refused = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8192, 1024), jnp.float32))
        with pytest.raises(PallasGuardError, match=r"Scoped allocation with size 64\.00M and limit 16\.00M"):
            jax.jit(refused)(jnp.zeros((8192, 1024), jnp.float32))
    for out in (mapped, whole):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1)
    interpreted = [d for d in pallas_guard.decisions() if d.action == "interpreted"]
    assert len(interpreted) == 2
    for decision in interpreted:
        assert decision.notes[0].startswith("compile: compiles for tpu-v5e: VMEM "), decision.notes


def _refused_by_the_compiler() -> list[str]:
    import json
    from pathlib import Path

    records = json.loads((Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json").read_text())["cases"]
    return sorted(name for name, record in records.items() if record["phase"] == "compile")


@needs_libtpu
@pytest.mark.parametrize("name", _refused_by_the_compiler())
def test_every_compile_refusal_is_short_and_says_how_to_fix_it(guard: Any, name: str) -> None:
    """Each kernel libtpu refuses (VMEM, SMEM, tiling, types, alignment, core-parallel axes): the
    finding keeps the TPU's message, at most 15 lines with its "To fix", no "report a bug" line
    (the kernel is at fault) and no raw protocol buffer."""
    import tpu_corpus

    case = tpu_corpus.by_name(name)
    guard("interpret", checks="compile", device="tpu-v5e")
    with pytest.raises(PallasGuardError) as raised:
        jax.block_until_ready(case.build()(*case.inputs()))
    text = str(raised.value)
    assert "found by the compile check" in text and len(text.splitlines()) <= 15, text
    assert "\nTo fix: " in text and "Please report a bug" not in text and "type.googleapis.com" not in text


@needs_libtpu
def test_a_refused_kernel_is_compiled_once_per_process(guard: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three calls of a kernel libtpu refuses: three findings, one compile (the refusal is kept for
    the process, by what was compiled, for which generation)."""
    compiles: list[int] = []
    compile_once = jax.stages.Lowered.compile

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiles.append(1)
        return compile_once(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    monkeypatch.setattr(_tpu_compile, "_refused", {})  # as in a new process: no test before refused it
    guard("interpret", checks="compile")
    call = _kernel((64, 128), jnp.float16)
    for _ in range(3):
        with pytest.raises(PallasGuardError, match="Invalid vector type for load"):
            call(jnp.zeros((64, 128), jnp.float16))
    assert len(compiles) == 1
    assert len([d for d in pallas_guard.decisions() if d.action == "found"]) == 3


RACING_WORKER = """
import sys, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import pallas_guard

pallas_guard.install("interpret", checks="compile", device="tpu-v5e")

def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

sys.stdin.readline()  # every worker starts its compile together
spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
call = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32), grid=(8,),
                      in_specs=[spec], out_specs=spec)
print(float(call(jnp.zeros((64, 128)))[0, 0]))
print([n for d in pallas_guard.decisions() for n in d.notes if n.startswith("compile:")][-1])
"""


@needs_libtpu
def test_workers_compiling_one_kernel_at_once_share_one_whole_cache_entry(tmp_path: Any) -> None:
    """pytest-xdist workers (here four processes released together) compile the same kernel into
    one cache: each gets the verdict, the entry is whole JSON, no temporary file is left, and a
    later round reads it in every worker."""
    import subprocess
    import sys

    from conftest import clean_env

    env = clean_env({"JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path)})

    def round_of(count: int) -> list[str]:
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", RACING_WORKER],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]
        outputs = [worker.communicate("go\n", timeout=240) for worker in workers]
        assert all(worker.returncode == 0 for worker in workers), [err for _, err in outputs]
        return [out.split("\n")[1] for out, _ in outputs]

    first = round_of(4)
    assert all(note.startswith("compile: compiles for tpu-v5e: VMEM ") for note in first)
    kept = tmp_path / "pallas_guard" / "tpu-compiles"
    entries = list(kept.iterdir())
    assert [entry.suffix for entry in entries] == [".json"], entries  # one entry, no temporary left
    json.loads(entries[0].read_text())
    assert all(note.endswith("(cached: an earlier run compiled it)") for note in round_of(2))


def _two_inputs(rows: int, *, constant_second: bool = False) -> Any:
    def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + y_ref[...]

    spec = pl.BlockSpec((rows, 1024), lambda i: (i, 0))
    second = pl.BlockSpec((rows, 1024), lambda i: (0, 0)) if constant_second else spec
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((2 * rows, 1024), jnp.float32),
        grid=(2,),
        in_specs=[spec, second],
        out_specs=spec,
    )


@needs_libtpu
@pytest.mark.parametrize(("rows", "constant_second"), [(1024, False), (2048, True), (4096, True)])
def test_a_scoped_vmem_refusal_names_blocks_that_fit_and_they_compile(
    guard: Any, rows: int, constant_second: bool
) -> None:
    """The "To fix" of a scoped VMEM overflow names the blocks that fit, in the kernel's own
    operands; called with them, libtpu compiles the kernel (an operand whose block never changes is
    single-buffered by the compiler: the figure is libtpu's, not double the blocks)."""
    import re

    guard("interpret", checks="compile", device="tpu-v5e")
    x = jnp.ones((2 * rows, 1024), jnp.float32)
    with pytest.raises(PallasGuardError) as info:
        _two_inputs(rows, constant_second=constant_second)(x, x)
    fix = str(info.value).split("\nTo fix: ")[1]
    found = re.search(
        r"blocks that fit: \((\d+), 1024\) instead of \(" + str(rows) + r", 1024\) for input 0, input 1 "
        r"and output 0",
        fix,
    )
    assert found is not None, fix
    fitting = int(found.group(1))
    assert fitting % 8 == 0
    y = jnp.ones((2 * fitting, 1024), jnp.float32)
    np.testing.assert_array_equal(_two_inputs(fitting, constant_second=constant_second)(y, y), np.asarray(y) * 2)
    (use,) = [u for u in pallas_guard.decisions()[-1].memory if u.space == "VMEM"]
    assert use.compiled and use.share > 0.9  # the largest that fit: little is left


@needs_libtpu
def test_an_unproven_alignment_fix_names_the_kernels_line(guard: Any) -> None:
    """The compiler names the operation it cannot prove aligned by the kernel's own line (Pallas's
    MosaicError carries it): the "To fix" says where to put ``pl.multiple_of``."""
    import inspect

    from tpu_corpus import _lane_window, cases

    guard("interpret", checks="compile", device="tpu-v5e")
    (case,) = [c for c in cases() if c.name == "align.dynamic_lanes"]
    with pytest.raises(PallasGuardError) as info:
        case.build()(*case.inputs())
    fix = str(info.value).split("\nTo fix: ")[1]
    lines, first = inspect.getsourcelines(_lane_window)
    kernel_lines = {first + offset for offset, line in enumerate(lines) if "ref[" in line}
    found = re.search(r"the compiler points at (.+tpu_corpus\.py):(\d+)\)", fix)
    assert "`pl.multiple_of(index, 128)`" in fix and found is not None, fix
    assert int(found.group(2)) in kernel_lines


@needs_libtpu
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_kernel_built_before_install_is_compiled_in_a_policy_scope(traced: bool) -> None:
    """Its calls never pass the front door: the lowering net compiles its equation for the TPU."""
    pallas_guard.uninstall()
    refused, compiles = _kernel((64, 128), jnp.float16), _kernel((64, 128), jnp.float32, (8, 128))
    pallas_guard.install("interpret", device="tpu-v5e")
    try:
        with pallas_guard.policy(checks="compile"):
            from jax._src.pallas.mosaic.error_handling import MosaicError

            with pytest.raises((jax.errors.JaxRuntimeError, MosaicError)) as raised:
                (jax.jit(refused) if traced else refused)(jnp.zeros((64, 128), jnp.float16))
            x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
            out = (jax.jit(compiles) if traced else compiles)(x)
        assert np.asarray(out).tobytes() == _unchecked(compiles, x)
        decisions = pallas_guard.decisions()
    finally:
        pallas_guard.uninstall()
    assert isinstance(raised.value, PallasGuardError)
    text = str(raised.value)
    assert "found by the compile check" in text and "Invalid vector type for load" in text
    assert "test_compile_check.py" in text
    notes = [n for d in decisions for n in d.notes if n.startswith("compile:")]
    assert notes == [notes[0]] and notes[0].startswith("compile: compiles for tpu-v5e: VMEM ")
    assert [use.space for d in decisions for use in d.memory][:1] == ["VMEM"]


PASSED_ON_FIRST = """
import json, sys
import numpy as np
import jax
from jax.experimental import pallas as pl
import pallas_guard

def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

def program(x):
    return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

pallas_guard.install("interpret", checks=sys.argv[1], device="tpu-v5e", require_checks=True)
# The process's first JAX operation: no backend is initialised when the kernel is traced.
try:
    out = jax.jit(program)(np.zeros((8, 128), np.float32))
    outcome = {"value": float(out[0, 0])}
except pallas_guard.PallasGuardError as finding:
    outcome = {"finding": str(finding)}
outcome["notes"] = [note for d in pallas_guard.decisions() for note in d.notes]
print(json.dumps(outcome))
"""


@needs_libtpu
def test_a_kernel_traced_before_any_backend_is_initialised_is_still_checked() -> None:
    # With libtpu installed and no JAX_PLATFORMS, the front door cannot tell at the trace that the
    # target is the CPU: it passes the kernel on, and the net, which interprets it, makes its checks.
    from conftest import run_python

    def run(checks: str) -> dict[str, Any]:
        result = run_python(PASSED_ON_FIRST.replace("sys.argv[1]", repr(checks)), env={"JAX_PLATFORMS": None})
        assert result.returncode == 0, result.stderr[-3000:]
        outcome: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        return outcome

    compiled = run("compile")
    assert compiled["value"] == 1.0
    (note,) = [n for n in compiled["notes"] if n.startswith("compile:")]
    assert note.startswith("compile: compiles for tpu-v5e: VMEM")
    # A check that needs the operands' values cannot run there: under require_checks, that fails.
    agreed = run("agree")
    assert "the agree check cannot run on Pallas kernel add_one" in agreed["finding"]
    assert "the front door passed its kernel on for an accelerator" in agreed["finding"]
