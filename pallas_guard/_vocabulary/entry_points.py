"""The JAX entry points that build Pallas kernels, and the host functions that ask which accelerator
this is: one row each, read by every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

# Pallas's public faces, jax.pallas (0.12.1+) and jax.experimental.pallas: a user may import either
# alone, so each is a trigger (the autoload's table) and each binds the entry points under its names.
from pallas_guard_autoload import PALLAS_MODULES

MOSAIC_GPU_MODULES = ("jax.pallas.mosaic_gpu", "jax.experimental.pallas.mosaic_gpu")
TPU_MODULES = ("jax.pallas.tpu", "jax.experimental.pallas.tpu")


class EntryPoint(NamedTuple):
    label: str
    """How diagnostics and records name it."""
    modules: tuple[str, ...]
    """The public modules whose attribute is wrapped (the defining module is wrapped too)."""
    attribute: str
    body_parameter: str | None
    """The parameter holding the kernel body (first positional), or None (``core_map``)."""
    mesh_parameter: str | None
    """The parameter holding the mesh; ``"0"`` when it is the first positional argument."""
    lowers_through_mpmd: bool
    """Where ``jax._src.pallas.mpmd`` exists (jax >= 0.9.1), its kernels lower through ``mpmd_map_p``
    and the ``mpmd_map`` net catches them; otherwise the ``pallas_call`` net does."""
    runs_when_applied: bool = False
    """The decorator it returns runs the body when applied (``core_map``): applying it is the call."""

    def body(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The kernel body the caller passed, or None (a decorator form, or ``core_map``)."""
        if self.body_parameter is None:
            return None
        body = args[0] if args else kwargs.get(self.body_parameter)
        return body if callable(body) else None

    def mesh(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        if self.mesh_parameter == "0":
            return args[0] if args else kwargs.get("mesh")
        return kwargs.get(self.mesh_parameter) if self.mesh_parameter else None

    def returns_kernel(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Whether the call returns the kernel callable (not a decorator waiting for its body)."""
        return self.label == "pallas_call" or self.body(args, kwargs) is not None


PALLAS_CALL = EntryPoint("pallas_call", PALLAS_MODULES, "pallas_call", "kernel", None, False)
ENTRY_POINTS = (
    PALLAS_CALL,
    EntryPoint("pl.kernel", PALLAS_MODULES, "kernel", "body", "mesh", True),
    # A module __getattr__ serves it from jax 0.11.2 (deprecated); only a plain attribute is wrapped.
    EntryPoint("pl.core_map", PALLAS_MODULES, "core_map", None, "0", True, runs_when_applied=True),
    EntryPoint("plgpu.kernel", MOSAIC_GPU_MODULES, "kernel", "body", None, True),
)
BY_LABEL = {entry.label: entry for entry in ENTRY_POINTS}


class HostQuestion(NamedTuple):
    """A public host function that asks which TPU/GPU this is, and fails on the CPU: wrapped (as an
    entry point is, its defining module too) to add which device setting answers it."""

    label: str
    modules: tuple[str, ...]
    attribute: str
    holders: tuple[str, ...] = ()
    """JAX's own modules that may hold the same function (its callers look it up there), wrapped
    too where they do: found by the object, since a cached function (jax 0.12.1's ``get_tpu_info``,
    a ``StrongLRUCache``) names no defining module."""


# JAX's public GPU modules have no such function: its GPU kernels read the abstract device directly.
HOST_QUESTIONS = (
    HostQuestion(
        "pltpu.get_tpu_info", TPU_MODULES, "get_tpu_info", ("jax._src.tpu_info", "jax._src.pallas.mosaic.tpu_info")
    ),
    HostQuestion("pltpu.create_tensorcore_mesh", TPU_MODULES, "create_tensorcore_mesh"),
)
MODULES = tuple(
    dict.fromkeys(
        [*(m for entry in ENTRY_POINTS for m in entry.modules), *(m for q in HOST_QUESTIONS for m in q.modules)]
    )
)
