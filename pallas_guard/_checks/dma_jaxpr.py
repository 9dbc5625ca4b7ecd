"""What a kernel's jaxpr holds, read for the race check: its DMAs, the control flow the check
follows, the refs an equation accesses and through which views; and the one walk over a jaxpr's
equations that every evaluation of one (traced, step by step, on numbers) specialises."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import state as jax_state


def has_dmas(jaxpr: Any) -> bool:
    return any(eqn.primitive.name in ("dma_start", "dma_wait") for eqn in jax_state.jaxpr_equations(jaxpr))


CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call"})


_HANDLED = CALLS | {"cond", "while", "scan", "run_scoped"}


def unsupported(jaxpr: Any) -> str | None:
    """Why the check cannot follow this kernel's DMAs, or None."""
    for eqn in jax_state.jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "dma_start":
            operands = unflatten(eqn)
            if operands is None:
                return "its DMAs are laid out as this jax's check does not read them"
            if len(operands) > 4 and operands[4] is not None:
                return "it has a remote DMA (another device): TPU interpret mode simulates the devices"
        elif name not in _HANDLED and any(has_dmas(sub) for sub in sub_jaxprs(eqn)):
            return f"it has DMAs inside `{name}`, which the check does not follow"
    return None


def sub_jaxprs(eqn: Any) -> list[Any]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item)
    return found


def unflatten(eqn: Any, values: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
    """A DMA equation's (source, destination, destination semaphore, source semaphore, device id),
    each a transformed ref (or None), from its atoms or from ``values``."""
    import jax

    tree = eqn.params.get("tree")
    if tree is None:
        return None
    try:
        operands = jax.tree_util.tree_unflatten(tree, list(values if values is not None else eqn.invars))
    except Exception:
        return None
    if not isinstance(operands, tuple) or len(operands) < 3:
        return None
    if len(operands) == 9:  # jax < 0.10: (ref, its transforms) pairs, then the device id
        pairs = [(operands[i], operands[i + 1]) for i in (0, 2, 4, 6)]
        return (*(None if ref is None else Viewed(ref, tuple(t or ())) for ref, t in pairs), operands[8])
    # A whole ref is passed as itself, a view as a transformed ref (the ref and its transforms).
    return (*(Viewed.of(item) for item in operands[:4]), *operands[4:])


class Viewed:
    """A DMA operand: the ref and the transforms that view it (``view``: what the DMA moves)."""

    def __init__(self, ref: Any, transforms: tuple[Any, ...], view: Any = None) -> None:
        self.ref, self.transforms, self._view = ref, transforms, view

    @classmethod
    def of(cls, item: Any) -> Viewed | None:
        if item is None:
            return None
        if hasattr(item, "ref") and hasattr(item, "transforms"):
            return cls(item.ref, tuple(item.transforms), item)
        return cls(item, ())

    @functools.cached_property
    def view(self) -> Any:
        """Its shape and dtype (of a traced operand: a jaxpr variable's view is not computed)."""
        if self._view is not None:
            return self._view
        if not self.transforms:
            return aval(self.ref)
        transformed = getattr(jax_lookup.import_optional("jax._src.state.types"), "TransformedRef", None)
        return transformed(self.ref, self.transforms) if transformed is not None else aval(self.ref)


class OpenBody:
    """A run_scoped body seen as one jaxpr whose inputs are its constants, then its allocations."""

    def __init__(self, jaxpr: Any) -> None:
        self.invars = list(jaxpr.constvars) + list(jaxpr.invars)
        self.eqns, self.outvars = jaxpr.eqns, jaxpr.outvars


def is_literal(atom: Any) -> bool:
    return type(atom).__name__ == "Literal"


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """A ``scan``'s constants and carries: named counts, or (jax 0.12) the lengths of the first two
    groups of its operands' flat tree."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params["ft_in"]
    groups = groups.unpack() if callable(getattr(groups, "unpack", None)) else groups
    return len(groups[0]), len(groups[1])


def aval(value: Any) -> Any:
    import jax

    typeof = getattr(jax, "typeof", None) or getattr(jax.core, "get_aval", None)
    try:
        return typeof(value) if typeof is not None else getattr(value, "aval", None)
    except Exception:  # a jaxpr variable, not a value
        return getattr(value, "aval", None)


class Walk:
    """One walk over a jaxpr's equations, in order, each given its operands' values; an evaluation
    says how it holds constants and literals and what each equation gives (``each``)."""

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], keys: Sequence[Any]) -> list[Any]:
        """``jaxpr``'s outputs from ``args``; ``keys`` names what each argument is (None: nothing
        the evaluation follows), passed on to ``each``."""
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = list(getattr(jaxpr, "consts", consts))
        env: dict[Any, Any] = {}
        key_of: dict[Any, Any] = {}
        for var, value in zip(getattr(inner, "constvars", ()), consts, strict=False):
            env[var] = self.constant(value)
        for var, value, key in zip(inner.invars, args, keys, strict=True):
            env[var] = value
            if key is not None:
                key_of[var] = key

        def read(atom: Any) -> Any:
            return self.literal(atom) if is_literal(atom) else env[atom]

        for eqn in inner.eqns:
            outs = self.each(eqn, [read(a) for a in eqn.invars], key_of)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for var, value in zip(eqn.outvars, outs, strict=True):
                if type(var).__name__ != "DropVar":
                    env[var] = value
        return [read(a) for a in inner.outvars]

    def constant(self, value: Any) -> Any:
        """A jaxpr's constant as the evaluation holds it."""
        return value

    def literal(self, atom: Any) -> Any:
        """A literal operand as the evaluation holds it."""
        return atom.val

    def each(self, eqn: Any, values: list[Any], key_of: dict[Any, Any]) -> Any:
        """One equation's outputs (a list where it has several)."""
        raise NotImplementedError
