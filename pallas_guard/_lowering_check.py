"""The ``lowering`` check: a kernel the guard interprets is also lowered for its real target.

A kernel that runs interpreted on a CPU can still be refused by the target it was written for:
JAX's own Python lowering for TPU (Mosaic) and GPU (Triton, Mosaic GPU) refuses block shapes,
primitives and array sizes the interpreters accept. That lowering ships in jaxlib and runs on any
machine given a target platform and, for a GPU, an abstract device; the check runs it once per
kernel identity and shapes, on the kernel's ``pallas_call`` alone (as the user built it), for the
platform of the device setting or, without one, the kernel family's own (with a default device).
What only the hardware compiler sees (Mosaic's passes in libtpu, ptxas) stays out of reach.

A refusal is a finding. A failure that is not the kernel's (this jaxlib lacks the lowering, no GPU
device can be presented) is a note: the check could not run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from pallas_guard_autoload import DEVICES

from . import _device, _diagnostics, _internals

DEFAULT_DEVICES = {"mosaic_tpu": "tpu-v5e", "triton": "h100", "mosaic_gpu": "h100"}
"""The device a kernel family is lowered for when no device is set."""

_PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}
"""A device's platform (``DEVICES``) -> the platform JAX's lowering is asked for."""

_NOT_THE_KERNELS = (
    "No supported GPU devices found",  # no abstract device reached the GPU lowering
    "AbstractDevice",
    "jaxlib",  # "... install jaxlib with GPU support" and the like: this jaxlib lacks the lowering
    "libtpu",
    # A Mosaic-GPU kernel's lowering compiles for the backend of this process (the CPU) on the way:
    # JAX's own GPU lowering cannot run here, whatever the kernel.
    "is different from the lowering platform",
)
"""Words of lowering errors that say the check could not run, not that the kernel was refused."""


class Target(NamedTuple):
    platform: str
    """JAX's name for the platform lowered for (``tpu``, ``cuda``)."""
    device: str
    """The device short name whose abstract device is presented while lowering."""
    source: str
    """Where the device came from (the setting, or the family's default)."""

    def describe(self) -> str:
        return f"{self.platform} ({DEVICES[self.device][0]}, {self.source})"


class Outcome(NamedTuple):
    note: str
    """What the decision says: lowered for what, or why the check could not run."""
    refused: BaseException | None = None
    """JAX's lowering error where the target refused the kernel."""
    target: Target | None = None


def target_for(family: str | None, device: str | None) -> Target | str:
    """The target to lower for: the device setting's platform where a device is set, else the
    family's (Mosaic TPU: tpu; Triton, Mosaic GPU: cuda); a reason to skip where neither tells."""
    if device in DEVICES:
        return Target(_PLATFORMS[DEVICES[device][2]], device, "the device setting")
    if family in DEFAULT_DEVICES:
        default = DEFAULT_DEVICES[family]
        return Target(_PLATFORMS[DEVICES[default][2]], default, f"the default for {family} kernels")
    return "a generic kernel has no target of its own: set a device (PALLAS_GUARD_DEVICE) to lower it for one"


def _avals(tree: Any) -> Any:
    """Arrays and tracers as their shapes and dtypes: the kernel lowers without values."""
    import jax

    shaped: Any = jax.ShapeDtypeStruct

    def aval(leaf: Any) -> Any:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return shaped(leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False))
        return leaf

    return jax.tree_util.tree_map(aval, tree)


def lowering_api() -> str | None:
    """Why this jax cannot lower for a platform of choice, or None where it can
    (``jax.jit(f).trace(...).lower(lowering_platforms=...)``)."""
    import jax

    traced = getattr(getattr(jax, "stages", None), "Traced", None)
    lower = getattr(traced, "lower", None)
    try:
        takes = lower is not None and "lowering_platforms" in inspect.signature(lower).parameters
    except (TypeError, ValueError):
        takes = False
    return None if takes else f"jax {_internals.jax_version()} cannot lower a traced function for a chosen platform"


def check(build: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any], target: Target) -> Outcome:
    """Lower the kernel ``build`` returns, called with the shapes of ``args``/``kwargs``, for
    ``target``, with its abstract device presented."""
    import jax

    missing = lowering_api()
    if missing is not None:
        return Outcome(f"lowering: not checked: {missing}")
    avals, kwavals = _avals((args, kwargs))
    try:
        with _device.presented(target.device):
            jax.jit(build()).trace(*avals, **kwavals).lower(lowering_platforms=(target.platform,))
    except (MemoryError, RecursionError):
        raise
    except Exception as error:
        first = _diagnostics.first_line(error)
        if isinstance(error, ImportError) or any(words in first for words in _NOT_THE_KERNELS):
            return Outcome(f"lowering: not checked for {target.describe()}: {first}")
        return Outcome(f"lowering: refused by {target.describe()}", refused=error, target=target)
    return Outcome(f"lowering: lowers for {target.describe()}")
