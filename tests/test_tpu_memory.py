"""What a kernel takes of each TPU generation's VMEM and SMEM, as data: in ``decisions()``, the
pytest summary (with the kernel's name), ``--pallas-guard-report``, ``$GITHUB_STEP_SUMMARY`` and
``pallas-guard run``; refused kernels included; a kernel too close to a limit under the headroom
setting is a finding.

The figures are libtpu's own: where libtpu is installed (``.ci/run tpu``) they are compared with
the numbers libtpu prints when it refuses the same kernel elsewhere. Without libtpu, the figures
are read from the refusals a real TPU v5e gave (``data/tpu_v5e_records.json``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import clean_env
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_guard
from pallas_guard import MemoryUse, PallasGuardConfigError, PallasGuardError
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._running import tpu_compile as _tpu_compile
from pallas_guard._surfaces import report as _report

pytest_plugins = ("pytester",)

needs_libtpu = pytest.mark.skipif(_tpu_compile.available() is not None, reason=str(_tpu_compile.available()))
RECORDS = json.loads((Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json").read_text())["cases"]
MIB = 1 << 20


# --- refusals: the figure the TPU gave -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "space", "used", "limit"),
    [
        ("vmem.pair_24mib", "VMEM", 24 * MIB, 16 * MIB),
        ("vmem.scratch_20mib", "VMEM", 20 * MIB, 16 * MIB),
        ("vmem.block_256mib", "VMEM", 256 * MIB, 128 * MIB),
        ("smem.scratch_4mib", "SMEM", 4 * MIB, MIB),
    ],
)
def test_a_refusal_by_a_real_tpu_gives_its_figure(name: str, space: str, used: int, limit: int) -> None:
    figures = _diagnostics.refused_memory(RuntimeError(RECORDS[name]["message"]))
    assert figures == [(space, used, limit)]


def test_a_refusal_that_is_not_about_memory_gives_no_figure() -> None:
    refused = [name for name, record in RECORDS.items() if record["phase"] == "compile"]
    others = [name for name in refused if not name.startswith(("vmem.", "smem."))]
    assert others
    for name in others:
        assert _diagnostics.refused_memory(RuntimeError(RECORDS[name]["message"])) == [], name


# --- the headroom setting ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "value"), [("0.05", 0.05), ("5%", 0.05), (" 12.5 % ", 0.125), ("0", 0.0), (0.1, 0.1)]
)
def test_the_headroom_is_a_share_below_one(given: Any, value: float) -> None:
    with pallas_guard.policy(vmem_headroom=given):
        from pallas_guard._vocabulary import settings as _settings

        assert _settings.current("vmem_headroom").value == pytest.approx(value)


@pytest.mark.parametrize("given", ["1", "150%", "-0.1", "five", "0.05.1", "1e-2"])
def test_a_bad_headroom_names_the_value_and_what_is_accepted(given: str) -> None:
    with pytest.raises(PallasGuardConfigError) as info:
        pallas_guard.policy(vmem_headroom=given)
    assert repr(given) in str(info.value) and "'5%'" in str(info.value)


def test_a_headroom_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="vmem_headroom"):
        pallas_guard.policy(vmem_headroom=True)  # type: ignore[arg-type]


# --- the report, from figures ----------------------------------------------------------------------


def _rows(*uses: tuple[str, MemoryUse]) -> list[dict[str, Any]]:
    return [{"kernel": kernel, "defined_at": f"{kernel}.py:1", "memory": [_report.as_row(use)]} for kernel, use in uses]


ROWS = _rows(
    ("small", MemoryUse("tpu-v5e", "VMEM", 448 * 1024, 16 * MIB, compiled=True)),
    ("tight", MemoryUse("tpu7x", "VMEM", 31 * MIB, 32 * MIB, compiled=True)),
    ("tight", MemoryUse("tpu7x", "VMEM", 30 * MIB, 32 * MIB, compiled=True)),  # a smaller call: not shown
    ("over", MemoryUse("tpu7x", "VMEM", 35190211, 32 * MIB, compiled=False)),
    ("scalars", MemoryUse("tpu-v5e", "SMEM", 0, MIB, compiled=True)),  # no SMEM operands: not shown
)


def test_each_kernel_generation_and_memory_is_shown_once_at_its_tightest_first() -> None:
    found = _report.bars(ROWS)
    assert [(bar.kernel, bar.use.used, bar.verdict) for bar in found] == [
        ("over", 35190211, "refused"),
        ("tight", 31 * MIB, "compiles"),
        ("small", 448 * 1024, "compiles"),
    ]
    text = _report.lines(found)
    assert text[1] == "  over (over.py:1) on tpu7x: VMEM 33.6 MiB of 32.0 MiB (105%), refused"
    assert len(_report.lines(found, count=1)) == 2 and "the first 1" in _report.lines(found, count=1)[0]


def test_the_markdown_report_has_a_table_and_an_svg_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "memory.md"
    _report.write(str(path), _report.bars(ROWS))
    text = path.read_text()
    assert "![Memory by kernel](memory.md.svg)" in text
    assert "| `over` (over.py:1) | tpu7x | VMEM | 33.6 MiB | 32.0 MiB |" in text
    picture = (tmp_path / "memory.md.svg").read_text()
    assert picture.startswith("<svg") and picture.count("<rect") == 3 and "33.6 MiB of 32.0 MiB (105%)" in picture


def test_the_html_report_holds_the_svg_and_escapes_names(tmp_path: Path) -> None:
    rows = _rows(("<script>", MemoryUse("tpu-v5e", "VMEM", MIB, 16 * MIB, compiled=True)))
    path = tmp_path / "memory.html"
    _report.write(str(path), _report.bars(rows))
    text = path.read_text()
    assert "<svg" in text and "<script>" not in text and "&lt;script&gt;" in text


def test_the_step_summary_is_appended_only_where_github_sets_it(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    found = _report.bars(ROWS)
    assert not _report.append_step_summary(found, environ={})
    assert not _report.append_step_summary([], environ={"GITHUB_STEP_SUMMARY": str(summary)})
    assert _report.append_step_summary(found, environ={"GITHUB_STEP_SUMMARY": str(summary)})
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "| `tight` (tight.py:1) | tpu7x | VMEM | 31.0 MiB" in text


# --- with libtpu: the compiler's own figures ---------------------------------------------------------


def _scratch_kernel(mib: int) -> Any:
    """A kernel with a VMEM scratch of ``mib`` MiB it touches only the start of."""

    def kernel(x_ref: Any, o_ref: Any, scratch_ref: Any) -> None:
        scratch_ref[0:8, :] = x_ref[...]
        o_ref[...] = scratch_ref[0:8, :] + 1

    rows = mib * MIB // (128 * 4)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((rows, 128), jnp.float32)],
    )


@needs_libtpu
def test_a_scratch_is_counted_and_its_figure_is_the_one_libtpu_refuses_on_a_smaller_chip(guard: Any) -> None:
    guard("interpret", checks="compile", device="tpu-v5e,tpu-v4")
    x = jnp.ones((8, 128), jnp.float32)
    with pytest.raises(PallasGuardError) as info:
        _scratch_kernel(24)(x)
    assert "scratch_shapes" in str(info.value)  # the fix names the scratch, not the blocks
    (decision,) = [d for d in pallas_guard.decisions() if d.action == "found"]
    by_generation = {use.generation: use for use in decision.memory if use.space == "VMEM scratch"}
    # v5e compiles it (128 MiB of VMEM); v4 refuses it, printing the scratch's size: the same figure.
    assert by_generation["tpu-v5e"].compiled and by_generation["tpu-v5e"].limit == 128 * MIB
    assert not by_generation["tpu-v4"].compiled and by_generation["tpu-v4"].limit == 16 * MIB
    assert by_generation["tpu-v5e"].used == by_generation["tpu-v4"].used == 24 * MIB
    assert decision.memory[0] == by_generation["tpu-v4"]  # tightest first


def _blocks_kernel(rows: int, **params: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((rows, 128), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((2 * rows, 128), jnp.float32),
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=pltpu.CompilerParams(**params),
    )


@needs_libtpu
def test_the_decision_holds_the_figures_and_the_headroom_makes_a_tight_kernel_a_finding(guard: Any) -> None:
    guard("interpret", checks="compile", device="tpu-v5e")
    x = jnp.ones((16384, 128), jnp.float32)
    tight = _blocks_kernel(8192, vmem_limit_bytes=int(16.5 * MIB))  # 16 MiB of double-buffered blocks
    expected = np.asarray(x) + 1
    np.testing.assert_array_equal(tight(x), expected)
    (use,) = [u for u in pallas_guard.decisions()[-1].memory if u.space == "VMEM"]
    assert (use.generation, use.used, use.limit, use.compiled) == ("tpu-v5e", 16 * MIB, int(16.5 * MIB), True)
    assert use.share == pytest.approx(16 / 16.5)
    with pallas_guard.policy(vmem_headroom="5%"), pytest.raises(PallasGuardError) as info:
        tight(x)
    text = str(info.value)
    assert "VMEM 16.0 MiB of 16.5 MiB (97%) on tpu-v5e" in text and "vmem_headroom=0.05 from" in text
    assert "\nTo fix: pass `vmem_limit_bytes`" in text and "128.00MiB, tpu-v5e's whole VMEM" in text
    with pallas_guard.policy(vmem_headroom="1%"):
        np.testing.assert_array_equal(tight(x), expected)  # 3% free: enough for a 1% headroom


@needs_libtpu
def test_a_kernel_just_over_a_tpu7x_limit_is_refused_with_libtpus_figure(guard: Any) -> None:
    """A kernel needing 33.56M of tpu7x's 32.00M scoped VMEM, as in a tpu-inference CI failure: a
    CPU run gives the verdict and the figure."""
    from tpu_corpus import _scratch

    guard("interpret", checks="compile", device="tpu7x")
    with pytest.raises(PallasGuardError) as info:
        _scratch(8592)()(jnp.ones((8, 1024), jnp.float32))
    assert "Scoped allocation with size 33.56M and limit 32.00M" in str(info.value)
    (use,) = pallas_guard.decisions()[-1].memory
    assert (use.generation, use.space, use.used, use.limit, use.compiled) == (
        "tpu7x",
        "VMEM",
        35190211,
        32 * MIB,
        False,
    )


PYTEST_FILE = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def tight_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

def small_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

def test_tight():
    spec = pl.BlockSpec((8192, 128), lambda i: (i, 0))
    call = pl.pallas_call(tight_kernel, out_shape=jax.ShapeDtypeStruct((16384, 128), jnp.float32),
                          grid=(2,), in_specs=[spec], out_specs=spec)
    call(jnp.ones((16384, 128), jnp.float32))

def test_small():
    pl.pallas_call(small_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(jnp.ones((8, 128)))
"""


@needs_libtpu
def test_a_pytest_run_names_each_kernel_with_its_figure_and_writes_the_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    overrides = {"JAX_PLATFORMS": "cpu", "GITHUB_STEP_SUMMARY": str(tmp_path / "s.md"), "XDG_CACHE_HOME": str(tmp_path)}
    for name, value in clean_env(overrides).items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile(test_kernels=PYTEST_FILE)
    report = tmp_path / "report.md"
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--pallas-guard-policy=interpret",
        "--pallas-guard-checks=compile",
        "--pallas-guard-device=tpu-v5e",
        f"--pallas-guard-report={report}",
        timeout=240,
    )
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "tight_kernel (" in out and "on tpu-v5e: VMEM 16.0 MiB of 16.0 MiB (100%), compiles" in out
    assert "small_kernel (" in out and f"report: {report}" in out
    assert "note (1 kernel(s)): compile: compiles" not in out  # the figures are per kernel, not a note
    assert "compile cache: 0 of 2 compile(s) read from earlier runs" in out  # a fresh cache
    assert "| `tight_kernel`" in report.read_text() and (tmp_path / "report.md.svg").is_file()
    assert "| `small_kernel`" in (tmp_path / "s.md").read_text()


@needs_libtpu
def test_pallas_guard_run_prints_each_kernels_figure_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "kernel.py"
    script.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp
            from jax.experimental import pallas as pl

            def add_one(x_ref, o_ref):
                o_ref[...] = x_ref[...] + 1

            pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32))(jnp.ones((64, 128)))
            print("ran")
            """
        )
    )
    command = [sys.executable, "-m", "pallas_guard", "run", "--policy=interpret", "--checks=compile"]
    command.append("--device=tpu-v5e")
    result = subprocess.run(
        [*command, "--", sys.executable, str(script)],
        env=clean_env({"JAX_PLATFORMS": "cpu"}),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran"
    assert f"pallas_guard: add_one ({script}:5) on tpu-v5e: VMEM " in result.stderr, result.stderr
