"""The checked plain interpretation: the plain interpreter lowered with the checks made inside it.

Bounds and races are checked inside JAX's plain interpreter, at its speed: each check in force
whose ``in_plain`` is set prepares the kernel's lowering (``Check.arm_plain``: wraps JAX's discharge
rules, traces the kernel again with its DMA table) and the interpreter is traced with the checks
in it. A check is a ``lax.cond`` on its condition (``check_vector``: its values one int32 vector,
its message's fields) whose failing branch alone calls back to the host: the first check that fails
as the kernel runs hands its values to the check whose finding it is (``Check.plain_finding``),
which is raised as ``PallasGuardError`` and stops the computation. No ``checkify``: its pass over
the interpreter's grid loop (every branch transformed twice) cost more than the kernel's lowering.
This module names no check: the lowering net, the front door and the engine reach the checks
through it and the protocol, and the checks share its index arithmetic.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import linecache
import os
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding.diagnostics import CallSite, KernelInfo
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import source as jax_source
from pallas_guard._jax import state as jax_state
from pallas_guard._running import findings as _findings
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.errors import PallasGuardError

_MARK_KEY = "pallas_guard"


def mark(checks: frozenset[str], *, fast_plain: bool) -> dict[str, str]:
    """The ``metadata`` of a kernel the guard runs eagerly in the plain interpreter, with the checks
    and the ``fast_plain`` setting in force. JAX keeps one executable per equation (params included)
    and reuses it for any later eager call of the same equation: marked, the guard's executables are
    never reused for a call under other settings, under policy ``off`` or after ``uninstall()`` (the
    plain interpreter ignores metadata)."""
    how = "interpreted" if fast_plain else "interpreted-as-jax-ships"
    return {_MARK_KEY: "+".join((how, *sorted(checks)))}


def marked_checks(params: dict[str, Any]) -> frozenset[str]:
    """The checks a kernel was marked with (none for an unmarked one)."""
    value = (params.get("metadata") or {}).get(_MARK_KEY)
    return frozenset(value.split("+")[1:]) if isinstance(value, str) else frozenset()


def plain(names: Iterable[str]) -> frozenset[str]:
    """The checks among ``names`` made inside the plain interpretation."""
    return frozenset(check.name for check in _checks.in_force(names) if check.in_plain)


@dataclasses.dataclass
class PlainLowering:
    """One ``pallas_call`` equation being lowered in the checked plain interpretation: what the
    checks in it read, and what they may change."""

    params: dict[str, Any]
    """The equation's params with private copies of its jaxprs (``jax_state.private_params``): the
    checks go in through discharge rules, whose results JAX caches per jaxpr object, so a private
    copy neither reads an unchecked discharge cached before nor leaves a checked one. A check may
    replace them (races traces the kernel again with its DMA table)."""
    given: dict[str, Any]
    """The params as the equation holds them."""
    kernel: KernelInfo
    call_site: CallSite
    hooks: list[Any]
    """The installation's: a check that wraps a JAX function adds what puts it back."""
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What a check keeps between preparing the lowering and reading a failure, by check name."""


Active = Callable[[], contextlib.AbstractContextManager[Any]]
"""What a check enters around the checked trace of the interpreter (its state, visible to the
discharge rules it wrapped)."""


def lower(
    ctx: Any,
    in_nodes: Sequence[Any],
    params: dict[str, Any],
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    hooks: list[Any],
    checks: frozenset[str] = frozenset({"bounds"}),
) -> Any:
    """Lower one ``pallas_call`` equation in the plain interpreter with the ``checks`` asked for
    that are made inside it; None where this jax lacks a piece or no check has anything to check in
    this kernel (the caller lowers it unchecked). A check that cannot follow the kernel says why in
    its decision and leaves it to the others."""
    tools = jax_lowering.lowering_tools()
    if tools is None or unchecked_reason("pallas_call", params) is not None:
        return None
    lowering = PlainLowering(jax_state.private_params(params), params, kernel, call_site, hooks)
    armed: list[tuple[_checks.Check, Active]] = []
    checking = tuple(check for check in _checks.in_force(checks) if check.in_plain)
    failed = functools.partial(_raise_finding, lowering=lowering, checks=checking, source=_settings.stated("checks"))
    with _failing_to(failed):  # a check that traces the kernel again (races) checks in that trace
        for check in checking:
            active = check.arm_plain(lowering)
            if active is not None:
                armed.append((check, active))
    if not armed:
        return None
    interpret = jax_pallas.plain_interpreter(lowering.params)
    if interpret is None:
        return None
    lower_fun = tools[2]

    def checked(*args: Any) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_failing_to(failed))
            for _, active in armed:
                stack.enter_context(active())
            try:
                return interpret(*args)
            except Exception:
                # A discharge cut short can leave a checked entry in JAX's discharge cache under a
                # jaxpr the kernel shares, where the unchecked lowering that follows would read it.
                jax_state.forget_discharges()
                raise

    return lower_fun(checked, multiple_results=True)(ctx, *in_nodes)


class TableEntry:
    """One entry of a JAX table (a discharge rule) replaced by a check's wrapper, and the exact
    object to put back."""

    def __init__(self, table: Any, key: Any, original: Any, wrapper: Any) -> None:
        self.table, self.key, self.original, self.wrapper = table, key, original, wrapper

    def restore(self) -> None:
        if self.table.get(self.key) is self.wrapper:  # leave what someone registered over it
            self.table[self.key] = self.original


def unchecked_reason(entry_point: str, params: dict[str, Any]) -> str | None:
    """Why a kernel the plain interpreter runs cannot get the bounds check, or None."""
    if entry_point != "pallas_call":
        return f"{entry_point} lowers through its own rule, which the check does not reach"
    if getattr(params.get("jaxpr"), "constvars", None):
        return "the kernel captures constants"  # JAX's own rule refuses it
    if jax_pallas.plain_interpreter(params) is None:
        return "this jax's plain interpreter is not where the guard looks for it"
    return None


def _raise_finding(
    message: str, values: Any, *, lowering: PlainLowering, checks: tuple[_checks.Check, ...], source: str
) -> None:
    message = message.format(values)
    check = next((c for c in checks if c.plain_finding(message, lowering, source, lowering.call_site)), checks[0])

    def build(call_site: CallSite) -> PallasGuardError:
        found = check.plain_finding(message, lowering, source, call_site)
        if found is None:  # no check knows the message as its own: still a finding, never dropped
            found = PallasGuardError(
                f"pallas_guard: the {check.name} check found, in Pallas kernel {lowering.kernel.name}: {message}"
            )
        return found

    def report(found: PallasGuardError, call_site: CallSite) -> PallasGuardError:
        return _checks.found(check.name, found, kernel=lowering.kernel, call_site=call_site, interpreter="plain")

    # Written for the call that faulted, found when the computation returns to the caller.
    _findings.record(_findings.AtTheCall(build, report, lowering.call_site))


# --- what the checks made inside it share: where an access is, its index arithmetic ---------------


def indexed(operands: Sequence[Any]) -> Iterator[tuple[int, Any, tuple[Any, ...]]]:
    """(role, ref, its transforms) for each indexed ref among an access's operands: a ``(ref,
    transforms)`` pair of neighbours (older jax), or a transformed-ref object. ``role`` counts the
    ref operands, indexed or whole (a DMA's source is 0, its destination 1)."""
    indexer = jax_state.nd_indexer_class()
    pairs = len(operands) > 1 and isinstance(operands[1], tuple | list)
    for position, item in enumerate(operands):
        transforms = getattr(item, "transforms", None)
        if transforms is not None and hasattr(item, "ref"):
            yield position, item.ref, tuple(transforms)
        elif position and isinstance(item, tuple | list) and any(isinstance(t, indexer or ()) for t in item):
            yield (position - 1) // 2 if pairs else position - 1, operands[position - 1], tuple(item)


NO_SITE = "in the kernel body"


def site_text(eqn: Any = None) -> str:
    """``file:line (`code`)`` of the kernel line that made an access (the one being discharged, or
    equation ``eqn``'s), else ``NO_SITE``."""
    found = jax_source.access_site(eqn)
    if found is None:
        return NO_SITE
    filename, line, _ = found
    code = linecache.getline(filename, line).strip()
    shown = f"{os.path.basename(filename)}:{line}"
    return f"{shown} (`{code}`)" if code else shown


# A base dimension: (offset, stride, size) where a range of it is accessed (size None: an integer
# index, the dimension dropped).
Range = tuple[Any, int, int | None]


def compose(indexers: Sequence[Any]) -> list[Range] | None:
    """The element ranges of the buffer a chain of slice/integer indexers accesses, per buffer
    dimension; None where an indexer has index arrays or a dynamic size."""
    slice_class = jax_state.slice_class()
    ranges: list[Range] = [(0, 1, n) for n in indexers[0].shape]
    for indexer in indexers:
        view = [d for d, (_, _, size) in enumerate(ranges) if size is not None]
        if len(view) != len(indexer.indices):
            return None
        for dim, index in zip(view, indexer.indices, strict=True):
            offset, stride, _ = ranges[dim]
            if slice_class is not None and isinstance(index, slice_class):
                size, step = index.size, getattr(index, "stride", 1)
                if not isinstance(size, int) or not isinstance(step, int):
                    return None
                ranges[dim] = (plus(offset, times(as_index(index.start), stride)), stride * step, size)
            elif getattr(index, "shape", ()) == ():
                ranges[dim] = (plus(offset, times(as_index(index), stride)), stride, None)
            else:
                return None
    return ranges


# Index arithmetic, in lax (a jnp operator on a tracer is a jitted call of its own, which a kernel
# with many accesses pays for hundreds of times at its first lowering). An index known while
# tracing stays a Python int, and a condition it decides a Python bool: an access proven inside its
# buffer gets no check at all.
Index = Any  # int, or an int32 scalar being traced


Condition = Any  # bool, or a bool scalar being traced


def as_index(value: Any) -> Index:
    import numpy as np
    from jax import lax

    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value)
    return lax.convert_element_type(value, np.int32)


def traced(value: Index) -> Any:
    import numpy as np

    return np.int32(value) if isinstance(value, int) else value


def plus(a: Index, b: Index) -> Index:
    from jax import lax

    return a + b if isinstance(a, int) and isinstance(b, int) else lax.add(traced(a), traced(b))


def times(a: Index, b: int) -> Index:
    from jax import lax

    return a * b if isinstance(a, int) else (a if b == 1 else lax.mul(a, traced(b)))


def _unreported(message: str, values: Any) -> None:
    raise RuntimeError(f"pallas_guard: a check outside a checked lowering failed: {message.format(values)}")


_failing: contextvars.ContextVar[Callable[[str, Any], None]] = contextvars.ContextVar(
    "pallas_guard_failing", default=_unreported
)
"""Where a failed check of the kernel being lowered goes: its lowering's finding, raised from the
host (a kernel instrumented on its own, outside a lowering, has none)."""


@contextlib.contextmanager
def _failing_to(raise_finding: Callable[[str, Any], None]) -> Iterator[None]:
    token = _failing.set(raise_finding)
    try:
        yield
    finally:
        _failing.reset(token)


def check_vector(ok: Any, message: str, vector: Any) -> None:
    """One check whose values are one int32 vector (``message``'s fields its elements). Only a
    failed check calls back to the host, which records the finding and stops the computation there:
    the first check that fails is the finding. Unordered: no effect token, which the interpreter's
    grid loop and a lowering rule have no place for."""
    import numpy as np
    from jax import lax
    from jax.experimental import io_callback

    failed = functools.partial(_failing.get(), fields_of_one_vector(message))
    lax.cond(
        lax.convert_element_type(ok, np.bool_),  # a bool scalar, also where it is known (False)
        lambda values: None,
        lambda values: io_callback(failed, None, values, ordered=False),
        vector,
    )


def fields_of_one_vector(message: str) -> str:
    """``message`` with its ``{}`` fields numbered as elements of one argument: ``{0[0]}``, ..."""
    parts, position = [], 0
    for literal, field, _, _ in string.Formatter().parse(message):
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is not None:
            parts.append(f"{{0[{position}]}}")
            position += 1
    return "".join(parts)
