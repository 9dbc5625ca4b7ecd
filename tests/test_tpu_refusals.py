"""What a TPU refusal says: the TPU's own message cut to its cause, with a "To fix" per cause.

Replayed on this CPU from the messages a real TPU v5e gave (``data/tpu_v5e_records.json``, the
first 500 characters of each); ``tests/test_compile_check.py`` holds libtpu's whole messages, where
libtpu is installed, to the same standard.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._running import tpu_compile as _tpu_compile

RECORDS = json.loads((Path(__file__).resolve().parent / "data" / "tpu_v5e_records.json").read_text())["cases"]
REFUSED = sorted(name for name, record in RECORDS.items() if record["phase"] == "compile")
CAUSE_ON_A_LATER_LINE = {"dtype.f16_copy", "dtype.f16_add", "matmul.f16"}
"""Refusals whose cause the TPU prints after its first line ("Invalid vector type for load", then
the MLIR operation with its float16 vector), which the records do not keep."""
KERNEL = _diagnostics.KernelInfo("k", "k.py:1", "pallas_call")
CALL = _diagnostics.CallSite("k.py:9", None)


def _finding(message: str) -> str:
    v5e = _tpu_compile.GENERATIONS["tpu-v5e"]
    error = RuntimeError(message)
    fix = _diagnostics.refusal_fix(error, target="tpu-v5e", vmem_capacity=v5e.vmem_capacity)
    return str(
        _diagnostics.lowering_refused(
            kernel=KERNEL, call_site=CALL, target="tpu-v5e", error=error, source="checks", check="compile", fix=fix
        )
    )


def test_the_records_hold_refusals_of_every_kind() -> None:
    assert len(REFUSED) >= 15


@pytest.mark.parametrize("name", REFUSED)
def test_a_tpu_refusal_is_at_most_fifteen_lines_with_its_fix(name: str) -> None:
    text = _finding(RECORDS[name]["message"])
    assert len(text.splitlines()) <= 15, text
    assert "Please report a bug" not in text and "type.googleapis.com" not in text
    assert RECORDS[name]["message"].split(":")[0] in text  # the TPU's own status kept
    if name not in CAUSE_ON_A_LATER_LINE:
        assert "\nTo fix: " in text, text


def test_a_vmem_refusal_names_the_limit_to_raise_and_stops_at_the_end_of_a_sentence() -> None:
    text = _finding(RECORDS["vmem.pair_24mib"]["message"])
    assert "exceeded scoped vmem limit by 8.00M." in text and "It should not be pos" not in text
    assert "the kernel needs 24.00MiB of VMEM and tpu-v5e gives a kernel 16.00MiB" in text
    assert "`vmem_limit_bytes` (in its TPU compiler_params) up to 128.00MiB, tpu-v5e's whole VMEM" in text


WINDOW = "The window shape is f32[{}], while the full shape is f32[8192,2048]. This allocation has 2 buffering levels."
LISTING = "\n".join(
    [
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. "
        "Used 192.00M of 128.00M vmem. Exceeded vmem capacity by 64.00M.",
        "",
        "Program vmem requirement 192.00M:",
        "    scoped          192.00M",
        "",
        "  Largest program allocations in vmem:",
        "",
        "  1. Size: 64.00M",
        '     Operator: op_name="jit(wrapped)/pallas_call"',
        "     Shape: u8[67108864]{0}",
        "     Unpadded size: 64.00M",
        "     Tag: input window allocation for operator input 0. " + WINDOW.format("4096,2048"),
        "     Allocation type: scoped",
        "     ==========================",
        "",
        "  2. Size: 32.00M",
        '     Operator: op_name="jit(wrapped)/pallas_call"',
        "     Tag: output window allocation for operator output 0. " + WINDOW.format("2048,2048"),
        "     ==========================",
        "",
        "  3. Size: 16.00M",
        "     Tag: scratch operand",
        "     ==========================",
        " [type.googleapis.com/tensorflow.tpu.CompilationResultProto='\\x08\\x08\\x12\\x91\\x11Ran out...[truncated]']",
    ]
)
"""libtpu 0.0.42.1's refusal of a kernel past tpu-v5e's whole VMEM (three allocations kept of it)."""


def test_an_allocation_listing_is_its_largest_three_by_operand_and_window() -> None:
    text = _finding(LISTING)
    assert len(text.splitlines()) <= 15 and "type.googleapis.com" not in text
    assert (
        "Largest allocations: 64.00M for input 0 (window f32[4096,2048]); 32.00M for output 0 (window "
        "f32[2048,2048]); 16.00M for scratch operand." in text
    )
    assert "To fix: the kernel needs 192.00MiB of VMEM, more than tpu-v5e's whole VMEM: shrink the blocks" in text


def test_with_the_kernels_blocks_a_vmem_refusal_names_blocks_that_fit_and_single_buffering() -> None:
    """The blocks the compile check reads from the lowered kernel (here: three of (1024, 1024)
    float32, as ``vmem.pair_24mib``'s kernel has) give the first dimension that fits the limit,
    keeping the tiling; an operand whose one buffer frees what is over is named for single
    buffering."""
    mib = 1 << 20
    blocks = [_tpu_compile.Window(name, (1024, 1024), 32, 4 * mib) for name in ("input 0", "input 1", "output 0")]
    error = RuntimeError(RECORDS["vmem.pair_24mib"]["message"])
    fix = _diagnostics.refusal_fix(error, target="tpu-v5e", vmem_capacity=128 * mib, windows=blocks)
    assert fix is not None
    assert "blocks that fit: (680, 1024) instead of (1024, 1024) for input 0, input 1 and output 0" in fix
    assert "Buffered(1)" not in fix  # one buffer (4 MiB) frees less than the 8 MiB over
    bigger = [blocks[0]._replace(bytes=8 * mib, shape=(2048, 1024)), *blocks[1:]]
    fix = _diagnostics.refusal_fix(error, target="tpu-v5e", vmem_capacity=128 * mib, windows=bigger)
    assert fix is not None and "`pipeline_mode=pl.Buffered(1)` on input 0's BlockSpec" in fix
