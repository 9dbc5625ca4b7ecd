"""The TPU's own verdict on a CPU: libtpu's compiler, run ahead of time for a TPU this host lacks.

JAX's deviceless ahead-of-time compilation gives a TPU topology without a TPU
(``jax.experimental.topologies.get_topology_desc``); an argument placed on one of its devices makes
``jax.jit(f).lower(...).compile()`` run the real TPU compiler (libtpu's Mosaic passes included) on
this CPU. A kernel is lowered (JAX's Python lowering, phase ``lower``) and compiled (libtpu, phase
``compile``) for a generation's topology device; a refusal keeps the compiler's own exception
(``JaxRuntimeError``, Pallas's ``MosaicError``). Where it compiles, the compiler's own scoped VMEM
allocation for each Mosaic kernel is read from the compiled program.

Nothing here changes ``jax.devices()`` or the default backend: the topology's devices are
compile-only, and the lowering sees the TPU through the argument shardings and an abstract device
presented for the call. Needs libtpu (Linux x86-64), the version ``jax[tpu]`` pins.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from pallas_guard._deciding import device as _device
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._running import kept as _kept
from pallas_guard_autoload import TPU_DEVICES_PER_CHIP, TPU_SLICE_DIMS, slice_devices


class Generation(NamedTuple):
    """A TPU generation the compile check targets, with what its compiler reports (measured with
    libtpu 0.0.42.1 and 0.0.50.1)."""

    topology: str
    """``get_topology_desc``'s topology name."""
    chips_per_host_bounds: tuple[int, int, int]
    chip_config: str
    """``default``, or ``megacore`` where JAX presents a chip's two TensorCores as one device (v4)."""
    accelerator_type: str
    """The ``TPU_ACCELERATOR_TYPE`` a TPU VM of this generation has (quiets libtpu's start-up)."""
    scoped_vmem_limit: int
    """The compiler's default scoped VMEM limit for a kernel (bytes), without ``vmem_limit_bytes``."""
    vmem_capacity: int
    """The VMEM of one TensorCore (bytes): the most a ``vmem_limit_bytes`` can give."""
    smem_capacity: int


_MIB = 1 << 20

GENERATIONS: dict[str, Generation] = {
    "tpu-v4": Generation("v4:2x2x1", (2, 2, 1), "megacore", "v4-8", 16 * _MIB, 16 * _MIB, _MIB),
    "tpu-v5e": Generation("v5e:1x1", (1, 1, 1), "default", "v5litepod-1", 16 * _MIB, 128 * _MIB, _MIB),
    "tpu-v5p": Generation("v5p:2x2x1", (2, 2, 1), "default", "v5p-8", 16 * _MIB, 64 * _MIB, _MIB),
    "tpu-v6e": Generation("v6e:1x1", (1, 1, 1), "default", "v6e-1", 32 * _MIB, 128 * _MIB, _MIB),
    "tpu7x": Generation("tpu7x:2x2x1", (2, 2, 1), "default", "tpu7x-8", 32 * _MIB, 64 * _MIB, _MIB),
}
"""Device-setting short names (``pallas_guard_autoload.DEVICES``) -> the topology compiled for."""

LIBTPU_PINS = {
    "0.7.2": "0.0.23",
    "0.8.3": "0.0.32.*",
    "0.9.2": "0.0.37.*",
    "0.10.2": "0.0.42.*",
    "0.11.0": "0.0.44.*",
    "0.11.2": "0.0.48.*",
    "0.12.0.1": "0.0.50.*",
    "0.12.1": "0.0.53.*",
}
"""The libtpu each jax release's ``tpu`` extra pins (read from each release's metadata), where the
installed jax's own metadata cannot say: the one table of them (``.ci/run`` and the docs point here)."""

PHASES = ("lower", "compile")


class Outcome(NamedTuple):
    """What the TPU compiler said of one kernel (one jitted program) for one generation."""

    generation: str
    phase: str | None
    """None where it compiled; ``"lower"`` (JAX's Python lowering refused it) or ``"compile"`` (libtpu)."""
    error: BaseException | None = None
    """The refusal, as raised (its type kept)."""
    message: str | None = None
    """The refusal's first meaningful line."""
    vmem_used: int | None = None
    """The compiler's scoped VMEM allocation (bytes), the largest over the program's Mosaic kernels."""
    vmem_limit: int | None = None
    """The scoped VMEM limit that kernel compiled under: its ``vmem_limit_bytes``, else the generation's."""
    smem_used: int | None = None
    """An estimate: the bytes of the SMEM operands the Mosaic kernel declares (scalar prefetch, SMEM
    blocks and scratch, unpadded), the largest over the kernels. libtpu reports no SMEM use."""
    smem_limit: int | None = None
    vmem_scratch: int | None = None
    """The bytes of the kernel's VMEM ``scratch_shapes`` the compiler placed outside its scoped
    allocation (held to the whole VMEM, not the scoped limit); None where they are inside it."""
    kernels: int = 0
    """Mosaic kernels in the compiled program."""
    seconds: float = 0.0
    """Wall time of the lowering and the compile (the topology, made once per process, excluded)."""
    unchecked: str | None = None
    """Why the compile could not run here (not a verdict on the kernel); None where it ran."""
    cached: bool = False
    """Read from the verdicts cache (``verdicts_dir``): compiled by an earlier run, not this one."""
    windows: tuple[Window, ...] = ()
    """Where libtpu refused the kernel: its VMEM blocks (what a "To fix" can shrink)."""


# --- availability ---------------------------------------------------------------------------------


def libtpu_pin(jax_version: str | None = None) -> str | None:
    """The libtpu requirement of ``jax[tpu]`` for the installed jax (its metadata), else for a
    release in ``LIBTPU_PINS``; e.g. ``"0.0.42.*"``."""
    installed = _distribution_version("jax")
    version = jax_version or installed
    if version is not None and version == installed:
        for requirement in importlib.metadata.requires("jax") or ():
            match = re.match(r"\s*libtpu\s*==\s*([^;\s]+)\s*;(.*)", requirement)
            if match and "tpu" in match.group(2):
                return match.group(1)
    return LIBTPU_PINS.get(version or "")


def install_command() -> str:
    """The command that installs the libtpu this jax's ``tpu`` extra pins, saying so."""
    pin = libtpu_pin()
    jax_version = _distribution_version("jax") or "?"
    if pin is None:
        return f'pip install "jax[tpu]=={jax_version}"'
    return f'pip install "libtpu=={pin}" (the libtpu jax[tpu]=={jax_version} pins)'


def available() -> str | None:
    """None where this process can compile for a TPU without one; else why not, in one line, with
    the install command. Cheap: libtpu is found, not loaded."""
    try:
        import jax  # noqa: F401
        from jax.experimental import topologies
    except ImportError as error:
        return f"the TPU compile check needs jax with jax.experimental.topologies ({error})"
    if not hasattr(topologies, "get_topology_desc"):
        return f"jax {jax_lookup.jax_version()} has no deviceless TPU topology (get_topology_desc)"
    library = os.environ.get("TPU_LIBRARY_PATH")
    try:
        found = importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):  # a broken or blocked libtpu module
        found = False
    if not (library and os.path.isfile(library)) and not found:
        return f"libtpu is not installed (Linux x86-64 only): {install_command()}"
    pin = libtpu_pin()
    installed = _distribution_version("libtpu")
    if pin is not None and installed is not None and not _matches(installed, pin):
        return (
            f"libtpu {installed} is installed, but jax {jax_lookup.jax_version()} pins libtpu=={pin}: "
            f"{install_command()}"
        )
    return None


_distribution_version = jax_lookup.distribution_version


def _matches(version: str, pin: str) -> bool:
    return version.startswith(pin[:-1]) if pin.endswith("*") else version == pin


# --- the topology -----------------------------------------------------------------------------------

_lock = threading.Lock()
_devices: dict[str, Any] = {}
"""Generation -> its topology's first device, or the reason the topology API gave for refusing it."""


def topology_device(generation: str) -> Any:
    """The first device of ``generation``'s deviceless topology (a compile-only ``Device``), or a
    one-line reason (a str) where it cannot be made. Made once per process and generation."""
    if generation not in GENERATIONS:
        return f"no TPU topology for {generation!r} (known: {', '.join(GENERATIONS)})"
    with _lock:
        if generation not in _devices:
            _devices[generation] = _make_device(generation)
        return _devices[generation]


def _make_device(generation: str) -> Any:
    spec = GENERATIONS[generation]
    devices = _make_topology(generation, spec.topology, spec.chips_per_host_bounds)
    return devices if isinstance(devices, str) else devices[0]


_CHIPS_2D = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8)}
_CHIPS_3D = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4)}
_meshes: dict[tuple[str, str], Any] = {}


def topology_for(
    generation: str, devices: int, named: tuple[int, ...] | None = None
) -> tuple[str, tuple[int, int, int]] | str:
    """The deviceless topology of ``generation`` with ``devices`` devices (``v5e:2x2`` for 4 on a
    v5e, or the slice ``named`` by the device setting) and its chips per host (a host has at most
    2x4 chips of a 2-D generation, 2x2x1 of a 3-D one); else why there is none."""
    spec = GENERATIONS.get(generation)
    if spec is None:
        return f"no TPU topology for {generation!r} (known: {', '.join(GENERATIONS)})"
    per_chip = TPU_DEVICES_PER_CHIP.get(generation, 1)
    three_d = TPU_SLICE_DIMS.get(generation) == 3
    prefix = spec.topology.split(":")[0]
    if named is not None:
        shape = named
        on_the_slice = slice_devices(generation, named)
        if on_the_slice != devices:
            return (
                f"the device setting names the slice {prefix}:{'x'.join(map(str, named))} ({on_the_slice} devices), "
                f"and the mesh has {devices}"
            )
    else:
        shapes = _CHIPS_3D if three_d else _CHIPS_2D
        chips = devices // per_chip
        if devices % per_chip or chips not in shapes:
            counts = ", ".join(str(count * per_chip) for count in shapes)
            return f"a mesh of {devices} devices maps onto no {generation} topology (it has {counts} devices)"
        shape = shapes[chips]
    name = f"{prefix}:{'x'.join(map(str, shape))}"
    host = (2, 2, 1) if three_d else (2, 4, 1)
    padded = (*shape, 1, 1)[:3]
    return name, (min(padded[0], host[0]), min(padded[1], host[1]), min(padded[2], host[2]))


def topology_devices(generation: str, devices: int, named: tuple[int, ...] | None = None) -> Any:
    """``devices`` compile-only devices of a deviceless topology of ``generation`` (a list), or a
    one-line reason (a str); made once per process, generation and shape."""
    found = topology_for(generation, devices, named)
    if isinstance(found, str):
        return found
    with _lock:
        if (generation, found[0]) not in _meshes:
            _meshes[generation, found[0]] = _make_topology(generation, *found)
        return _meshes[generation, found[0]]


def _make_topology(generation: str, name: str, bounds: tuple[int, int, int]) -> Any:
    missing = available()
    if missing is not None:
        return missing
    from jax.experimental import topologies

    spec = GENERATIONS[generation]
    try:
        with _deviceless_start(spec):
            topology = topologies.get_topology_desc(
                platform="tpu",
                topology_name=name,
                chip_config_name=spec.chip_config,
                chips_per_host_bounds=bounds,
                num_slices=1,
            )
        return list(topology.devices)
    except (MemoryError, RecursionError):
        raise
    except Exception as error:
        lines = str(error).strip().splitlines()
        return f"the TPU topology {name} was refused: {type(error).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _deviceless_start(spec: Generation) -> Iterator[None]:
    """libtpu, started on a host without a TPU, prints warnings (from C++, on fd 2) unless the
    environment names its accelerator type and workers, and takes a host-wide lock
    (``/tmp/libtpu_lockfile``) that makes a second process's start fail (``pytest -n``) unless
    ``ALLOW_MULTIPLE_LIBTPU_LOAD`` is set. Where libtpu has not yet started and this host has no
    TPU, each of those left unset is set for the start only."""
    if not _first_start():
        yield
        return
    wanted = {
        "TPU_ACCELERATOR_TYPE": spec.accelerator_type,
        "TPU_WORKER_HOSTNAMES": "localhost",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    if "TPU_ACCELERATOR_TYPE" in os.environ or "TPU_WORKER_HOSTNAMES" in os.environ:
        # A half-described TPU VM is the user's to describe: only the lock is relaxed.
        wanted = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _first_start() -> bool:
    """Whether libtpu has not yet started in this process and no TPU is attached to this host."""
    try:
        xla_client: Any = importlib.import_module("jax._src.lib").xla_client
        if xla_client.pjrt_plugin_loaded("tpu") and xla_client.pjrt_plugin_initialized("tpu"):
            return False
        hardware: Any = importlib.import_module("jax._src.hardware_utils")
        chips, _ = hardware.num_available_tpu_chips_and_device_id()
    except (ImportError, AttributeError, OSError):
        return False  # cannot tell: leave libtpu's start as it is
    return int(chips) == 0


# --- the compile ------------------------------------------------------------------------------------

_NOT_THE_KERNELS = ("Unsupported TPU device kind", "AbstractDevice")
"""Words of lowering errors that say the TPU device did not reach the lowering."""

_IN_A_MESH = "Received incompatible devices for jitted computation"
"""jit's words for operands placed on the TPU topology while a mesh of this host's devices is in
force (``jax.set_mesh``): where the check is, not the kernel."""


class Mesh(NamedTuple):
    """The mesh a kernel is called in (inside ``shard_map``): its axis names and sizes."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def devices(self) -> int:
        count = 1
        for size in self.sizes:
            count *= size
        return count

    def __str__(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in zip(self.names, self.sizes, strict=True))


def compile_kernel(
    build: Callable[[], Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    generation: str,
    *,
    mesh: Mesh | None = None,
) -> Outcome:
    """Lower and compile what ``build()`` returns (the user's callable, built without ``interpret=``),
    called with the shapes and dtypes of ``args``/``kwargs`` (arrays, tracers, ``ShapeDtypeStruct``)
    placed on ``generation``'s topology device, with libtpu's compiler; inside ``shard_map`` over a
    ``mesh`` of as many devices of that generation, where the kernel is called in one."""
    return start_compile(build, args, kwargs, generation, mesh=mesh).outcome()


class Compiling(NamedTuple):
    """A verdict on its way: known at once (lowering refused, kept on disk or refused earlier in
    this process), or libtpu compiling in a thread of its own (``ready`` False)."""

    outcome: Callable[[], Outcome]
    """The verdict, waiting for the compile where it runs (asked once)."""
    ready: bool


def start_compile(
    build: Callable[[], Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    generation: str,
    *,
    mesh: Mesh | None = None,
    named: tuple[int, ...] | None = None,
) -> Compiling:
    """``compile_kernel``, with libtpu's compile started in a thread and left to run beside the
    caller (libtpu compiles in C++, without the GIL): JAX's lowering for the TPU runs here, now."""
    spec = GENERATIONS.get(generation)
    smem_limit = spec.smem_capacity if spec else None

    def known(outcome: Outcome) -> Compiling:
        return Compiling(lambda: outcome, ready=True)

    placed = _on_the_topology(build, generation, mesh, bool(kwargs), named)
    if isinstance(placed, str):
        return known(Outcome(generation, None, smem_limit=smem_limit, unchecked=placed))
    function, sharding, device, where = placed
    import jax

    # The topology's mesh in force in place of any the user set for this host's devices.
    topology_mesh = getattr(sharding, "mesh", None)
    mesh_scope = jax_tracing.in_mesh(topology_mesh) if topology_mesh is not None else contextlib.nullcontext()

    avals, kwavals = _placed((args, kwargs), sharding)
    start = time.perf_counter()
    try:
        # The topology device's own kind and cores: Pallas's TPU lowering (1-D blocks, `sign`) and
        # host code (`get_tpu_info()`) ask the abstract device, else this CPU. The outputs are
        # placed there too: a kernel without array inputs would otherwise compile for the CPU.
        with (
            jax_tracing.outside_meshes(),
            _device.presented(generation, like=device),
            jax_tracing.retrace_logs_muted(),
            mesh_scope,
        ):
            lowered = jax.jit(function, out_shardings=sharding).lower(*avals, **kwavals)
    except (MemoryError, RecursionError):
        raise
    except Exception as error:
        seconds = time.perf_counter() - start
        message = first_line(error)
        if any(words in message for words in _NOT_THE_KERNELS):
            return known(Outcome(generation, None, smem_limit=smem_limit, seconds=seconds, unchecked=message))
        if _IN_A_MESH in message:
            why = "called under a mesh of this host's devices (jax.set_mesh), where the check cannot place it on a TPU"
            return known(Outcome(generation, None, smem_limit=smem_limit, seconds=seconds, unchecked=why))
        return known(Outcome(generation, "lower", error, message, smem_limit=smem_limit, seconds=seconds))
    return _compiling(lowered, generation, where, start=start, smem_limit=smem_limit)


def _on_the_topology(
    build: Callable[[], Callable[..., Any]],
    generation: str,
    mesh: Mesh | None,
    keywords: bool,
    named: tuple[int, ...] | None,
) -> tuple[Callable[..., Any], Any, Any, str] | str:
    """(the kernel to lower, the sharding of its operands and outputs, a device of the topology,
    the topology's name): on one device of ``generation``'s topology; inside ``shard_map`` over a
    mesh of the topology's devices (the slice ``named`` by the device setting, else one with as
    many) where the kernel is called in a ``mesh`` (each device given the per-shard operands the
    kernel sees); or why not."""
    import jax

    def alone() -> tuple[Callable[..., Any], Any, Any, str] | str:
        device = topology_device(generation)
        if isinstance(device, str):
            return device
        return build(), jax.sharding.SingleDeviceSharding(device), device, GENERATIONS[generation].topology

    if mesh is None:
        return alone()
    if keywords:
        why = "a kernel inside shard_map called with keyword arguments is not compiled for a topology"
        return alone() if mesh.devices == 1 else why
    devices = topology_devices(generation, mesh.devices, named)
    if isinstance(devices, str):
        # One device where no one-device slice exists (a tpu7x chip is two devices): compiled
        # alone, where a kernel that asks its axis index is refused.
        return alone() if mesh.devices == 1 else devices
    import numpy as np

    topology = topology_for(generation, mesh.devices, named)
    topology_mesh = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(mesh.sizes), mesh.names)
    everywhere: Any = jax.sharding.PartitionSpec
    replicated = jax.sharding.NamedSharding(topology_mesh, everywhere())
    where = topology[0] if isinstance(topology, tuple) else generation
    return jax_tracing.per_shard(build(), topology_mesh), replicated, devices[0], where


def _compiling(lowered: Any, generation: str, where: str, *, start: float, smem_limit: int | None) -> Compiling:
    """The compiler's verdict on ``lowered``: kept on disk where it compiled, in the process where
    it was refused, else compiled now, in a thread."""
    cache = _verdict_file(lowered, generation, where)
    refused = _refused.get(cache) if cache is not None else None
    if refused is not None:  # refused in this process: the same input to the same compiler
        seconds = time.perf_counter() - start
        return Compiling(lambda: refused._replace(seconds=seconds), ready=True)
    kept = _read_verdict(cache)
    if kept is not None:
        seconds = time.perf_counter() - start
        return Compiling(lambda: _compiled(generation, kept, smem_limit, seconds, cached=True), ready=True)
    done: list[Any] = []  # the compiled executable, or the refusal

    def compile_it() -> None:
        try:
            compiled = lowered.compile()
        except BaseException as error:  # the refusal, handed to the caller as raised
            done.append(error)
            return
        try:  # the figures read in the thread too, beside the interpreted run rather than after it
            usage = memory(compiled.as_text() or "", generation)
            _write_verdict(cache, usage)
            done.append(usage)
        except BaseException as error:  # the guard's own failure: raised in the caller, never a verdict
            done.append(_OwnFailure(error))

    worker = threading.Thread(target=compile_it, name="pallas_guard TPU compile", daemon=True)
    worker.start()

    def outcome() -> Outcome:
        worker.join()
        seconds = time.perf_counter() - start
        result = done[0]
        if isinstance(result, _OwnFailure):
            raise result.error
        if isinstance(result, BaseException):
            if not isinstance(result, Exception) or isinstance(result, (MemoryError, RecursionError)):
                raise result
            blocks = tuple(windows(lowered) or ())
            refusal = Outcome(
                generation,
                "compile",
                result,
                first_line(result),
                smem_limit=smem_limit,
                seconds=seconds,
                windows=blocks,
            )
            if cache is not None:
                _refused[cache] = refusal
            return refusal
        return _compiled(generation, result, smem_limit, seconds, cached=False)

    return Compiling(outcome, ready=False)


class _OwnFailure(NamedTuple):
    error: BaseException


def _compiled(generation: str, usage: Memory, smem_limit: int | None, seconds: float, *, cached: bool) -> Outcome:
    return Outcome(
        generation,
        None,
        vmem_used=usage.vmem_used,
        vmem_limit=usage.vmem_limit,
        smem_used=usage.smem_used,
        smem_limit=smem_limit,
        vmem_scratch=usage.vmem_scratch,
        kernels=usage.kernels,
        seconds=seconds,
        cached=cached,
    )


# --- the verdicts cache -------------------------------------------------------------------------------
# libtpu's compile of even a tiny kernel costs 25-50 ms of CPU, more than an interpreted first call
# of it; CI runs the same kernels run after run. A kernel that compiled is kept on disk by what was
# compiled (the lowered module, the Mosaic kernel serialised in it), for which generation, with
# which jax and libtpu: the same input to the same compiler. A refusal is kept for the process only
# (``_refused``: a kernel refused at its first call is not compiled again at every later one); on
# disk it is not, so a new run's error is the compiler's own, raised by it.

_refused: dict[str, Outcome] = {}
_VERDICT_FORMAT = "memory with scratch"
"""Part of each kept verdict's key: a change of what is kept (a new figure) starts afresh."""


def verdicts_dir() -> str:
    """Where compiles that succeeded are kept (``kept``)."""
    return _kept.folder("tpu-compiles")


def _verdict_file(lowered: Any, generation: str, where: str) -> str | None:
    """The file a compile of ``lowered`` for ``generation`` on topology ``where`` is kept in: slices
    of the same size (``v5p:2x2x2``, ``v5p:2x4x1``) lower to the same text."""
    try:
        text = lowered.as_text()
    except Exception:  # a lowering that cannot print itself is compiled every time
        return None
    library = os.environ.get("TPU_LIBRARY_PATH") or ""
    if library and os.path.isfile(library):
        library += f"@{os.path.getmtime(library)}"
    # The compiler's flags change its verdict too (LIBTPU_INIT_ARGS can set the scoped VMEM limit).
    flags = tuple(os.environ.get(name, "") for name in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"))
    compiler = (_VERDICT_FORMAT, repr(GENERATIONS.get(generation)), *_versions(), library, *flags)
    return _kept.file_for("tpu-compiles", *compiler, generation, where, text)


@functools.cache
def _versions() -> tuple[str, ...]:
    """jax, jaxlib and libtpu: read once (their metadata does not change in a process)."""
    return (jax_lookup.jax_version() or "", *(_distribution_version(n) or "" for n in ("jaxlib", "libtpu")))


def _read_verdict(path: str | None) -> Memory | None:
    fields = _kept.read(path)
    try:
        known = Memory(**fields) if isinstance(fields, dict) else None
    except TypeError:  # not ours: compile
        return None
    if known is None:
        return None
    numbers = (known.vmem_used, known.vmem_limit, known.smem_used, known.vmem_scratch)
    if not isinstance(known.kernels, int) or not all(n is None or isinstance(n, int) for n in numbers):
        return None
    return known


def _write_verdict(path: str | None, usage: Memory) -> None:
    _kept.write(path, usage._asdict())


def _placed(tree: Any, sharding: Any) -> Any:
    """Arrays, tracers and ``ShapeDtypeStruct``s as shapes and dtypes on the topology device."""
    import jax

    shaped: Any = jax.ShapeDtypeStruct

    def place(leaf: Any) -> Any:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return shaped(leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False), sharding=sharding)
        return leaf

    return jax.tree_util.tree_map(place, tree)


def first_line(error: BaseException) -> str:
    """The refusal's first meaningful line: a header that only names an error code
    (``E1001: CompileTimeScopedVmemOom:``) is joined with the line that says what ran out."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:
        line = f"{line} {lines[1]}"
    return line[:500]


# --- the compiler's numbers ---------------------------------------------------------------------


class Memory(NamedTuple):
    vmem_used: int | None
    vmem_limit: int | None
    smem_used: int | None
    kernels: int
    vmem_scratch: int | None = None


_VMEM = "1"
"""The memory space libtpu's scoped memory configs call VMEM."""


def memory(hlo_text: str, generation: str) -> Memory:
    """The scoped VMEM the compiler allocated (``used_scoped_memory_configs``) and the limit it was
    held to (``scoped_memory_configs``, where the kernel set ``vmem_limit_bytes``, else the
    generation's default) for the largest Mosaic kernel of a compiled program's HLO text."""
    spec = GENERATIONS.get(generation)
    default_limit = spec.scoped_vmem_limit if spec else None
    best: tuple[int, int | None] | None = None
    smem: int | None = None
    scratch: int | None = None
    kernels = 0
    decoder = json.JSONDecoder()
    marker, key = 'custom_call_target="tpu_custom_call"', "backend_config="
    # An instruction can span lines (its kernel metadata may hold newlines): read from each call's
    # target to its backend config, wherever that is.
    position = hlo_text.find(marker)
    while position >= 0:
        following = hlo_text.find(marker, position + len(marker))
        start = hlo_text.find(key, position)
        position = following
        if start < 0 or (0 <= following < start):
            continue
        try:
            config, _ = decoder.raw_decode(hlo_text, start + len(key))
        except ValueError:
            continue
        kernels += 1
        used = _space_size(config.get("used_scoped_memory_configs"))
        limit = _space_size(config.get("scoped_memory_configs")) or default_limit
        if used is not None and (best is None or used > best[0]):
            best = (used, limit)
        body = (config.get("custom_call_config") or {}).get("body")
        operands = declared(body) if isinstance(body, str) else None
        if operands is not None:
            smem = max(smem or 0, operands.smem)
            # A scratch larger than the whole scoped allocation was placed outside it (libtpu does
            # so for some kernels, and then holds it to the whole VMEM).
            if operands.vmem_scratch > (used or 0):
                scratch = max(scratch or 0, operands.vmem_scratch)
    return Memory(best[0] if best else None, best[1] if best else default_limit, smem, kernels, scratch)


def _space_size(configs: Any) -> int | None:
    for entry in configs or ():
        if str(entry.get("memory_space")) == _VMEM:
            return int(entry.get("size", 0))
    return None


_MEMREF = re.compile(r"memref<((?:\d+x)*)([a-z]+)(\d+)\b[^>]*#tpu\.memory_space<(\w+)>>")


class Declared(NamedTuple):
    smem: int
    """The bytes of the SMEM operands (scalar prefetch, SMEM blocks and scratch), unpadded."""
    vmem_scratch: int
    """The bytes of the VMEM scratch operands, padded to the tiling libtpu allocates them in."""


def declared(body: str) -> Declared | None:
    """What the Mosaic kernel in a ``tpu_custom_call`` body (base64 MLIR bytecode) declares as
    operands in SMEM and as VMEM scratch; None where the body cannot be read here."""
    operands = _operands(body)
    if operands is None:
        return None
    smem = scratch = 0
    for operand in operands:
        if operand.space == "smem":
            smem += _product(list(operand.shape)) * operand.bits // 8
        elif operand.scratch:
            scratch += _tiled_bytes(list(operand.shape), operand.bits)
    return Declared(smem, scratch)


class Window(NamedTuple):
    """A block the kernel's pipeline keeps in VMEM (double-buffered unless told otherwise)."""

    operand: str
    """``input 0``, ``output 1`` (``operand 2`` where inputs and outputs cannot be told apart)."""
    shape: tuple[int, ...]
    bits: int
    bytes: int
    """One buffer, padded to libtpu's tiling."""


def windows(lowered: Any) -> list[Window] | None:
    """The VMEM blocks of the one Mosaic kernel of a lowered program (``jax.jit(...).lower(...)``),
    inputs then outputs; None where the program has another number of kernels or cannot be read."""
    try:
        mlir_lib: Any = importlib.import_module("jax._src.lib.mlir")
        module = lowered.compiler_ir("stablehlo")
        calls = [
            op
            for op in _operations(module.operation)
            if op.name == "stablehlo.custom_call" and "tpu_custom_call" in str(op.attributes["call_target_name"])
        ]
        if len(calls) != 1:
            return None
        config = json.loads(mlir_lib.ir.StringAttr(calls[0].attributes["backend_config"]).value)
        operands = _operands(config["custom_call_config"]["body"])
        if operands is None:
            return None
        blocks = [o for o in operands if not o.scratch and o.space == "vmem"]
        outputs = len(calls[0].results)
        inputs = len(blocks) - outputs
        both = inputs >= 0 and len([o for o in operands if not o.scratch and o.space != "smem"]) == len(blocks)
        found = []
        for position, block in enumerate(blocks):
            label = f"operand {position}"
            if both:
                label = f"input {position}" if position < inputs else f"output {position - inputs}"
            size = _tiled_bytes(list(block.shape), block.bits)
            found.append(Window(label, block.shape, block.bits, size))
        return found
    except Exception:  # a program that cannot be read here: no windows, not an error
        return None


def _operations(operation: Any) -> Iterator[Any]:
    for region in operation.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _operations(inner)


class _Operand(NamedTuple):
    shape: tuple[int, ...]
    bits: int
    space: str
    scratch: bool


def _operands(body: str) -> list[_Operand] | None:
    """The memref operands of the Mosaic kernel in a ``tpu_custom_call`` body, in order."""
    try:
        mlir: Any = importlib.import_module("jax._src.interpreters.mlir")
        tpu: Any = importlib.import_module("jax._src.lib").tpu
        mlir_lib: Any = importlib.import_module("jax._src.lib.mlir")
        ir, passmanager = mlir_lib.ir, mlir_lib.passmanager

        context = mlir.make_ir_context()
        tpu.register_dialect(context)
        with context, ir.Location.unknown():
            context.allow_unregistered_dialects = True
            module = ir.Module.parse(base64.b64decode(body))
            passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            kernels = [op for op in module.body.operations if "scalar_prefetch" in op.attributes]
            if not kernels:
                return None
            kernel = kernels[0]
            arguments = list(kernel.regions[0].blocks[0].arguments)
            scratch_count = (
                int(str(kernel.attributes["scratch_operands"]).split(":")[0])
                if ("scratch_operands" in kernel.attributes)
                else 0
            )
            operands = []
            for position, argument in enumerate(arguments):
                match = _MEMREF.search(str(argument.type))
                if match is None:
                    continue
                dims = tuple(int(dim) for dim in filter(None, match.group(1).split("x")))
                bits = max(int(match.group(3)), 8)
                operands.append(_Operand(dims, bits, match.group(4), position >= len(arguments) - scratch_count))
            return operands
    except Exception:  # an unreadable body (another bytecode version): no figure, not an error
        return None


def _product(dims: list[int]) -> int:
    total = 1
    for dim in dims:
        total *= dim
    return total


def _tiled_bytes(dims: list[int], bits: int) -> int:
    """Bytes of a VMEM array as libtpu lays it out: the last two dimensions in tiles of
    (8 x 32/bits, 128) (``f32[40960,128]{1,0:T(8,128)}`` takes 20 MiB)."""
    if not dims:
        return max(bits // 8, 4)
    padded = list(dims)
    padded[-1] = -(-padded[-1] // 128) * 128
    if len(padded) >= 2:
        rows = 8 * max(32 // bits, 1)
        padded[-2] = -(-padded[-2] // rows) * rows
    return _product(padded) * bits // 8
