"""The GPU's own verdict on a CPU: XLA's GPU compiler, run ahead of time for a GPU this host lacks.

With the compile-only wheels of the installed jax (``jax-cuda12-plugin``, ``jax-cuda12-pjrt`` and
``nvidia-cuda-nvcc-cu12``'s ptxas), ``jax.experimental.topologies.get_topology_desc`` describes a GPU
from a ``GpuTargetConfigProto`` (``TARGETS``), and ``jax.jit(f).lower(...).compile()`` on one of its
devices runs XLA's GPU pipeline (Triton's passes, Mosaic GPU's, ptxas) for it, with no GPU and no
driver. The kernel is lowered for CUDA here (JAX's Python lowering) and exported; the compile runs
in a child process, because some refusals end the process (an fp8 Triton kernel for an A100 is an
LLVM fatal error) and some give their reason only on stderr. A verdict is kept on disk per kernel
lowering, target and compiler versions.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._running import kept as _kept


class Gpu(NamedTuple):
    """A GPU the compile check targets: the figures XLA's compiler reads from its description
    (NVIDIA's published specifications for the SXM parts)."""

    description: str
    compute_capability: int
    """Major version: 9 Hopper, 8 Ampere."""
    sms: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    """The most shared memory one block can have (bytes): what a kernel's blocks are held to."""
    registers_per_sm: int
    memory_bytes: int
    memory_bandwidth: int
    l2_bytes: int
    clock_ghz: float
    fpus_per_sm: int
    registers_per_thread: int = 255
    """The most registers ptxas gives one thread (sm_80, sm_90): past it, values spill to local memory."""


TARGETS: dict[str, Gpu] = {
    # H100 SXM5 80 GB: 132 SMs, 228 KiB of shared memory per SM, 227 KiB for one block (opt-in).
    "h100": Gpu(
        "NVIDIA H100 80GB HBM3", 9, 132, 233472, 232448, 65536, 84929347584, 3352320000000, 52428800, 1.98, 128
    ),
    # H200 SXM 141 GB: the H100's SMs and shared memory, more and faster memory.
    "h200": Gpu("NVIDIA H200", 9, 132, 233472, 232448, 65536, 150754820096, 4800000000000, 52428800, 1.98, 128),
    # A100 SXM4 80 GB: 108 SMs, 164 KiB of shared memory per SM, 163 KiB for one block (opt-in).
    "a100": Gpu("NVIDIA A100-SXM4-80GB", 8, 108, 167936, 166912, 65536, 85198045184, 2039000000000, 41943040, 1.41, 64),
}
"""Device-setting short names (``pallas_guard_autoload.DEVICES``) -> the GPU compiled for."""

WHEELS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12")
_NOT_THE_KERNELS = ("custom calls whose targets have no compatibility guarantees", "Cannot serialize")
"""What ``jax.export`` refuses for itself (a custom call of a newer jax it does not know): no verdict."""
_GPU_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu_v2", "mosaic_gpu")
"""The custom calls Pallas's GPU kernels lower to: exported for this host's child process only."""


def target_config(gpu: Gpu) -> str:
    """``gpu`` as the ``GpuTargetConfigProto`` text ``get_topology_desc`` takes."""
    return (
        "gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
        f"shared_memory_per_core: {gpu.shared_memory_per_sm} threads_per_core_limit: 2048 core_count: {gpu.sms} "
        f"fpus_per_core: {gpu.fpus_per_sm} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 "
        f"block_dim_limit_z: 65535 memory_bandwidth: {gpu.memory_bandwidth} l2_cache_size: {gpu.l2_bytes} "
        f"clock_rate_ghz: {gpu.clock_ghz} device_memory_size: {gpu.memory_bytes} "
        f"shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin} "
        f"cuda_compute_capability {{ major: {gpu.compute_capability} }} "
        f"registers_per_core_limit: {gpu.registers_per_sm} registers_per_block_limit: {gpu.registers_per_sm} }} "
        'runtime_version: { major: 12 minor: 8 patch: 0 } platform_name: "CUDA" '
        f'dnn_version_info {{ major: 9 minor: 7 }} device_description_str: "{gpu.description}"'
    )


def install_command() -> str:
    version = jax_lookup.jax_version() or "<your jax>"
    return f'pip install "pallas_guard[gpu]" (or: pip install --no-deps {" ".join(_pinned(version))})'


def _pinned(version: str) -> list[str]:
    return [f"{WHEELS[0]}=={version}", f"{WHEELS[1]}=={version}", WHEELS[2]]


def available() -> str | None:
    """None where this process can compile for a GPU without one; else why not, in one line, with
    the install command. Cheap: the wheels are found, not loaded."""
    version = jax_lookup.jax_version()
    installed = {name: jax_lookup.distribution_version(name) for name in WHEELS}
    missing = [name for name, found in installed.items() if found is None]
    if missing:
        return f"XLA's GPU compiler is not installed ({', '.join(missing)} missing): {install_command()}"
    for name in WHEELS[:2]:
        if installed[name] != version:
            return f"{name} {installed[name]} is installed, but jax is {version}: {install_command()}"
    if _ptxas() is None:
        return f"no ptxas in {WHEELS[2]}: {install_command()}"
    return None


@functools.cache
def _ptxas() -> str | None:
    """The folder of the pinned wheel's ptxas: XLA runs the first ptxas it finds, and a system CUDA
    toolkit of another version on PATH would compile for its own idea of the GPU."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = os.path.join(location, "bin")
        if os.path.isfile(os.path.join(folder, "ptxas")):
            return folder
    return None


class Outcome(NamedTuple):
    """What XLA's GPU compiler said of a kernel for one GPU."""

    gpu: str
    error_type: str | None = None
    """The compiler's exception type (``JaxRuntimeError``, ``ValueError``), or ``fatal error`` where
    it ended the process; None where the kernel compiles."""
    message: str | None = None
    """The refusal: the compiler's message, with the reasons it gave only on stderr."""
    seconds: float = 0.0
    cached: bool = False
    unchecked: str | None = None
    """Why the compile could not run here: never a verdict on the kernel."""
    lowering: BaseException | None = None
    """JAX's own refusal to lower the kernel for CUDA, before XLA's compiler (a Triton block shape
    that is not a power of 2): the GPU refuses it as well."""
    figures: Figures | None = None
    """What the compiled kernel spends, where it compiled and the compiler said."""


class Figures(NamedTuple):
    """What a kernel spends of one GPU, as the compilers report it: the dynamic shared memory of a
    block (Triton's as XLA logs it, Mosaic GPU's as its launch asks for it), and ptxas's registers
    per thread and spills for the kernel's entry function (the largest, where there are several)."""

    shared_memory: int | None
    registers: int | None
    spill_stores: int
    spill_loads: int


class Compiling:
    """A compile under way in a child process: ``outcome()`` waits for it."""

    def __init__(self, outcome: Callable[[], Outcome], *, ready: bool) -> None:
        self._outcome, self.ready = outcome, ready

    def outcome(self) -> Outcome:
        return self._outcome()


def start_compile(kernel: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], gpu: str) -> Compiling:
    """``kernel`` lowered for CUDA and exported here, now (``args``, ``kwargs``: the operands'
    shapes and dtypes); XLA's compile for ``gpu`` started in a child process, beside the caller."""
    import jax
    from jax import export

    def known(outcome: Outcome) -> Compiling:
        return Compiling(lambda: outcome, ready=True)

    spec = TARGETS.get(gpu)
    if spec is None:
        return known(
            Outcome(gpu, unchecked=f"no description of {gpu} to compile for (described: {', '.join(TARGETS)})")
        )
    start = time.perf_counter()
    try:
        checks = [export.DisabledSafetyCheck.custom_call(name) for name in _GPU_CALLS]
        exported = export.export(jax.jit(kernel), platforms=["cuda"], disabled_checks=checks)(*args, **kwargs)
        blob = bytes(exported.serialize())
    except (MemoryError, RecursionError):
        raise
    except Exception as error:  # JAX's lowering for CUDA refuses it, as it does on a GPU host
        seconds = time.perf_counter() - start
        if any(words in str(error) for words in _NOT_THE_KERNELS):
            return known(Outcome(gpu, seconds=seconds, unchecked=f"not exported for the compiler: {error}"))
        return known(Outcome(gpu, type(error).__name__, str(error), seconds=seconds, lowering=error))
    path = _verdict_file(blob, gpu)
    kept = _read_verdict(path, gpu)
    if kept is not None:
        return known(kept)
    result: list[Outcome] = []
    thread = threading.Thread(target=lambda: result.append(_compile(blob, gpu, spec, start, path)), daemon=True)
    thread.start()

    def outcome() -> Outcome:
        thread.join()
        return result[0]

    return Compiling(outcome, ready=False)


_CHILD = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from jax import export
from jax.experimental import topologies
blob, name, config = sys.argv[1], sys.argv[2], sys.stdin.read()
exported = export.deserialize(bytearray(open(blob, "rb").read()))
if "mosaic_gpu" in exported.mlir_module():
    import jax.experimental.mosaic.gpu  # sets MOSAIC_GPU_RUNTIME_LIB_PATH: its kernels' host code links to it
device = topologies.get_topology_desc(name, "cuda", target_config=config, topology="1x1x1").devices[0]
placed = jax.sharding.SingleDeviceSharding(device)
avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in exported.in_avals]
args, kwargs = jax.tree_util.tree_unflatten(exported.in_tree, avals)  # as exported: keywords too
jax.jit(exported.call).lower(*args, **kwargs).compile()
print("pallas_guard: compiled")
"""
_RAISED = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.*)$")
# What a refusal says only on stderr: LLVM's fatal errors, MLIR pass diagnostics, ptxas errors.
_REASONS = re.compile(r"(LLVM ERROR|Fatal Error|error: |ptxas (?:error|fatal))", re.IGNORECASE)


def _compile(blob: bytes, gpu: str, spec: Gpu, start: float, path: str | None) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="pallas_guard-gpu-") as folder:
        kernel = os.path.join(folder, "kernel.bin")
        with open(kernel, "wb") as file:
            file.write(blob)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **_FIGURES_LOGGED}
        if b"mosaic_gpu" in blob:  # Mosaic GPU's launch of the kernel, with the shared memory it asks for
            env["MOSAIC_GPU_DUMP_HOST_LLVM"] = "1"
        env["PATH"] = os.pathsep.join(filter(None, (_ptxas(), env.get("PATH"))))
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, kernel, gpu],
                input=target_config(spec),
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return Outcome(gpu, seconds=time.perf_counter() - start, unchecked=f"the compiler did not finish: {error}")
    seconds = time.perf_counter() - start
    if done.returncode == 0 and "pallas_guard: compiled" in done.stdout:
        outcome = Outcome(gpu, seconds=seconds, figures=figures(done.stdout + done.stderr))
        _write_verdict(path, outcome)
        return outcome
    return _refusal(gpu, done.returncode, done.stderr, seconds)


_FIGURES_LOGGED = {
    "TF_CPP_MIN_LOG_LEVEL": "0",
    # XLA logs ptxas's own report (it runs ptxas -v) and Triton's shared memory at these levels.
    "TF_CPP_VMODULE": "subprocess_compilation=2,xtile_compiler=2,triton_fusion_emitter=2",
}
_PTXAS_FUNCTION = re.compile(
    r"Function properties for (\S+)\s+\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\s+"
    r"ptxas info\s*: Used (\d+) registers"
)
_TRITON_SHARED = re.compile(r"\] Shared memory usage: (\d+) B")
# mosaic_gpu_launch_kernel(function, grid x y z, cluster x y z, block x y z, dynamic shared memory, ...)
_MOSAIC_SHARED = re.compile(r"call void @mosaic_gpu_launch_kernel\(ptr %\w+(?:, i32 \d+){9}, i32 (\d+)")


def figures(log: str) -> Figures | None:
    """The compiled kernel's figures from what the compile printed (``_FIGURES_LOGGED``); None where
    it printed none (a jax whose compiler logs them elsewhere)."""
    functions = {m.group(1): (int(m.group(4)), int(m.group(2)), int(m.group(3))) for m in _PTXAS_FUNCTION.finditer(log)}
    shared = [int(m.group(1)) for m in (*_TRITON_SHARED.finditer(log), *_MOSAIC_SHARED.finditer(log))]
    if not functions and not shared:
        return None
    registers, stores, loads = max(functions.values(), default=(None, 0, 0))
    return Figures(max(shared, default=None), registers, stores, loads)


_LOG_PREFIX = re.compile(r"^[EWIF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
"""The prefix of XLA's own log lines (``E1207 02:46:41.841823   20862 xtile_compiler.cc:460] ``)."""


def _refusal(gpu: str, returncode: int, stderr: str, seconds: float) -> Outcome:
    # XLA's informational lines (figures, progress) are not the refusal.
    lines = [
        _LOG_PREFIX.sub("", line.strip())
        for line in stderr.splitlines()
        if line.strip() and not (line.startswith("I") and _LOG_PREFIX.match(line))
    ]
    raised = next((m for m in map(_RAISED.match, reversed(lines)) if m), None)
    reasons = list(dict.fromkeys(line for line in lines if _REASONS.search(line) and not _RAISED.match(line)))
    if raised is not None and raised.group(1) in ("ImportError", "ModuleNotFoundError"):
        return Outcome(gpu, seconds=seconds, unchecked=f"the compiler could not start: {raised.group(2)}")
    if raised is not None:
        message = raised.group(2)
        extra = [reason for reason in reasons if reason not in message][:3]
        return Outcome(gpu, raised.group(1), "\n".join([message, *extra]), seconds=seconds)
    if reasons:
        return Outcome(
            gpu,
            "fatal error",
            "\n".join(reasons[:3]) + f" (the compiler ended its process: exit {returncode})",
            seconds=seconds,
        )
    tail = lines[-1] if lines else "no output"
    return Outcome(
        gpu, seconds=seconds, unchecked=f"the compiler's process failed without a verdict (exit {returncode}: {tail})"
    )


_VERDICT_FORMAT = "gpu compiles, figures"


def _verdict_file(blob: bytes, gpu: str) -> str:
    versions = (jax_lookup.jax_version(), *(jax_lookup.distribution_version(n) or "" for n in ("jaxlib", *WHEELS)))
    target = repr(TARGETS.get(gpu))
    return _kept.file_for(
        "gpu-compiles", _VERDICT_FORMAT, target, *versions, os.environ.get("XLA_FLAGS", ""), gpu, blob
    )


def _read_verdict(path: str | None, gpu: str) -> Outcome | None:
    """A compile kept by an earlier run: only kernels that compiled are kept (a refusal is compiled
    again, so its message is the compiler's own, whole)."""
    fields = _kept.read(path)
    if not isinstance(fields, dict) or fields.get("gpu") != gpu or fields.get("compiled") is not True:
        return None
    kept = fields.get("figures")
    try:
        figures = Figures(*kept) if kept is not None else None
    except TypeError:  # kept by another version of the guard: compiled again
        return None
    return Outcome(gpu, cached=True, figures=figures)


def _write_verdict(path: str | None, outcome: Outcome) -> None:
    _kept.write(path, {"gpu": outcome.gpu, "compiled": True, "figures": outcome.figures})
