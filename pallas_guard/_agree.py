"""The ``agree`` check: one kernel run in every interpreter that can run it, outputs compared bit
for bit.

A lowering that succeeds says nothing about the values an interpreter computes, and JAX's
interpreters have bugs of their own (a grid run as program 0 only, writes to captured refs
dropped). Where two interpreters run the same kernel on the same inputs, their outputs must agree
bit for bit (the interpreters compute the same XLA operations on the CPU); the first that differs
is a finding. Which one is right: the one the table of what each interpreter gets wrong does not
name, else the majority.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class Disagreement(NamedTuple):
    """The first element where two interpreters' outputs differ."""

    first: str
    second: str
    output: int
    """Which output (its position among the kernel's flattened outputs)."""
    at: tuple[int, ...]
    first_value: Any
    second_value: Any
    right: str
    """The interpreter taken as right: the one the majority of those compared agrees with; without
    a majority, the plain interpreter (the kernel discharged to XLA operations, nothing simulated)
    where it ran, else the first."""
    majority: bool


def inputs_for(args: Any, kwargs: Any) -> tuple[Any, Any, bool]:
    """``(args, kwargs, synthetic)``: the call's own values where they are concrete; under an outer
    trace, values made from the traced shapes (floats from a fixed seed, integers zero, so that
    index operands stay in range)."""
    import jax
    import numpy as np

    synthetic = False
    rng = np.random.default_rng(0)

    def concrete(leaf: Any) -> Any:
        nonlocal synthetic
        if not isinstance(leaf, jax.core.Tracer):
            return leaf
        synthetic = True
        dtype = np.dtype(leaf.dtype)
        if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
            return rng.standard_normal(leaf.shape).astype(dtype)
        return np.zeros(leaf.shape, dtype)

    made_args, made_kwargs = jax.tree_util.tree_map(concrete, (args, kwargs))
    return made_args, made_kwargs, synthetic


def leaves(out: Any) -> list[Any]:
    import jax
    import numpy as np

    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(out)]


def compare(outputs: Mapping[str, Sequence[Any]], order: Sequence[str]) -> Disagreement | None:
    """The first disagreement of ``order[0]`` (the interpreter the guard runs) with another, or of
    any two others; None when all agree bit for bit (NaN payloads included)."""
    names = [name for name in order if name in outputs]
    if len(names) < 2:
        return None
    groups = Counter(_signature(outputs[name]) for name in names)
    majority, count = groups.most_common(1)[0]
    unique_majority = count > len(names) / 2
    for second in names[1:]:
        for first in names[: names.index(second)]:
            found = _first_difference(outputs[first], outputs[second])
            if found is not None:
                agreed = next((n for n in names if unique_majority and _signature(outputs[n]) == majority), None)
                right = agreed or ("plain" if "plain" in names else names[0])
                return Disagreement(first, second, *found, right=right, majority=agreed is not None)
    return None


def _signature(values: Sequence[Any]) -> tuple[tuple[str, tuple[int, ...], bytes], ...]:
    return tuple((str(v.dtype), tuple(v.shape), v.tobytes()) for v in values)


def _first_difference(first: Sequence[Any], second: Sequence[Any]) -> tuple[int, tuple[int, ...], Any, Any] | None:
    import numpy as np

    for position, (a, b) in enumerate(zip(first, second, strict=False)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return position, (), f"{a.dtype}{list(a.shape)}", f"{b.dtype}{list(b.shape)}"
        if a.tobytes() == b.tobytes():
            continue
        # Bit for bit: a view as unsigned integers of the same width compares payloads, NaN too.
        differs = np.argwhere(_bits(a) != _bits(b))
        index = tuple(int(i) for i in differs[0]) if len(differs) else ()
        return position, index, _scalar(a[index]), _scalar(b[index])
    return None


def _scalar(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def _bits(value: Any) -> Any:
    import numpy as np

    value = np.ascontiguousarray(value)
    width = value.dtype.itemsize
    return value.view(f"u{width}") if width in (1, 2, 4, 8) else value
