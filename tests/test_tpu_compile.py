"""The TPU compile check (``pallas_guard._running.tpu_compile``): libtpu's compiler on this CPU, against
what a real TPU v5e did with the same kernels (``tests/data/tpu_v5e_records.json``, recorded by
``benchmarks/tpu_record.py``).

Skipped where libtpu cannot run here (the reason says how to install it); the comparisons with the
records are skipped on a jax other than the one they were recorded with (``benchmarks/tpu_record.py
--deviceless tpu-v5e --compare tests/data/tpu_v5e_records.json`` counts the agreement there).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tpu_corpus

import pallas_guard
from pallas_guard._running import tpu_compile as _tpu_compile
from pallas_guard_autoload import DEVICES

RECORDS = Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json"
GENERATION = "tpu-v5e"
MIB = 1 << 20

MISSING = _tpu_compile.available()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"the TPU compiler cannot run here: {MISSING}")


@functools.cache
def records() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDS.read_text())
    return data


def _recorded(name: str) -> dict[str, Any]:
    record = records()["cases"].get(name)
    if record is None or record.get("status") != "done":
        pytest.fail(f"{name} has no finished TPU record: run benchmarks/tpu_record.py on a TPU")
    return dict(record)


def _same_jax() -> None:
    made = records()["meta"]["jax"]
    if jax.__version__ != made:
        pytest.skip(
            f"the TPU records were made with jax {made}, this is jax {jax.__version__}: count the agreement with "
            "`python benchmarks/tpu_record.py --deviceless tpu-v5e --compare tests/data/tpu_v5e_records.json`"
        )


@functools.cache
def _deviceless(name: str, generation: str = GENERATION) -> _tpu_compile.Outcome:
    case = tpu_corpus.by_name(name)
    return _tpu_compile.compile_kernel(case.build, case.inputs(), {}, generation)


def _tpu_verdict(record: dict[str, Any]) -> str | None:
    """The phase a deviceless compile can see: a run-time failure compiled first."""
    phase = record.get("phase")
    return phase if phase in _tpu_compile.PHASES else None


NAMES = [case.name for case in tpu_corpus.cases()]
REFUSED = [name for name in NAMES if _tpu_verdict(json.loads(RECORDS.read_text())["cases"].get(name, {}))]


# --- the records ------------------------------------------------------------------------------------


def test_records_cover_the_corpus() -> None:
    _same_jax()
    recorded = set(records()["cases"])
    assert recorded == set(NAMES), (
        f"recorded but not in the corpus: {recorded - set(NAMES)}; not recorded: {set(NAMES) - recorded}"
    )
    assert len(NAMES) >= 60
    meta = records()["meta"]
    assert meta["mode"] == "tpu" and meta["device_kind"] == DEVICES[GENERATION][0]
    # Each gate refused something on the chip, and the halting cases were the ones that halted it.
    phases = {_tpu_verdict(record) or record.get("phase") for record in records()["cases"].values()}
    assert {"lower", "compile", "run", None} <= phases
    halted = {name for name, record in records()["cases"].items() if record.get("phase") == "run"}
    assert halted == {case.name for case in tpu_corpus.cases() if case.halts}


# --- (a) the verdict, (b) the error's type ----------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_deviceless_verdict_is_the_tpus(name: str) -> None:
    _same_jax()
    record = _recorded(name)
    outcome = _deviceless(name)
    assert outcome.unchecked is None, outcome.unchecked
    assert outcome.phase == _tpu_verdict(record), outcome.message
    assert tpu_corpus.signature(outcome.message) == (record.get("signature") if _tpu_verdict(record) else None)


@pytest.mark.parametrize("name", REFUSED)
def test_refusal_keeps_the_tpus_exception_type(name: str) -> None:
    _same_jax()
    record = _recorded(name)
    outcome = _deviceless(name)
    assert outcome.error is not None
    kind = type(outcome.error)
    assert f"{kind.__module__}.{kind.__qualname__}" == record["error_type"]
    assert outcome.message == _tpu_compile.first_line(outcome.error)


def test_compile_refusals_include_mosaic_errors_and_runtime_errors() -> None:
    """libtpu refuses with both of the TPU's own types, and the check keeps each."""
    _same_jax()
    kinds = {_recorded(name)["error_type"] for name in REFUSED if _recorded(name)["phase"] == "compile"}
    assert {"jax._src.pallas.mosaic.error_handling.MosaicError", "jax.errors.JaxRuntimeError"} <= kinds
    outcome = _deviceless("dtype.f16_copy")
    from jax._src.pallas.mosaic.error_handling import MosaicError

    assert isinstance(outcome.error, MosaicError) and outcome.phase == "compile"
    assert isinstance(_deviceless("vmem.pair_24mib").error, jax.errors.JaxRuntimeError)


# --- the compiler's numbers ---------------------------------------------------------------------------


def test_vmem_numbers_are_the_tpus_own() -> None:
    """The scoped VMEM the deviceless compile reports is what the TPU's compile reported, kernel by kernel."""
    _same_jax()
    if records()["meta"].get("libtpu") != _tpu_compile._distribution_version("libtpu"):
        pytest.skip("the records were made with another libtpu")
    compared = 0
    for name in NAMES:
        record = _recorded(name)
        if record.get("vmem_used") is None:
            continue
        outcome = _deviceless(name)
        assert (outcome.vmem_used, outcome.vmem_limit) == (record["vmem_used"], record["vmem_limit"]), name
        assert outcome.smem_used == record["smem_declared"], name
        compared += 1
    assert compared >= 50


def test_vmem_used_is_the_double_buffered_blocks() -> None:
    """(8, 128) float32 blocks in and out, each double-buffered: four blocks of scoped VMEM."""
    outcome = _deviceless("tiling.f32_8x128")
    assert outcome.phase is None and outcome.kernels == 1
    assert outcome.vmem_used == 4 * 8 * 128 * 4
    assert outcome.vmem_limit == _tpu_compile.GENERATIONS[GENERATION].scoped_vmem_limit
    assert outcome.smem_limit == _tpu_compile.GENERATIONS[GENERATION].smem_capacity


def test_smem_estimate_counts_the_declared_operands() -> None:
    assert _deviceless("smem.scratch_4kib").smem_used == 1024 * 4  # a (1024,) int32 scratch
    assert _deviceless("index.prefetch_gather").smem_used == 4 * 4  # four prefetched int32 indices
    assert _deviceless("tiling.f32_8x128").smem_used == 0


def test_vmem_limit_bytes_is_the_limit_reported() -> None:
    outcome = _deviceless("vmem.pair_24mib_limit_48mib")
    assert outcome.phase is None
    assert outcome.vmem_limit == 48 * MIB
    assert 24 * MIB <= outcome.vmem_used <= outcome.vmem_limit


# --- (c) jax is left alone ------------------------------------------------------------------------------

_ALONE = """
import json, os, sys
import jax
from jax._src import xla_bridge
from pallas_guard._running import tpu_compile as _tpu_compile
names = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD")
before_env = {k: os.environ.get(k) for k in names}
devices = {g: _tpu_compile.topology_device(g) for g in _tpu_compile.GENERATIONS}
initialised = xla_bridge.backends_are_initialized()
after_env = {k: os.environ.get(k) for k in before_env}
print(json.dumps({
    "initialised": initialised,
    "kinds": {g: getattr(d, "device_kind", d) for g, d in devices.items()},
    "env_kept": before_env == after_env,
    "platforms": [d.platform for d in jax.devices()],
    "backend": jax.default_backend(),
}))
"""


def _chip(kind: str) -> Any:
    from jax._src.pallas.mosaic import tpu_info

    return tpu_info.chip_version_from_device_kind(kind)


def _python(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in env}
    environment.update({k: v for k, v in env.items() if v is not None})
    command = [sys.executable, "-c", code]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("platforms", ["cpu", None])
def test_topology_initialises_no_backend_and_says_nothing(platforms: str | None) -> None:
    done = _python(_ALONE, JAX_PLATFORMS=platforms, PALLAS_GUARD_POLICY=None)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["initialised"] is False
    assert result["env_kept"] is True
    assert {g: _chip(kind) for g, kind in result["kinds"].items()} == {
        g: _chip(DEVICES[g][0]) for g in DEVICES if g in result["kinds"]
    }
    assert result["backend"] == "cpu" and set(result["platforms"]) == {"cpu"}
    # libtpu's start-up on a host without a TPU warns on stderr unless told what it is.
    for noise in ("could not determine TPU", "common_lib.cc", "InitGoogle", "Failed to find host bounds"):
        assert noise not in done.stderr, done.stderr


def test_compile_leaves_devices_and_backend_alone() -> None:
    devices, backend = jax.devices(), jax.default_backend()
    assert _deviceless("matmul.f32").phase is None
    assert _deviceless("tiling.f32_3x100").phase == "lower"
    assert jax.devices() == devices and jax.default_backend() == backend
    assert all(device.platform == "cpu" for device in jax.devices())


def test_two_processes_compile_at_once() -> None:
    """libtpu's host-wide lock would refuse a second process (``pytest -n``) on a host without a TPU."""
    show = (
        "from pallas_guard._running import tpu_compile as t; "
        "print(getattr(t.topology_device('tpu-v5e'), 'platform', 'no'))"
    )
    hold = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; {show}; sys.stdout.flush(); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
    )
    try:
        assert hold.stdout is not None
        assert hold.stdout.readline().strip() == "tpu"  # the first holds libtpu (and its lock) from here
        done = _python(show, JAX_PLATFORMS="cpu")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "tpu", done.stdout
    finally:
        hold.kill()
        hold.wait()


# --- (d) generations ------------------------------------------------------------------------------------


def test_every_generation_gives_its_device() -> None:
    for generation in _tpu_compile.GENERATIONS:
        device = _tpu_compile.topology_device(generation)
        assert not isinstance(device, str), device
        # libtpu calls a v5p "TPU v5" (as the chip does), the device setting "TPU v5p": one chip to JAX.
        assert _chip(device.device_kind) == _chip(DEVICES[generation][0]) is not None
        assert device.platform == "tpu"


def test_unknown_generation_is_a_reason() -> None:
    assert "no TPU topology" in _tpu_compile.topology_device("tpu-v9")
    outcome = _tpu_compile.compile_kernel(tpu_corpus.by_name("matmul.f32").build, (), {}, "tpu-v9")
    assert outcome.phase is None and outcome.error is None and "tpu-v9" in (outcome.unchecked or "")


def test_refused_topology_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A topology libtpu does not know (its name for the v7x is "tpu7x") is a reason, not a crash."""
    spec = _tpu_compile.GENERATIONS["tpu7x"]._replace(topology="v7x:2x2x1")
    monkeypatch.setitem(_tpu_compile.GENERATIONS, "tpu-v7x-test", spec)
    monkeypatch.setattr(_tpu_compile, "_devices", {})
    reason = _tpu_compile.topology_device("tpu-v7x-test")
    assert isinstance(reason, str) and "v7x:2x2x1 was refused" in reason
    outcome = _tpu_compile.compile_kernel(tpu_corpus.by_name("matmul.f32").build, (), {}, "tpu-v7x-test")
    assert outcome.phase is None and outcome.unchecked == reason


def _limit_in(error: BaseException) -> float | None:
    """The VMEM limit a refusal names: the scoped limit ("limit 16.00M"), the VMEM in all ("of
    16.00M vmem"), or an allocation's memory ("would exceed memory (size=16777216)"), in bytes."""
    text = str(error)
    if found := re.search(r"limit ([\d.]+)M|of ([\d.]+)M vmem", text):
        return float(found.group(1) or found.group(2)) * MIB
    if found := re.search(r"would exceed memory \(size=(\d+)\)", text):
        return float(found.group(1))
    return None


@pytest.mark.parametrize("generation", list(_tpu_compile.GENERATIONS))
def test_scoped_vmem_limit_is_the_compilers(generation: str) -> None:
    """A VMEM scratch 1 MiB under the table's limit compiles; 1 MiB over, the compiler refuses it
    and names that limit."""
    limit = _tpu_compile.GENERATIONS[generation].scoped_vmem_limit
    x = (jax.ShapeDtypeStruct((8, 1024), np.float32),)
    rows = (limit - MIB) // 4096
    fits = _tpu_compile.compile_kernel(tpu_corpus._scratch(rows), x, {}, generation)
    assert fits.phase is None, fits.message
    assert fits.vmem_used is not None and rows * 4096 <= fits.vmem_used <= limit == fits.vmem_limit
    refused = _tpu_compile.compile_kernel(tpu_corpus._scratch((limit + MIB) // 4096), x, {}, generation)
    assert refused.phase == "compile" and isinstance(refused.error, jax.errors.JaxRuntimeError)
    assert _limit_in(refused.error) == pytest.approx(limit, rel=1e-3), refused.message


def test_vmem_limits_differ_per_generation() -> None:
    """24 MiB of blocks fit a v6e's default scoped VMEM, not a v5e's; with vmem_limit_bytes=48 MiB
    they fit a v5e and a v5p, never a v4 (16 MiB of VMEM in all)."""
    default = {g: _deviceless("vmem.pair_24mib", g).phase for g in _tpu_compile.GENERATIONS}
    assert default == {
        g: None if spec.scoped_vmem_limit >= 24 * MIB else "compile" for g, spec in _tpu_compile.GENERATIONS.items()
    }
    assert default["tpu-v6e"] is None and default["tpu-v5e"] == default["tpu-v4"] == "compile"
    raised = {g: _deviceless("vmem.pair_24mib_limit_48mib", g).phase for g in _tpu_compile.GENERATIONS}
    assert raised == {
        g: None if spec.vmem_capacity >= 48 * MIB else "compile" for g, spec in _tpu_compile.GENERATIONS.items()
    }
    assert raised["tpu-v4"] == "compile" and raised["tpu-v5e"] is None


# --- availability -------------------------------------------------------------------------------------------


def test_libtpu_pin_is_jaxs_own() -> None:
    import importlib.metadata

    pins = [r for r in importlib.metadata.requires("jax") or () if r.replace(" ", "").startswith("libtpu==")]
    pin = _tpu_compile.libtpu_pin()
    assert pin is not None and any(pin in requirement for requirement in pins)
    assert f'"libtpu=={pin}"' in _tpu_compile.install_command()
    if jax.__version__ in _tpu_compile.LIBTPU_PINS:  # the table agrees with the metadata it stands in for
        assert _tpu_compile.LIBTPU_PINS[jax.__version__] == pin


# --- the interpreters against the chip ------------------------------------------------------------------

INTERPRETED = [
    case.name
    for case in tpu_corpus.cases()
    if case.interpretable is None and case.tolerance is not None and not case.halts
]


@pytest.mark.parametrize("name", INTERPRETED)
def test_interpreted_outputs_are_the_tpus(name: str) -> None:
    """What the guard's interpreter computes on this CPU is what the TPU computed, within the
    case's tolerance (whole outputs), or bit for bit where only a digest was recorded and the
    kernel is exact."""
    record = _recorded(name)
    if _tpu_verdict(record) is not None:
        pytest.skip(f"the TPU refused it ({record['phase']})")
    case = tpu_corpus.by_name(name)
    pallas_guard.install("interpret")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = jax.tree_util.tree_leaves(case.build()(*case.inputs()))
    finally:
        pallas_guard.uninstall()
    assert len(got) == len(record["outputs"])
    compared = 0
    for leaf, want in zip(got, record["outputs"], strict=True):
        array = np.asarray(leaf)
        assert list(array.shape) == want["shape"] and str(array.dtype) == want["dtype"]
        if case.tolerance == 0.0:  # an exact kernel: the TPU's bytes
            assert hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest() == want["sha256"], name
            compared += 1
        elif "values" in want:
            expected = np.asarray(want["values"], np.float64)
            scale = max(float(np.nanmax(np.abs(expected), initial=0.0)), 1e-30)
            got_values = array.astype(np.float64).reshape(-1)
            both_nan = np.isnan(got_values) & np.isnan(expected)
            error = float(np.max(np.where(both_nan, 0.0, np.abs(got_values - expected)), initial=0.0)) / scale
            # Recorded floats keep nine significant digits: 1e-8 of the largest is that rounding.
            assert error <= max(case.tolerance or 0.0, 1e-8), f"{name}: {error:.3g} of the largest value"
            compared += 1
        elif array.dtype.kind in "biu":
            assert hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest() == want["sha256"]
            compared += 1
    if not compared:
        pytest.skip("only a digest of float outputs was recorded")


# --- the recorder ---------------------------------------------------------------------------------------


def test_recorder_deviceless_agrees_and_resumes(tmp_path: Path) -> None:
    """benchmarks/tpu_record.py end to end on this CPU: one case per phase (a halting one in its own
    process), compared with the TPU's records; a second run finds them done and compiles nothing."""
    _same_jax()
    out = tmp_path / "records.json"
    names = ["tiling.f32_3x100", "dtype.f16_copy", "matmul.f32", "index.past_end_input"]
    command = [sys.executable, "benchmarks/tpu_record.py", "--deviceless", GENERATION, "--out", str(out)]
    command += ["--compare", str(RECORDS), "--only", *names]
    root = Path(__file__).resolve().parent.parent
    environment = os.environ | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=root, env=environment, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "phase and message: 4 of 4" in done.stdout
    data = json.loads(out.read_text())
    assert list(data["cases"]) == names and data["meta"]["mode"] == f"deviceless {GENERATION}"
    assert [data["cases"][name]["phase"] for name in names] == ["lower", "compile", None, None]
    again = subprocess.run(command, cwd=root, env=environment, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and " ... " not in again.stdout  # nothing left to compile
