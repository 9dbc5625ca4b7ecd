"""The lowering net: CPU-only lowering rules on ``pallas_call_p`` and ``mpmd_map_p``.

A rule registered with ``platform="cpu"`` is consulted only when JAX lowers for the CPU (also the
CPU branch of a multi-platform export); cuda/rocm/tpu keep JAX's own rule, untouched. Here the
target is certain, so this is where the plain interpreter is substituted. Only ``interpret=True``
may be substituted at lowering: the TPU and Mosaic-GPU interpreters add effects at trace time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pallas_guard._checks import checked_plain
from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import act as _act
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding import plan as _plan
from pallas_guard._deciding import target as _target
from pallas_guard._guard import engine as _engine
from pallas_guard._guard import unseen as _unseen
from pallas_guard._guard.ledger import Guarding, Ledger
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import source as jax_source
from pallas_guard._running import plain as _plain
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.enums import Policy
from pallas_guard._vocabulary.errors import PallasGuardError

LoweringRule = Callable[..., Any]


def make_cpu_rule(entry_point: str, delegate: LoweringRule, installation: Guarding) -> LoweringRule:  # noqa: PLR0915 - closures over one rule's state
    """A CPU rule that plans for the kernel, carries the plan out, then hands over to JAX's own rule."""

    def who(ctx: Any, params: dict[str, Any]) -> tuple[_diagnostics.KernelInfo, _diagnostics.CallSite]:
        """The kernel being lowered, and where the user called it."""
        # An eager call can leave the equation without user frames; then the Python stack, which
        # lowers inside the user's call, names the line that ran it.
        call_site = _diagnostics.call_site_of(jax_source.lowering_frames(ctx))
        if not call_site.is_users:
            on_stack = _diagnostics.user_call_site()
            if on_stack.is_users:  # the library frame the equation recorded stays beside it
                call_site = on_stack._replace(via=on_stack.via or call_site.via or call_site.user)
        return _kernel_of(params, entry_point, installation.ledger), call_site

    interpret_plain = _plain.interpreting(delegate)

    def pallas_guard_cpu_rule(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
        __tracebackhide__ = True
        if not installation.active:
            return delegate(ctx, *in_nodes, **params)
        interpret = params.get("interpret")
        ledger = installation.ledger
        if ledger.verifying():
            # The front door lowers a candidate on trial, or runs an eager plain call it records
            # itself: the plain interpreter, silently.
            if interpret:
                return delegate(ctx, *in_nodes, **params)
            return lower_plain(ctx, in_nodes, params, who=lambda: who(ctx, params))
        policy = _settings.current_policy()
        budget = _settings.max_steps()
        situation = _plan.Situation(
            "lowering",
            policy.value,
            "cpu",
            interpret=interpret,
            injected=ledger.is_injected(interpret),
            grid=jax_pallas.equation_grid(params),
            max_steps=budget.value,
        )
        plan = _plan.plan(situation)
        if plan.record or plan.action is not _plan.Action.UNTOUCHED:
            kernel, call_site = who(ctx, params)
            untouched = plan.action is _plan.Action.UNTOUCHED
            left = ledger.left_to_net(kernel) if plan.action is _plan.Action.INTERPRET else None
            tried, notes = (left.tried, left.notes) if left else ((), ())
            memory = left.memory if left else ()
            # A kernel the front door did not verify (built before install(), or passed on because
            # no backend told it the target was the CPU) gets its checks here, or says why not.
            if left is not None and ledger.called() is None and not ledger.handed_over(kernel):
                seen_notes, memory = _unseen.front_door_checks(
                    ctx,
                    params,
                    kernel=kernel,
                    call_site=call_site,
                    entry_point=entry_point,
                    hooks=installation.hooks,
                    passed_on=ledger.saw(kernel),
                )
                notes = (*notes, *seen_notes)
            wanted = plain_checks(params)
            unchecked = checked_plain.unchecked_reason(entry_point, params) if wanted else None
            if unchecked is not None and not untouched:
                notes = (*notes, _unchecked_note(kernel, call_site, ", ".join(sorted(wanted)), unchecked))
            _act.carry_out(
                plan,
                layer="lowering",
                kernel=kernel,
                call_site=call_site,
                target=_target.lowering_target(jax_lowering.lowering_platforms(ctx)),
                policy=policy,
                interpreter=jax_pallas.interpreter_of(interpret) if untouched else "plain",
                tried=tried,
                notes=notes,
                memory=memory,
                grid=situation.grid,
                budget=budget,
            )
        if plan.action is _plan.Action.INTERPRET:
            try:
                return lower_plain(ctx, in_nodes, params, who=lambda: who(ctx, params))
            except Exception as error:
                # Only the front door, at the call, can choose another interpreter: say which.
                family = jax_pallas.equation_family(params)
                _diagnostics.add_note(error, _diagnostics.plain_failed_at_lowering(who(ctx, params)[0], family=family))
                raise
        if interpret is True and policy.value is not Policy.OFF:
            # The user's own plain interpreter: checked like the guard's (the check changes no value).
            return lower_plain(ctx, in_nodes, params, who=lambda: who(ctx, params))
        return delegate(ctx, *in_nodes, **params)

    def lower_plain(ctx: Any, in_nodes: tuple[Any, ...], params: dict[str, Any], *, who: Callable[[], Any]) -> Any:
        """The plain interpreter, linear in the data, with the checks made inside it where they are in
        force (bounds, races)."""
        plain = {**params, "interpret": True}
        checks = plain_checks(params)
        if not checks or checked_plain.unchecked_reason(entry_point, params) is not None:
            return interpret_plain(ctx, *in_nodes, **plain)  # the record of an unchecked kernel says why
        kernel, call_site = who()
        try:
            with _plain.linear(plain):
                lowered = checked_plain.lower(
                    ctx, in_nodes, plain, kernel=kernel, call_site=call_site, hooks=installation.hooks, checks=checks
                )
        except PallasGuardError:
            raise  # a check that could not run, under require_checks
        except Exception as error:
            # The kernel's own failure fails again below, unchecked, as JAX raises it. Anything else
            # is the check's: the kernel runs unchecked, and its decision says so.
            lowered = interpret_plain(ctx, *in_nodes, **plain)
            _unchecked(kernel, call_site, ", ".join(sorted(checks)), _diagnostics.first_line(error))
        return lowered if lowered is not None else interpret_plain(ctx, *in_nodes, **plain)

    pallas_guard_cpu_rule.__qualname__ = f"pallas_guard_cpu_rule[{entry_point}]"
    return pallas_guard_cpu_rule


def _unchecked_note(kernel: _diagnostics.KernelInfo, call_site: _diagnostics.CallSite, checks: str, why: str) -> str:
    """The note of a kernel the plain checks could not be applied to (or, under require_checks, the raise)."""
    note = f"runs unchecked: {checks} could not be checked: {why}"
    return _checks.unchecked(checks, why, kernel=kernel, call_site=call_site, note=note)


def _unchecked(kernel: _diagnostics.KernelInfo, call_site: _diagnostics.CallSite, checks: str, why: str) -> None:
    _record.annotate(kernel, call_site, _unchecked_note(kernel, call_site, checks, why))


def plain_checks(params: dict[str, Any]) -> frozenset[str]:
    """The checks made inside the plain interpretation in force here, or marked by the front door
    where the kernel was called."""
    asked = frozenset(_settings.current("checks").value) | checked_plain.marked_checks(params)
    return checked_plain.plain(asked)


class InstalledRule:
    """One CPU rule we registered, and what was in its slot before, to put back on uninstall."""

    def __init__(
        self, registry: jax_lowering.LoweringRegistry, primitive: Any, previous: Any, rule: LoweringRule
    ) -> None:
        self.registry = registry
        self.primitive = primitive
        self.previous = previous
        self.rule = rule

    def remove(self) -> None:
        current = self.registry.cpu.get(self.primitive)
        if jax_lowering.unwrap_rule(current) is not self.rule:
            return  # someone registered over us; theirs stays
        if self.previous is None:
            del self.registry.cpu[self.primitive]
        else:
            self.registry.cpu[self.primitive] = self.previous


def _kernel_of(params: dict[str, Any], entry_point: str, ledger: Ledger) -> _diagnostics.KernelInfo:
    """The kernel being lowered, named as the front door knew it where it can tell."""
    kernel = ledger.called()
    if kernel is None:
        kernel = _diagnostics.kernel_from_params(params, entry_point=entry_point)
        defined_in = (kernel.defined_at or "").rpartition(":")[0]
        if not defined_in or _diagnostics.frame_kind(defined_in) == "internal":
            # The equation shows JAX's wrapper around the body (plgpu.kernel under jit, which lowers
            # after the front door's call returned): the front door knew the body.
            kernel = ledger.passed(kernel.name) or kernel
    return kernel


def install_rule(
    registry: jax_lowering.LoweringRegistry, primitive: Any, entry_point: str, installation: Guarding
) -> InstalledRule | None:
    previous = registry.cpu.get(primitive)
    # If JAX ever ships its own CPU rule, delegate to it rather than to the common rule.
    delegate = jax_lowering.unwrap_rule(previous) or registry.common_rule(primitive)
    if delegate is None:
        jax_lookup.note_missing(
            f"lowering rule of {primitive}", f"the CPU lowering net for {entry_point} is not installed"
        )
        return None
    if primitive is jax_pallas.pallas_call_primitive():
        _plain.hook(installation.hooks)
        # A plain interpreter traced on trial is replayed when the outer trace lowers the same kernel.
        delegate = _engine.PLAIN_TRACES.reusing(delegate)
    rule = make_cpu_rule(entry_point, delegate, installation)
    registry.register_lowering(primitive, rule, platform="cpu")
    return InstalledRule(registry, primitive, previous, rule)


def install_unarmed_rule(
    registry: jax_lowering.LoweringRegistry, primitive: Any, installation: Guarding
) -> InstalledRule | None:
    """Where the guard could not arm: a CPU rule that hands every kernel to JAX's own rule, and turns
    JAX's refusal of a kernel without ``interpret=`` into the guard's reason (a ``PallasGuardError``,
    a ``ValueError`` as JAX's is), unless the policy in force is ``off``."""
    previous = registry.cpu.get(primitive)
    delegate = jax_lowering.unwrap_rule(previous) or registry.common_rule(primitive)
    if delegate is None:
        return None
    explanation = installation.failure_message()  # the failure that left this rule in place

    def pallas_guard_unarmed_cpu_rule(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
        __tracebackhide__ = True
        try:
            return delegate(ctx, *in_nodes, **params)
        except ValueError as error:
            if params.get("interpret") or _settings.current_policy().value is Policy.OFF:
                raise
            raise PallasGuardError(explanation) from error

    registry.register_lowering(primitive, pallas_guard_unarmed_cpu_rule, platform="cpu")
    return InstalledRule(registry, primitive, previous, pallas_guard_unarmed_cpu_rule)
