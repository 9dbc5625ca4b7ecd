"""The front door's checks for a kernel that reached the lowering net without passing it.

A kernel built before ``install()`` (or by a library holding JAX's own ``pallas_call``) is JAX's
callable: its calls never reach the front door, where ``compile``, ``lowering`` and ``agree`` run.
The net still lowers it, with its equation in hand, and what the first two need is there: the
kernel's ``pallas_call`` (its parameters, rebound without ``interpret``) and its operands' shapes.
They run here through the checks' own ``before``, as the engine calls it. ``agree`` needs the
operands' values in two interpreters, which lowering never has: its decision says it could not run
(a ``PallasGuardError`` under ``require_checks``), never nothing.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.record import MemoryUse

FROM_THE_EQUATION = frozenset({"compile", "lowering"})
"""The front-door checks that need only the kernel's equation and its operands' shapes."""

BUILT_BEFORE = (
    "its kernel never passed the guard's front door (built before pallas_guard was installed, or by "
    "JAX's own pallas_call held from then), and {check} needs the operands' values at the call; "
    "build the kernel after install(), or install with PALLAS_GUARD_POLICY and the autoload"
)
PASSED_ON = (
    "the front door passed its kernel on for an accelerator (no backend was initialised yet to say the "
    "target is the CPU), and {check} needs the operands' values at the call; set JAX_PLATFORMS=cpu, or "
    "initialise the backends (jax.devices()) before the first kernel"
)


class _Entry(NamedTuple):
    label: str
    runs_when_applied: bool = False


class _Facts(NamedTuple):
    family: str | None


class EquationKernel:
    """A kernel as its ``pallas_call`` equation shows it: what the checks ask of a ``Kernel``."""

    def __init__(self, info: _diagnostics.KernelInfo, params: dict[str, Any], entry_point: str) -> None:
        self.info, self.params = info, params
        self.entry = _Entry(entry_point)
        self.facts = _Facts(jax_pallas.equation_family(params))

    @functools.cached_property
    def kwargs(self) -> dict[str, Any]:
        """Its operands' blocks, where a check reads their memory spaces."""
        mappings = getattr(self.params.get("grid_mapping"), "block_mappings", ()) or ()
        blocks = [getattr(m, "block_aval", None) or getattr(m, "transformed_block_aval", None) for m in mappings]
        return {"in_specs": [block for block in blocks if block is not None]}

    def build(self) -> Any:
        """The kernel as the user built it: its equation bound again, without ``interpret``."""
        primitive: Any = jax_pallas.pallas_call_primitive()
        params = {**self.params, "interpret": False}

        def kernel(*operands: Any) -> Any:
            return primitive.bind(*operands, **params)

        return kernel


class EquationRun(NamedTuple):
    """What a check's ``before`` asks of the call: the kernel, where it was called, the hooks, the
    ``shard_map`` mesh it lowers in."""

    kernel: EquationKernel
    call_site: _diagnostics.CallSite
    hooks: list[Any]
    mesh: tuple[tuple[str, ...], tuple[int, ...]] | None

    def called_in(self) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        return self.mesh


def front_door_checks(
    ctx: Any,
    params: dict[str, Any],
    *,
    kernel: _diagnostics.KernelInfo,
    call_site: _diagnostics.CallSite,
    entry_point: str,
    hooks: list[Any],
    passed_on: bool = False,
) -> tuple[tuple[str, ...], tuple[MemoryUse, ...]]:
    """The notes and figures of the front-door checks in force, made from the equation (a finding
    is raised); a check that cannot be made here says why."""
    __tracebackhide__ = True
    asked = [check for check in _checks.in_force(_settings.current("checks").value) if check.at_front_door]
    notes: list[str] = []
    memory: list[MemoryUse] = []
    from_params = entry_point == "pallas_call" and jax_pallas.pallas_call_primitive() is not None
    run = EquationRun(
        EquationKernel(kernel, params, entry_point),
        call_site,
        hooks,
        jax_lowering.manual_mesh(ctx) or jax_tracing.manual_mesh(),
    )
    avals = tuple(getattr(ctx, "avals_in", ()))
    for check in asked:
        if check.name not in FROM_THE_EQUATION or not from_params:
            why = (PASSED_ON if passed_on else BUILT_BEFORE).format(check=check.name)
            notes.append(_checks.unchecked(check.name, why, kernel=kernel, call_site=call_site))
            continue
        prepared = check.before(run, avals, {})  # type: ignore[arg-type]
        if prepared is not None and prepared.pending is not None:  # nothing runs beside it here
            prepared = prepared.pending()
        if prepared is not None:
            notes += [prepared.note] if prepared.note else []
            memory += prepared.memory
    return tuple(notes), tuple(memory)
