"""The plan: what happens to one kernel, from its situation alone.

One pure function, used by both layers (the front door at trace time, the lowering net at
lowering) and table-tested row by row; the layers only gather the situation and carry the plan
out (``_act``). README "How it decides" is this table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from pallas_guard._deciding.interpreters import Candidates
from pallas_guard._vocabulary.enums import Policy

Layer = Literal["front door", "lowering"]


class Action(enum.StrEnum):
    UNTOUCHED = "untouched"
    """Do exactly what JAX would have done."""
    INTERPRET = "interpret"
    """Run the kernel with an interpreter (and warn, when ``Plan.warn``)."""
    REFUSE = "refuse"
    """Raise ``PallasGuardError``."""
    DEFER = "defer"
    """Front door only: pass the call through; the lowering net, which knows the target, decides."""


class Situation(NamedTuple):
    layer: Layer
    policy: Policy
    platform: str | None
    """Where the kernel will lower: configuration's answer at the front door (None: unknown), "cpu" at the net."""
    interpret: object = False
    """What the caller passed (absent counts as False)."""
    forced_by_jax: object = None
    """JAX's own ``force_*_interpret_mode`` value, which JAX applies itself when truthy."""
    injected: bool = False
    """Lowering: ``interpret`` is the value the front door chose (already recorded)."""
    eager: bool = False
    """Front door: the call runs now (no trace), so it lowers for the target right away."""
    net_gap: str | None = None
    """Front door: why the lowering net that would catch this kernel is not installed."""
    accelerator_plugins: bool = False
    """An accelerator plugin is installed (an unknown target may then be an accelerator)."""
    candidates: Callable[[], Candidates] | None = None
    """Front door: the kernel's interpreters, best first; read only when the kernel is interpreted."""
    grid: tuple[Any, ...] | None = None
    """The kernel's grid, where known (static entries count; a dynamic one makes it unknown)."""
    max_steps: int | None = None
    """The step budget for interpreted kernels, if any."""


class Plan(NamedTuple):
    action: Action
    reason: str
    warn: bool = False
    record: bool = False
    """Whether this layer records a ``Decision`` (the other layer records the rest)."""
    candidates: Candidates | None = None
    """``INTERPRET`` at the front door: the interpreters to use, best first."""
    fallback: str | None = None
    """``REFUSE`` because the lowering net is missing: why (the diagnostic says so)."""
    steps: int | None = None
    """``INTERPRET`` (or ``REFUSE`` over the budget): the grid steps the interpreter runs, where known."""
    over_budget: bool = False
    """``REFUSE`` because the grid has more steps than the budget."""


def plan(situation: Situation) -> Plan:  # noqa: PLR0911, PLR0912 - one return per row of the table
    s = situation
    at_net = s.layer == "lowering"
    if s.interpret:
        return Plan(Action.UNTOUCHED, f"explicit interpret={s.interpret!r}", record=at_net and not s.injected)
    if s.forced_by_jax:
        return Plan(Action.UNTOUCHED, f"JAX's force_*_interpret_mode is active ({s.forced_by_jax!r})", record=at_net)
    if s.policy is Policy.OFF:
        return Plan(Action.UNTOUCHED, "policy off: JAX's own CPU error applies", record=at_net)
    fallback = None
    if s.platform is None:
        if s.net_gap is None or s.accelerator_plugins:
            return Plan(Action.DEFER, "target unknown when the kernel is called; the lowering net decides")
        # Deferring to a net that is not there would be the guard silently doing nothing; with no
        # accelerator plugin installed JAX can only use the CPU.
        fallback = f"{s.net_gap}, and the target is not configured while no accelerator plugin is installed"
    elif s.platform != "cpu":
        return Plan(Action.UNTOUCHED, f"target {s.platform!r} is not the CPU")
    if fallback is not None:
        return Plan(Action.REFUSE, f"falls back to strict: {fallback}", record=True, fallback=fallback)
    if s.policy is Policy.STRICT:
        if not at_net and not s.eager:
            # Only lowering knows that this trace, or this branch of it, really targets the CPU; an
            # eager call lowers for its target now, and is refused before JAX wraps the error.
            return Plan(Action.DEFER, "policy strict: refused where the kernel lowers for the CPU")
        return Plan(Action.REFUSE, "policy strict: no interpreter without interpret=", record=True)
    reason = f"policy {s.policy.value}: target is the CPU"
    warn = s.policy is Policy.WARN
    steps = grid_steps(s.grid)
    over_budget = None
    if steps is not None and s.max_steps is not None and steps > s.max_steps:
        over_budget = Plan(
            Action.REFUSE,
            f"its grid has {steps} steps, over the step budget of {s.max_steps}",
            record=True,
            steps=steps,
            over_budget=True,
        )
    if at_net:
        return over_budget or Plan(Action.INTERPRET, reason, warn=warn, record=True, steps=steps)
    assert s.candidates is not None, "the front door passes the kernel's candidates"
    candidates = s.candidates()
    if not _needs_front_door(candidates):
        if s.net_gap is not None:
            return Plan(Action.REFUSE, f"falls back to strict: {s.net_gap}", record=True, fallback=s.net_gap)
        if not s.eager:
            return Plan(Action.DEFER, f"{reason}; the plain interpreter, substituted by the lowering net")
        # An eager call runs through the engine too: built marked with its checks, so that JAX's
        # executable for it is the guard's own (never reused under other settings).
    return over_budget or Plan(Action.INTERPRET, reason, warn=warn, record=True, candidates=candidates, steps=steps)


def _needs_front_door(candidates: Candidates) -> bool:
    """Whether the front door must act under any trace: another interpreter than plain, a choice
    to verify, a warning about the checks, what the answer is not (a TPU's random bits) for the
    decision to say, a missing interpreter to explain, or interpreters to compare (``agree``), or a
    lowering for the kernel's target to check (``lowering``)."""
    return (
        candidates.names != ("plain",)
        or candidates.verify
        or candidates.checks_note is not None
        or candidates.note is not None
        or candidates.lacking
        or candidates.at_front_door
    )


def grid_steps(grid: tuple[Any, ...] | None) -> int | None:
    """The number of steps a grid runs; None when unknown (no grid given, a dynamic entry)."""
    if grid is None:
        return None
    steps = 1
    for size in grid:
        if not isinstance(size, int):
            return None
        steps *= size
    return steps
