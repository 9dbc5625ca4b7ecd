"""MLIR lowering: the rule registries, a rule's context, lowering a traceable function as a rule."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, MutableMapping
from typing import Any

from pallas_guard._jax.lookup import first_attribute, import_optional


class LoweringRegistry:
    """``register_lowering`` and the registries it writes, as found in this jax."""

    def __init__(self, mlir: types.ModuleType) -> None:
        self.register_lowering: Callable[..., Any] = mlir.register_lowering
        self.common: MutableMapping[Any, Any] = mlir._lowerings  # noqa: SLF001
        self.cpu: MutableMapping[Any, Any] = mlir._platform_specific_lowerings["cpu"]  # noqa: SLF001

    def common_rule(self, primitive: Any) -> Callable[..., Any] | None:
        return unwrap_rule(self.common.get(primitive))


def lowering_registry() -> LoweringRegistry | None:
    for name in ("jax.interpreters.mlir", "jax._src.interpreters.mlir"):
        mlir = import_optional(name)
        if mlir is None:
            continue
        try:
            return LoweringRegistry(mlir)
        except (AttributeError, KeyError, TypeError):
            continue
    return None


def unwrap_rule(entry: Any) -> Callable[..., Any] | None:
    """The rule inside a registry entry: a ``LoweringRuleEntry`` from jax 0.7, a bare function before."""
    if entry is None:
        return None
    rule = getattr(entry, "rule", entry)
    return rule if callable(rule) else None


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """The platforms a lowering rule context lowers for (the CPU branch of an export: ``("cpu",)``)."""
    platforms = getattr(getattr(ctx, "module_context", None), "platforms", None)
    return tuple(platforms) if platforms else ("cpu",)


def lowering_tools() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    """``(make_jaxpr, jaxpr_as_fun, lower_fun)``: trace a function to a closed jaxpr, replay one,
    and lower a traceable function as a rule (``lower_fun(f, multiple_results=True)(ctx, *nodes)``)."""
    make = first_attribute([("jax", "make_jaxpr")])
    replay = first_attribute([("jax._src.core", "jaxpr_as_fun"), ("jax.core", "jaxpr_as_fun")])
    lower = first_attribute([("jax.interpreters.mlir", "lower_fun"), ("jax._src.interpreters.mlir", "lower_fun")])
    if make is None or replay is None or lower is None:
        return None
    return make, replay, lower


def lowers_for_cpu(primitive: Any, registry: LoweringRegistry) -> bool:
    """Whether JAX has a lowering rule for ``primitive`` on the CPU (its own or a common one)."""
    return primitive in registry.cpu or primitive in registry.common


def equation_context(eqn: Any) -> contextlib.AbstractContextManager[Any]:
    """The context an equation lowers in (compute type, metadata), as ``jaxpr_subcomp`` enters it."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def lowering_context_key(avals: Any, eqn_context: Any) -> tuple[Any, ...]:
    """What of an equation's lowering may shape a trace inside it: its argument avals and context."""
    return (tuple(avals), eqn_context)


def manual_axes(ctx: Any) -> bool:
    """Whether a rule context lowers inside a ``shard_map`` body (an SPMD axis context)."""
    axis_context = getattr(getattr(ctx, "module_context", None), "axis_context", None)
    return type(axis_context).__name__ not in ("ShardingContext", "ReplicaAxisContext")


def manual_mesh(ctx: Any) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The axis names and sizes of the ``shard_map`` mesh a rule context lowers in (its manual
    axes); None outside one, or where the context does not say."""
    axis_context = getattr(getattr(ctx, "module_context", None), "axis_context", None)
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    if not manual or mesh is None:
        return None
    try:
        shape = dict(mesh.shape)
    except (AttributeError, TypeError):
        return None
    names = tuple(name for name in shape if name in manual)
    return names, tuple(int(shape[name]) for name in names)
