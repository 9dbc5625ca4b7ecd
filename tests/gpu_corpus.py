"""Triton and Mosaic GPU kernels, and XLA's verdict on each for an H100 and an A100, with no GPU.

JAX's shipped GPU kernels (``jax.experimental.pallas.ops.gpu``: attention, layer norm, RMS norm,
softmax, decode and paged attention) at realistic shapes (JAX's Mosaic GPU attention asks the
CUDA runtime for its version while it traces, and its Hopper matmul the default device for its SM
count: without a GPU neither traces unguarded; ``tests/test_gpu_compile.py`` has the Hopper
matmul), and the edges of what a GPU refuses: a block's shared memory, the copies ``num_stages``
keeps, float8 on an A100, Hopper-only instructions of Mosaic GPU, Mosaic GPU's own shared-memory
check, Triton's power-of-2 blocks, a kernel that
spills registers.

``python tests/gpu_corpus.py --record`` (JAX_PLATFORMS=cpu, the ``gpu`` extra installed) compiles
each case for each GPU without the guard, the way the GPU's own ``jax.jit(f).lower(x).compile()``
does with operands placed on a described device (one process per compile: some refusals end it),
and writes what the compiler said to ``tests/data/gpu_verdicts.json``: the verdict, the error's type
and a line of its message, and the figures XLA and ptxas report themselves (the shared memory in
XLA's dump or Mosaic GPU's launch, ptxas -v's registers and spills). The replay
(``tests/test_gpu_corpus.py``) lowers each case under the guard with ``checks=compile`` and compares.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

DATA = Path(__file__).resolve().parent / "data" / "gpu_verdicts.json"
GPUS = ("h100", "a100")


class Case(NamedTuple):
    name: str
    program: Callable[..., Any]
    """The whole function, as a user calls it (one Pallas kernel inside)."""
    operands: Callable[[], list[tuple[tuple[int, ...], str]]]
    """Its operands' shapes and dtypes."""


def _shapes(*pairs: tuple[tuple[int, ...], str]) -> Callable[[], list[tuple[tuple[int, ...], str]]]:
    return lambda: list(pairs)


# --- JAX's shipped GPU kernels ---------------------------------------------------------------------


def _mha(q: Any, k: Any, v: Any, *, causal: bool, block: int, stages: int) -> Any:
    from jax.experimental.pallas.ops.gpu import attention

    sizes = attention.BlockSizes(block_q=block, block_k=block)
    return attention.mha(q, k, v, None, causal=causal, block_sizes=sizes, num_stages=stages)


def _layer_norm(x: Any, w: Any, b: Any) -> Any:
    from jax.experimental.pallas.ops.gpu import layer_norm

    return layer_norm.layer_norm(x, w, b)


def _rms_norm(x: Any, w: Any, b: Any) -> Any:
    from jax.experimental.pallas.ops.gpu import rms_norm

    return rms_norm.rms_norm(x, w, b)


def _softmax(x: Any) -> Any:
    from jax.experimental.pallas.ops.gpu import softmax

    return softmax.softmax(x, axis=-1)


def _decode_attention(q: Any, k: Any, v: Any) -> Any:
    from jax.experimental.pallas.ops.gpu import decode_attention

    return decode_attention.gqa(q, k, v, k_splits=8)


def _paged_attention(q: Any, k_pages: Any, v_pages: Any, lengths: Any, page_indices: Any) -> Any:
    from jax.experimental.pallas.ops.gpu import paged_attention

    return paged_attention.paged_attention(
        q, k_pages, v_pages, page_indices, lengths, block_h=16, pages_per_compute_block=4
    )


# --- edges of what a GPU refuses -------------------------------------------------------------------


def _triton(**params: Any) -> Any:
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(**params)


def _matmul(x: Any, y: Any, *, blocks: tuple[int, int, int], warps: int = 4, out: str | None = None) -> Any:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    bm, bk, bn = blocks

    def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), out or x.dtype),
        grid=(x.shape[0] // bm, y.shape[1] // bn),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, 0)), pl.BlockSpec((bk, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_triton(num_warps=warps, num_stages=2),
    )(x, y)


def pipelined_matmul(x: Any, y: Any, *, stages: int) -> Any:
    """Steps of 64 along k inside the kernel: Triton's pipeliner keeps up to ``stages`` copies."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    bm, bn, bk, depth = 128, 128, 64, x.shape[1]

    def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
        def step(k, acc):  # type: ignore[no-untyped-def]
            tile = pl.ds(k * bk, bk)
            return acc + jnp.dot(x_ref[:, tile], y_ref[tile, :], preferred_element_type=jnp.float32)

        o_ref[...] = jax.lax.fori_loop(0, depth // bk, step, jnp.zeros((bm, bn), jnp.float32)).astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
        grid=(x.shape[0] // bm, y.shape[1] // bn),
        in_specs=[pl.BlockSpec((bm, depth), lambda i, j: (i, 0)), pl.BlockSpec((depth, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_triton(num_warps=4, num_stages=stages),
    )(x, y)


def _add_one(x: Any, *, mosaic: bool) -> Any:
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + 1

    if mosaic:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return pl.pallas_call(kernel, out_shape=x, compiler_params=plgpu.CompilerParams())(x)
    return pl.pallas_call(kernel, out_shape=x, compiler_params=_triton(num_warps=4, num_stages=2))(x)


def _mosaic_scratch(x: Any, *, rows: int) -> Any:
    """A Mosaic GPU kernel with a ``rows`` x 128 float32 scratch in shared memory."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(x_ref, o_ref, scratch):  # type: ignore[no-untyped-def]
        scratch[...] = jnp.broadcast_to(x_ref[0:1, :], scratch.shape)
        o_ref[...] = x_ref[...] + scratch[0:8, :]

    scratch = [plgpu.SMEM((rows, 128), jnp.float32)]
    return pl.pallas_call(kernel, out_shape=x, scratch_shapes=scratch, compiler_params=plgpu.CompilerParams())(x)


F16, F32, I32 = "float16", "float32", "int32"
CASES = [
    # JAX's shipped Triton kernels at the shapes a model calls them with
    Case(
        "jax mha, 2x1024x8x64 float16, causal, blocks 128, 2 stages",
        functools.partial(_mha, causal=True, block=128, stages=2),
        _shapes(((2, 1024, 8, 64), F16), ((2, 1024, 8, 64), F16), ((2, 1024, 8, 64), F16)),
    ),
    Case(
        "jax mha, 1x2048x4x128 float16, blocks 128, 3 stages",
        functools.partial(_mha, causal=False, block=128, stages=3),
        _shapes(((1, 2048, 4, 128), F16), ((1, 2048, 4, 128), F16), ((1, 2048, 4, 128), F16)),
    ),
    Case(
        "jax mha, 1x1024x4x256 float32, blocks 128, 4 stages",
        functools.partial(_mha, causal=False, block=128, stages=4),
        _shapes(((1, 1024, 4, 256), F32), ((1, 1024, 4, 256), F32), ((1, 1024, 4, 256), F32)),
    ),
    Case(
        "jax layer_norm, 4x256x4096 float32",
        _layer_norm,
        _shapes(((4, 256, 4096), F32), ((4096,), F32), ((4096,), F32)),
    ),
    Case("jax rms_norm, 4x256x4096 float32", _rms_norm, _shapes(((4, 256, 4096), F32), ((4096,), F32), ((4096,), F32))),
    Case("jax softmax, 256x4096 float32", _softmax, _shapes(((256, 4096), F32))),
    Case(
        "jax decode attention (gqa), 4x32 heads over 8 kv heads, 2048 keys, float16",
        _decode_attention,
        _shapes(((4, 32, 128), F16), ((4, 2048, 8, 128), F16), ((4, 2048, 8, 128), F16)),
    ),
    Case(
        "jax paged attention, 4x16 heads, 64 pages of 16, float16",
        _paged_attention,
        _shapes(((4, 16, 128), F16), ((16, 64, 16, 128), F16), ((16, 64, 16, 128), F16), ((4,), I32), ((4, 16), I32)),
    ),
    # shared memory
    Case(
        "triton matmul, (256, 1024) x (1024, 256) float16 blocks: 1 MiB of shared memory",
        functools.partial(_matmul, blocks=(256, 1024, 256)),
        _shapes(((512, 1024), F16), ((1024, 512), F16)),
    ),
    Case(
        "triton pipelined matmul, 5 stages of 32 KiB",
        functools.partial(pipelined_matmul, stages=5),
        _shapes(((256, 1024), F16), ((1024, 256), F16)),
    ),
    Case(
        "triton pipelined matmul, 7 stages of 32 KiB",
        functools.partial(pipelined_matmul, stages=7),
        _shapes(((256, 1024), F16), ((1024, 256), F16)),
    ),
    # registers
    Case(
        "triton matmul, 256 x 256 float32 sums on 4 warps: spills",
        functools.partial(_matmul, blocks=(256, 64, 256)),
        _shapes(((512, 64), F32), ((64, 512), F32)),
    ),
    Case(
        "triton matmul, 64 x 64 float32 sums on 8 warps",
        functools.partial(_matmul, blocks=(64, 64, 64), warps=8),
        _shapes(((256, 64), F32), ((64, 256), F32)),
    ),
    # dtypes per architecture
    Case(
        "triton float8_e4m3fn matmul",
        functools.partial(_matmul, blocks=(32, 64, 32), out=F32),
        _shapes(((64, 64), "float8_e4m3fn"), ((64, 64), "float8_e4m3fn")),
    ),
    Case(
        "triton bfloat16 matmul",
        functools.partial(_matmul, blocks=(64, 64, 64), out=F32),
        _shapes(((128, 64), "bfloat16"), ((64, 128), "bfloat16")),
    ),
    # what JAX's lowering refuses before XLA's compiler
    Case("triton add-one on a (96,) block", functools.partial(_add_one, mosaic=False), _shapes(((96,), F32))),
    # Mosaic GPU: Hopper instructions, its own shared-memory check
    Case("mosaic gpu add-one", functools.partial(_add_one, mosaic=True), _shapes(((256,), F32))),
    Case(
        "mosaic gpu, 64 KiB scratch",
        functools.partial(_mosaic_scratch, rows=128),
        _shapes(((8, 128), F32)),
    ),
    Case(
        "mosaic gpu, 2 MiB scratch",
        functools.partial(_mosaic_scratch, rows=4096),
        _shapes(((8, 128), F32)),
    ),
]


def avals(case: Case, sharding: Any = None) -> list[Any]:
    import jax
    import jax.numpy as jnp

    return [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding) for shape, dtype in case.operands()]


# --- the record: the GPU's own compile, per case and GPU, without the guard -------------------------

_ONE = r"""
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import jax
from jax.experimental import topologies
import gpu_corpus

case = next(c for c in gpu_corpus.CASES if c.name == sys.argv[2])
device = topologies.get_topology_desc(sys.argv[3], "cuda", target_config=sys.stdin.read(), topology="1x1x1").devices[0]
operands = gpu_corpus.avals(case, jax.sharding.SingleDeviceSharding(device))
try:
    lowered = jax.jit(case.program).lower(*operands)
except Exception as error:
    print("RECORD " + json.dumps({"step": "lowering", "type": type(error).__name__, "message": str(error)}))
    sys.exit(0)
lowered.compile()
print("RECORD " + json.dumps({"step": "compiled"}))
"""


def _compile_one(case: Case, gpu: str) -> dict[str, Any]:
    from pallas_guard._running import gpu_compile

    with tempfile.TemporaryDirectory() as dump:
        env = {name: value for name, value in os.environ.items() if not name.startswith("PALLAS_GUARD")}
        env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={dump}", "TF_CPP_MIN_LOG_LEVEL": "2"}
        env |= {"MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_HOST_LLVM": "1"}
        ptxas = gpu_compile._ptxas()
        assert ptxas is not None
        env["PATH"] = os.pathsep.join([ptxas, env.get("PATH", "")])
        done = subprocess.run(
            [sys.executable, "-c", _ONE, __file__, case.name, gpu],
            input=gpu_compile.target_config(gpu_compile.TARGETS[gpu]),
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            check=False,
        )
        said = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RECORD ")]
        if said and said[0]["step"] == "lowering":
            return {
                "verdict": "refused",
                "step": "lowering",
                "type": said[0]["type"],
                "line": _line(said[0]["message"]),
            }
        if said:
            return {"verdict": "compiles", **_figures(Path(dump), done.stdout + done.stderr, gpu)}
    raised = [line for line in done.stderr.splitlines() if re.match(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): ", line)]
    if raised:
        kind, _, message = raised[-1].partition(": ")
        return {"verdict": "refused", "step": "compile", "type": kind.rsplit(".", 1)[-1], "line": _line(message)}
    fatal = [line for line in done.stderr.splitlines() if "LLVM" in line and ("ERROR" in line or "Fatal" in line)]
    return {"verdict": "refused", "step": "compile", "type": "fatal error", "line": _line(fatal[-1] if fatal else "")}


def _line(message: str) -> str:
    """The line of a refusal that says what was refused (XLA's log prefix dropped)."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return re.sub(r"^[EWIF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ", "", first)[:200]


def _figures(dump: Path, printed: str, gpu: str) -> dict[str, Any]:
    """Shared memory from XLA's thunk sequence (Triton) or Mosaic GPU's launch (its host LLVM dump);
    registers and spills from ptxas -v, run here on XLA's PTX (Triton) or printed by Mosaic GPU."""
    from pallas_guard._running import gpu_compile

    shared = [
        int(n)
        for path in dump.glob("*thunk_sequence.txt")
        for n in re.findall(r"shared_memory: (\d+) bytes", path.read_text())
    ]
    shared += [int(n) for n in re.findall(r"@mosaic_gpu_launch_kernel\(ptr %\w+(?:, i32 \d+){9}, i32 (\d+)", printed)]
    report = printed
    ptxas = os.path.join(gpu_compile._ptxas() or "", "ptxas")
    arch = "sm_90a" if gpu_compile.TARGETS[gpu].compute_capability == 9 else "sm_80"
    for ptx in dump.glob("*.ptx"):
        if ".entry" in ptx.read_text():
            run = subprocess.run(
                [ptxas, f"-arch={arch}", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True, check=False
            )
            report += run.stderr
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    stores = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    return {
        "shared_memory": max(shared, default=None),
        "registers": max(registers, default=None),
        "spill_stores": max(stores, default=0),
    }


def record(only: str = "") -> None:
    """Every case (``only``: those whose name has it, the rest kept from the file)."""
    import jax

    cases: dict[str, Any] = recorded() if only and DATA.exists() else {}
    for case in CASES:
        if only not in case.name:
            continue
        cases[case.name] = {gpu: _compile_one(case, gpu) for gpu in GPUS}
        print(case.name, json.dumps(cases[case.name]), flush=True)
    from pallas_guard._jax import lookup

    versions = {name: lookup.distribution_version(name) for name in ("jax-cuda12-plugin", "nvidia-cuda-nvcc-cu12")}
    header = {"jax": jax.__version__, **versions, "how": "python tests/gpu_corpus.py --record"}
    ordered = {case.name: cases[case.name] for case in CASES if case.name in cases}
    DATA.write_text(json.dumps({"recorded_with": header, "cases": ordered}, indent=1) + "\n")


def recorded_with() -> dict[str, Any]:
    """The versions the record was made with."""
    header: dict[str, Any] = json.loads(DATA.read_text())["recorded_with"]
    return header


def recorded() -> dict[str, Any]:
    cases: dict[str, Any] = json.loads(DATA.read_text())["cases"]
    return cases


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"] or len(sys.argv) > 3:
        sys.exit("usage: JAX_PLATFORMS=cpu python tests/gpu_corpus.py --record [NAME PART]  (with pallas_guard[gpu])")
    record(*sys.argv[2:])
