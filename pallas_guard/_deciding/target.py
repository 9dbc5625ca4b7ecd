"""Where will a kernel lower? Answered from configuration alone: never initialises a backend.

Initialising a backend early breaks ``jax.distributed.initialize()`` and a later
``jax.config.update("jax_platforms", ...)``, so ``jax.devices()`` is never called here.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

from pallas_guard._jax import config as jax_config
from pallas_guard._jax import tracing as jax_tracing


class Target(NamedTuple):
    """The platform a kernel will lower for, or None when configuration does not say."""

    platform: str | None
    evidence: tuple[str, ...]
    """Why: which signal decided, in words a diagnostic can print."""

    @property
    def is_cpu(self) -> bool:
        return self.platform == "cpu"


UNKNOWN = Target(None, ("no default-device scope, no jax_platforms, backends not initialised",))


def _platform_of(device: object) -> str | None:
    if isinstance(device, str):
        return device.strip().lower() or None
    platform = getattr(device, "platform", None)
    return str(platform) if platform is not None else None


def _platforms_source(value: str) -> str:
    env = os.environ.get("JAX_PLATFORMS")
    if env is not None and env.strip() == value.strip():
        return f"JAX_PLATFORMS={value!r}"
    return f"jax.config jax_platforms={value!r} (set in code)"


def detect() -> Target:
    """Where a kernel called now will lower: the platforms of a ``jax.export`` tracing it, else the
    devices of a mesh in force, a default-device scope, ``jax_platforms``, or the live backend."""
    exporting = jax_tracing.export_platforms()
    if exporting is not None:
        return _export_target(exporting)
    in_mesh = jax_tracing.mesh_platform()
    if in_mesh is not None and in_mesh[0] != "cpu":
        # A program over an accelerator's devices (a TPU topology's, compiled ahead of time from
        # this host): it lowers for them, whatever this process's default backend is.
        return Target(in_mesh[0], (f"the mesh in force is of {in_mesh[1] or in_mesh[0]} devices",))
    device = jax_config.jax_config_value("jax_default_device")
    if device is not None:
        platform = _platform_of(device)
        if platform is not None:
            return Target(platform, (f"jax.default_device({device!r}) scope or jax_default_device config",))
    platforms = jax_config.jax_config_value("jax_platforms")
    if isinstance(platforms, str) and platforms.strip():
        # The first entry has the highest priority: it is the default backend.
        first = platforms.split(",")[0].strip().lower()
        if first:
            return Target(first, (_platforms_source(platforms),))
    backend = jax_config.default_backend()
    if backend is not None:
        return Target(backend, (f"jax.default_backend() is {backend!r} (backends already initialised)",))
    return UNKNOWN


def _export_target(platforms: tuple[str, ...]) -> Target:
    """An export for the CPU alone is a CPU target; for several platforms each branch lowers for its
    own (unknown here: the lowering net serves the CPU branch); for accelerators only, theirs."""
    why = (f"jax.export for platforms {platforms!r}",)
    if platforms == ("cpu",):
        return Target("cpu", why)
    if platforms and "cpu" not in platforms:
        return Target(platforms[0], why)
    return Target(None, why)


def lowering_target(platforms: tuple[str, ...]) -> Target:
    """The target the lowering net sees: JAX is lowering this equation for the CPU now."""
    why = [f"JAX is lowering the kernel for {', '.join(platforms) or 'cpu'}"]
    configured = detect()
    if configured.platform is not None:
        why.extend(configured.evidence)
    return Target("cpu", tuple(why))


# --- evidence for "why is this CPU?" (package metadata and device files; cached) ---------------

_PLUGIN_DISTRIBUTIONS = (
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "libtpu",
    "jax-rocm6-plugin",
    "jax-rocm7-plugin",
)
_NVIDIA_MARKERS = ("/dev/nvidia0", "/proc/driver/nvidia/version")


@functools.lru_cache(maxsize=1)
def installed_accelerator_plugins() -> tuple[str, ...]:
    """Accelerator plugins installed where this interpreter loads packages from.

    Not the working directory (``sys.path``'s ``''`` or its absolute path, for ``python -c``/``-m``):
    a stray ``libtpu-*.dist-info`` folder there is not a plugin JAX would load. A distribution
    without a version (an empty folder) is no installed plugin either.
    """
    import sys
    from importlib import metadata

    cwd = os.getcwd()
    path = [entry for entry in sys.path if entry and os.path.abspath(entry) != cwd]
    found = []
    for name in _PLUGIN_DISTRIBUTIONS:
        for distribution in metadata.distributions(name=name, path=path):
            version = distribution.metadata["Version"] if distribution.metadata is not None else None
            if version:
                found.append(f"{name} {version}")
                break
    return tuple(found)


@functools.lru_cache(maxsize=1)
def nvidia_gpu_marker() -> str | None:
    """A device file that says an NVIDIA GPU and driver are present, else None."""
    return next((path for path in _NVIDIA_MARKERS if os.path.exists(path)), None)


def accelerator_evidence() -> list[str]:
    """Lines for a diagnostic: installed plugins, and the silent-CPU-fallback case."""
    plugins = installed_accelerator_plugins()
    lines = []
    if plugins:
        lines.append(f"Accelerator plugins installed: {', '.join(plugins)}.")
    else:
        lines.append(
            "No accelerator plugin is installed (looked for "
            + ", ".join(_PLUGIN_DISTRIBUTIONS)
            + "), so JAX can only use the CPU here."
        )
    marker = nvidia_gpu_marker()
    if marker is not None and not any(p.startswith("jax-cuda") for p in plugins):
        lines.append(
            f"!! An NVIDIA GPU seems present ({marker} exists) but no CUDA plugin is installed: "
            "JAX fell back to the CPU. Install one with: pip install -U 'jax[cuda12]' (or cuda13)."
        )
    return lines
