"""The target device: host code that asks which TPU/GPU it runs on is told the device set.

Much Pallas host code asks, before any kernel is built, which accelerator it runs on (TPU info, a
TPU core mesh's core count, tiling, a GPU's architecture or SM count). On a CPU that fails. JAX's
own answer is an abstract device on the current abstract mesh, which all of those consult; with a
``device`` set, the guard provides one, wherever the target is the CPU and the guard interprets
(policy ``interpret`` or ``warn``): process-wide as the abstract mesh's global value, in a
``policy()`` scope (and a pytest marker) as a scoped one. A mesh or abstract mesh of the user's own
always wins: the guard never replaces one. Nothing else changes: ``jax.devices()``, shardings and
``jax.jit`` programs with the user's own ``Mesh`` do not consult an empty abstract mesh's device.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from pallas_guard._deciding import target as _target
from pallas_guard._jax import config as jax_config
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.enums import Policy
from pallas_guard._vocabulary.errors import PallasGuardWarning
from pallas_guard_autoload import DEVICES, device_list, device_slice, slice_devices


def abstract_device(name: str, *, like: Any = None) -> Any:
    """JAX's ``AbstractDevice`` for a device short name (jax < 0.10 takes no platform); ``like``: a
    device (a TPU topology's) whose own kind and core count are presented instead."""
    import jax

    kind, cores, platform = DEVICES[name]
    if like is not None:
        kind, cores = like.device_kind, getattr(like, "num_cores", cores)
    try:
        return jax.sharding.AbstractDevice(kind, cores, platform)
    except TypeError:
        return jax.sharding.AbstractDevice(kind, cores)  # type: ignore[call-arg]


def _abstract_mesh(name: str, *, like: Any = None) -> Any:
    import jax

    return jax.sharding.AbstractMesh((), (), abstract_device=abstract_device(name, like=like))


def tpu_cores(setting: str | None) -> int | None:
    """The cores of the device setting's first TPU (TPU interpret mode simulates as many per
    device), or None where it names no TPU."""
    tpus = [name for name in device_list(setting) if DEVICES[name][2] == "tpu"]
    return DEVICES[tpus[0]][1] if tpus else None


def wanted() -> str | None:
    """The device to present here, or None: a device is set, the guard interprets, and the target
    is the CPU (configured, or unknown with no accelerator plugin to lower for)."""
    try:
        device = _settings.current("device").value
        policy = _settings.current_policy().value
    except (ValueError, TypeError):  # a bad variable: the first kernel raises it, naming it
        return None
    devices = device_list(device)
    if not devices or policy not in (Policy.INTERPRET, Policy.WARN):
        return None
    return devices[0] if _cpu_target() else None  # a list: host code is told its first device


def interpreting_on_cpu() -> bool:
    """Whether the guard interprets here (policy ``interpret`` or ``warn``) with the CPU as the
    target: where a device, set, would be presented."""
    try:
        policy = _settings.current_policy().value
    except (ValueError, TypeError):
        return False
    return policy in (Policy.INTERPRET, Policy.WARN) and _cpu_target()


def _cpu_target() -> bool:
    """The target is the CPU (configured, or unknown with no accelerator plugin to lower for)."""
    target = _target.detect().platform
    return target == "cpu" or (target is None and not _target.installed_accelerator_plugins())


def _free(mesh: Any) -> bool:
    """Whether ``mesh`` (an abstract mesh value) is nobody's: empty, with no device of its own."""
    return mesh is None or (bool(getattr(mesh, "empty", False)) and getattr(mesh, "abstract_device", None) is None)


class _Process:
    """The process-wide abstract mesh the guard set, and what it replaced."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ours: Any = None
        self.previous: Any = None
        self.device: str | None = None
        self.simulated: tuple[str, tuple[int, ...]] | None = None
        """The slice whose devices the CPU backend was given (or warned of), once per install."""
        self.cpu_devices: int | None = None
        """The ``jax_num_cpu_devices`` the guard set, put back by uninstall where no backend started."""


_process = _Process()


def apply() -> None:
    """Make the process-wide abstract mesh say the device wanted now (install, a new process policy,
    ``jax.experimental.pallas`` imported); a global mesh of the user's own is left alone."""
    holder = jax_config.abstract_mesh_config()
    if holder is None:
        return
    device = wanted()
    simulate_slice(device)
    with _process.lock:
        if device == _process.device:
            return
        current = holder.get_global()
        if _process.ours is not None and current is _process.ours:
            holder.set_global(_process.previous)
            current = _process.previous
        _process.ours = _process.previous = _process.device = None
        if device is not None and _free(current):
            _process.ours, _process.previous, _process.device = _abstract_mesh(device), current, device
            holder.set_global(_process.ours)


def simulate_slice(device: str | None) -> None:
    """Where the device setting names a TPU slice (``tpu-v5e:2x4``) and the guard interprets on a
    CPU target (``device``, as :func:`wanted` gives it: None where a setting's value is bad, which
    the first kernel raises): the CPU backend, not started yet, gets as many devices as the slice
    has (``jax_num_cpu_devices``), so that a mesh of the slice's shape can be made of them, unless
    the user asked for a count (``XLA_FLAGS``, ``jax_num_cpu_devices``). Started with fewer: a
    warning, once, says what to set."""
    if device is None:
        return
    shape = device_slice(_settings.current("device").value, device)
    if shape is None or _process.simulated == (device, shape):
        return
    _process.simulated = (device, shape)
    count = slice_devices(device, shape)
    import jax

    named = f"{device}:{'x'.join(map(str, shape))}"
    if jax_config.backends_initialized():
        cpus = len(jax.devices("cpu"))
        if cpus < count:
            text = (
                f"pallas_guard: the device setting names the slice {named} ({count} devices), and this process's "
                f"CPU backend started with {cpus}: a mesh of the slice's shape cannot be made. Set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={count} (or "
                f"jax.config.update('jax_num_cpu_devices', {count})) before JAX starts its backends."
            )
            # Said where it is installed or Pallas imported: never turned into their failure.
            with contextlib.suppress(Warning):
                warnings.warn(text, PallasGuardWarning, stacklevel=3)
        return
    config: Any = jax.config
    asked = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if asked or getattr(config, "jax_num_cpu_devices", -1) >= 0:
        return  # the user's own count
    config.update("jax_num_cpu_devices", count)
    _process.cpu_devices = count


def undo() -> None:
    """Put back what the guard replaced (uninstall): the abstract mesh, and the CPU device count it
    set where no backend has started with it yet."""
    holder = jax_config.abstract_mesh_config()
    with _process.lock:
        if holder is not None and _process.ours is not None and holder.get_global() is _process.ours:
            holder.set_global(_process.previous)
        _process.ours = _process.previous = _process.device = None
        if _process.cpu_devices is not None and not jax_config.backends_initialized():
            import jax

            config: Any = jax.config
            if getattr(config, "jax_num_cpu_devices", -1) == _process.cpu_devices:
                config.update("jax_num_cpu_devices", -1)
        _process.simulated = _process.cpu_devices = None


@contextlib.contextmanager
def answering() -> Iterator[None]:
    """While host code asks which accelerator it runs on (``get_tpu_info``,
    ``create_tensorcore_mesh``) inside a mesh of this host's CPU devices (a ``shard_map`` body),
    where the guard interprets with a device set: the mesh's axes with the device set as its
    device, as outside any mesh. A mesh of the user's on a real accelerator stays as it is."""
    holder = jax_config.abstract_mesh_config()
    device = wanted() if holder is not None else None
    in_mesh = jax_tracing.mesh_platform() if device is not None else None
    if device is None or in_mesh is None or in_mesh[0] != "cpu":
        yield
        return
    import jax

    current: Any = holder.value  # type: ignore[union-attr]

    try:
        mesh = jax.sharding.AbstractMesh(
            tuple(current.axis_sizes),
            tuple(current.axis_names),
            axis_types=tuple(current.axis_types),
            abstract_device=abstract_device(device),
        )
    except (TypeError, AttributeError):  # a jax whose meshes carry no device: asked as it is
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh):
        yield


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """Inside a ``policy()`` scope: the device its settings want, where no mesh of the user's is in
    force; the process-wide one taken away where they want none (``strict``, ``device="none"``)."""
    holder = jax_config.abstract_mesh_config()
    if holder is None:
        yield
        return
    import jax

    device = wanted()
    current = holder.value
    ours = _process.ours is not None and current is _process.ours
    if device is not None and (_free(current) or ours) and device != (_process.device if ours else None):
        with jax.sharding.use_abstract_mesh(_abstract_mesh(device)):
            yield
    elif device is None and ours:
        with jax.sharding.use_abstract_mesh(_process.previous or _empty_mesh()):
            yield
    else:
        yield


@contextlib.contextmanager
def presented(name: str, *, like: Any = None) -> Iterator[None]:
    """Device ``name`` presented while JAX lowers for its platform (the lowering and compile
    checks), where no mesh of the user's own is in force; the user's own mesh wins, as everywhere.
    ``like``: the real device compiled for, whose kind and cores are presented (a topology's)."""
    holder = jax_config.abstract_mesh_config()
    if holder is None:
        yield
        return
    import jax

    current = holder.value
    if _free(current) or (_process.ours is not None and current is _process.ours):
        with jax.sharding.use_abstract_mesh(_abstract_mesh(name, like=like)):
            yield
    else:
        yield


def _empty_mesh() -> Any:
    import jax

    return jax.sharding.AbstractMesh((), ())
