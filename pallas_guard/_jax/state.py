"""State: refs, the discharge of their accesses, and private copies of the jaxprs that hold them."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, NamedTuple

from pallas_guard._jax.lookup import first_attribute, import_optional


def is_state_ref(value: object) -> bool:
    """Whether ``value`` is a JAX state ref (a ``Ref``, or a tracer of one inside ``run_state``)."""
    aval = getattr(value, "aval", None)
    return type(aval).__name__ == "AbstractRef" and type(aval).__module__.startswith("jax._src.state")


_STATE_DISCHARGE = "jax._src.state.discharge"


class DischargeRegistry(NamedTuple):
    """One of JAX's tables of state discharge rules, and how many positional arguments come before
    a rule's operands: ``ctx`` (jax >= 0.11.2); ``in_avals, out_avals`` before; partial rules
    (before 0.11.2) take ``should_discharge`` first."""

    rules: MutableMapping[Any, Any]
    leading: int


def state_discharge_module() -> types.ModuleType | None:
    return import_optional(_STATE_DISCHARGE)


def forget_discharges() -> None:
    """Empty JAX's cache of state discharges (kept per jaxpr object)."""
    clear = getattr(getattr(state_discharge_module(), "_discharge_state", None), "cache_clear", None)
    if callable(clear):
        clear()


@functools.cache  # asked at each checked lowering; what this jax has does not change
def run_state_evaluation() -> tuple[Any, Callable[..., Any]] | None:
    """(``run_state_p``, a function that evaluates one with values, ``strip_memory_space`` first: its
    body discharged and run, as its lowering does); None where this jax has no such pair."""
    module: Any = state_discharge_module()
    primitive = getattr(module, "run_state_p", None)
    impl = getattr(module, "_run_state_impl", None)
    if primitive is None or not callable(impl):
        return None
    if "strip_memory_space" not in _parameters(getattr(module, "discharge_state", None)):
        return primitive, lambda strip, *args, **params: impl(*args, **params)
    core: Any = import_optional("jax._src.core")

    def evaluate(strip: bool, *args: Any, jaxpr: Any, which_linear: Any, is_initialized: Any) -> Any:
        # As ``_run_state_impl`` (every ref initialised), with the memory spaces of the rule's context.
        del which_linear, is_initialized
        discharged = module.discharge_state(jaxpr, strip_memory_space=strip)
        return core.eval_jaxpr(discharged, discharged.consts, *args)

    return primitive, evaluate


def _parameters(function: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return frozenset()


DISCHARGE_EVALUATOR = "_eval_jaxpr_discharge_state"
"""The function that discharges one jaxpr, calling each equation's discharge rule; a rule of a
loop, branch or scope discharges its body through it again (a module function looked up by name)."""


def discharge_registries() -> list[DischargeRegistry]:
    module = state_discharge_module()
    if module is None:
        return []
    found = []
    rules = getattr(module, "_discharge_rules", None)
    if isinstance(rules, MutableMapping):
        found.append(DischargeRegistry(rules, 1 if hasattr(module, "DischargeContext") else 2))
    partial_rules = getattr(module, "_partial_discharge_rules", None)
    if isinstance(partial_rules, MutableMapping):
        found.append(DischargeRegistry(partial_rules, 3))
    return found


class RefAccess(NamedTuple):
    """A primitive that reads or writes refs, as its discharge rule receives it."""

    primitive: Any
    kind: str
    """``read``, ``write`` or ``copy`` (a DMA: its source read, its destination written)."""
    tree_param: str
    """The parameter holding the operands' tree structure."""
    leading: int
    """Operands before the flattened tree (the ref; the ref and the value written)."""
    mask_at: int | None = None
    """Where the mask is in the unflattened operands (masked loads and stores), or None."""


_REF_ACCESSES = (
    # (module, primitive, kind, tree parameter, operands before the tree, mask position)
    ("jax._src.state.primitives", "get_p", "read", "tree", 1, None),
    ("jax._src.state.primitives", "swap_p", "write", "tree", 2, None),
    ("jax._src.state.primitives", "addupdate_p", "write", "tree", 2, None),
    ("jax._src.pallas.primitives", "load_p", "read", "args_tree", 0, 2),
    ("jax._src.pallas.primitives", "swap_p", "write", "args_tree", 0, 3),
    ("jax._src.pallas.primitives", "atomic_rmw_p", "write", "args_tree", 0, 3),
    ("jax._src.pallas.triton.primitives", "atomic_rmw_p", "write", "args_tree", 0, 3),
    ("jax._src.pallas.mosaic.primitives", "dma_start_p", "copy", "tree", 0, None),
)


def ref_accesses() -> list[RefAccess]:
    """The ref-access primitives of the modules already imported (a kernel using one has imported
    its module before it is lowered)."""
    found: dict[int, RefAccess] = {}
    for module_name, name, kind, tree_param, leading, mask_at in _REF_ACCESSES:
        primitive = getattr(sys.modules.get(module_name), name, None)
        if primitive is not None and id(primitive) not in found:
            found[id(primitive)] = RefAccess(primitive, kind, tree_param, leading, mask_at)
    return list(found.values())


def nd_indexer_class() -> type[Any] | None:
    cls = first_attribute([("jax._src.state.indexing", "NDIndexer")])
    return cls if isinstance(cls, type) else None


def slice_class() -> type[Any] | None:
    cls = first_attribute([("jax._src.state.indexing", "Slice")])
    return cls if isinstance(cls, type) else None


def jaxpr_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (a jaxpr or a closed one), and of the jaxprs in their params,
    recursively (a ``cond``'s branches, a loop's body)."""
    pending = [jaxpr]
    while pending:
        current = pending.pop()
        inner = getattr(current, "jaxpr", None)
        if inner is not None and inner is not current and hasattr(inner, "eqns"):
            current = inner
        for eqn in getattr(current, "eqns", ()):
            yield eqn
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                        pending.append(item)


def private_copy(jaxpr: Any) -> Any:
    """``jaxpr`` rebuilt from fresh objects down to every nested jaxpr (a ``jit`` helper's, a
    ``run_state`` body, loop and branch bodies), sharing equations' variables and values.

    JAX caches what it derives from a jaxpr (its state discharge, above all) by the jaxpr object,
    weakly: a transformation that changes a discharge rule must not read what an earlier lowering
    cached, nor leave its own result where a later lowering would read it. On a private copy both
    hold, and the cache entries die with the copy."""

    def copy(value: Any) -> Any:
        inner = getattr(value, "jaxpr", None)
        if inner is not None and inner is not value and hasattr(inner, "eqns"):  # a ClosedJaxpr (jax < 0.12)
            return value.replace(jaxpr=copy(inner))
        if hasattr(value, "eqns") and callable(getattr(value, "replace", None)):
            eqns = [e.replace(params={k: param(v) for k, v in e.params.items()}) for e in value.eqns]
            return value.replace(eqns=eqns)
        return value

    def param(value: Any) -> Any:
        if isinstance(value, tuple | list) and any(_jaxpr_like(item) for item in value):
            return type(value)(copy(item) if _jaxpr_like(item) else item for item in value)
        return copy(value) if _jaxpr_like(value) else value

    return copy(jaxpr)


def private_params(params: dict[str, Any]) -> dict[str, Any]:
    """A ``pallas_call`` equation's params with private copies (``private_copy``) of the kernel's
    jaxpr and of every block's index map: the interpreters discharge index maps too (a map that
    reads scalar-prefetch refs has state), cached by the index map's jaxpr object."""
    private = {**params, "jaxpr": private_copy(params["jaxpr"])}
    grid_mapping = params.get("grid_mapping")
    mappings = getattr(grid_mapping, "block_mappings", None)
    if mappings and dataclasses.is_dataclass(grid_mapping):
        copied = tuple(
            dataclasses.replace(m, index_map_jaxpr=private_copy(m.index_map_jaxpr))  # type: ignore[type-var]
            if dataclasses.is_dataclass(m) and hasattr(m, "index_map_jaxpr")
            else m
            for m in mappings
        )
        private["grid_mapping"] = dataclasses.replace(grid_mapping, block_mappings=copied)  # type: ignore[type-var]
    return private


def _jaxpr_like(value: Any) -> bool:
    return hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns")
