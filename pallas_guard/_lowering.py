"""The lowering net: CPU-only lowering rules on ``pallas_call_p`` and ``mpmd_map_p``.

A rule registered with ``platform="cpu"`` is consulted only when JAX lowers for the CPU (also the
CPU branch of a multi-platform export); cuda/rocm/tpu keep JAX's own rule, untouched. Here the
target is certain, so this is where the plain interpreter is substituted. Only ``interpret=True``
may be substituted at lowering: the TPU and Mosaic-GPU interpreters add effects at trace time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _decide, _diagnostics, _internals, _record, _settings, _state, _target

LoweringRule = Callable[..., Any]


def _lowering_platforms(ctx: Any) -> tuple[str, ...]:
    platforms = getattr(getattr(ctx, "module_context", None), "platforms", None)
    return tuple(platforms) if platforms else ("cpu",)


def make_cpu_rule(entry_point: str, delegate: LoweringRule, installation: Any) -> LoweringRule:
    """A CPU rule that applies the decision table, then hands over to JAX's own rule."""

    def pallas_guard_cpu_rule(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
        interpret = params.get("interpret")
        if not installation.active:
            return delegate(ctx, *in_nodes, **params)
        policy = _settings.current_policy()
        verdict = _decide.decide(policy=policy.value, platform="cpu", interpret=interpret)
        if verdict.action is _decide.Action.UNTOUCHED and _state.is_injected(interpret):
            # The front door chose this interpreter and already recorded it.
            return delegate(ctx, *in_nodes, **params)
        kernel = _diagnostics.kernel_from_params(params, entry_point=entry_point)
        # An eager call can leave the equation without user frames; then the Python stack, which
        # lowers inside the user's call, names the line that ran it.
        call_site = _internals.lowering_call_site(ctx) or _diagnostics.user_call_site()
        module_platforms = _lowering_platforms(ctx)
        target = _target.lowering_target(module_platforms)

        def record(action: str, interpreter: str | None, warned: bool = False) -> None:
            _record.note(
                kernel,
                called_at=call_site,
                platforms=("cpu",),
                policy=policy.value,
                action=action,
                interpreter=interpreter,
                reason=verdict.reason,
                layer="lowering",
                warned=warned,
            )

        if verdict.action is _decide.Action.REFUSE:
            record("refused", None)
            raise _diagnostics.refusal(kernel=kernel, call_site=call_site, target=target, policy=policy)
        if verdict.action is _decide.Action.INTERPRET:
            warned = verdict.warn and _diagnostics.warn(
                kernel=kernel, call_site=call_site, target=target, policy=policy, interpreter="plain"
            )
            record("interpreted", "plain", warned)
            return delegate(ctx, *in_nodes, **{**params, "interpret": True})
        record("untouched", _state.interpreter_name(interpret))
        return delegate(ctx, *in_nodes, **params)

    pallas_guard_cpu_rule.__qualname__ = f"pallas_guard_cpu_rule[{entry_point}]"
    return pallas_guard_cpu_rule


class InstalledRule:
    """One CPU rule we registered, and what was in its slot before, to put back on uninstall."""

    def __init__(
        self, registry: _internals.LoweringRegistry, primitive: Any, previous: Any, rule: LoweringRule
    ) -> None:
        self.registry = registry
        self.primitive = primitive
        self.previous = previous
        self.rule = rule

    def remove(self) -> None:
        current = self.registry.cpu.get(self.primitive)
        if _internals.unwrap_rule(current) is not self.rule:
            return  # someone registered over us; theirs stays
        if self.previous is None:
            del self.registry.cpu[self.primitive]
        else:
            self.registry.cpu[self.primitive] = self.previous


def install_rule(
    registry: _internals.LoweringRegistry, primitive: Any, entry_point: str, installation: Any
) -> InstalledRule | None:
    previous = registry.cpu.get(primitive)
    # If JAX ever ships its own CPU rule, delegate to it rather than to the common rule.
    delegate = _internals.unwrap_rule(previous) or registry.common_rule(primitive)
    if delegate is None:
        _internals.note_missing(
            f"lowering rule of {primitive}", f"the CPU lowering net for {entry_point} is not installed"
        )
        return None
    rule = make_cpu_rule(entry_point, delegate, installation)
    registry.register_lowering(primitive, rule, platform="cpu")
    return InstalledRule(registry, primitive, previous, rule)
