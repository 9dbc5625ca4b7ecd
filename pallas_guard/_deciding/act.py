"""Carrying a plan out, the same for both layers: warn, record, or refuse."""

from __future__ import annotations

from typing import Any

from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding.plan import Action, Layer, Plan
from pallas_guard._deciding.target import Target
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary.enums import Policy
from pallas_guard._vocabulary.settings import Setting
from pallas_guard_autoload import INTERPRETER_ENV


def carry_out(
    plan: Plan,
    *,
    layer: Layer,
    kernel: _diagnostics.KernelInfo,
    call_site: _diagnostics.CallSite,
    target: Target,
    policy: Setting[Policy],
    interpreter: str | None = None,
    tried: tuple[str, ...] = (),
    notes: tuple[str, ...] = (),
    memory: tuple[_record.MemoryUse, ...] = (),
    grid: tuple[Any, ...] | None = None,
    budget: Setting[int | None] | None = None,
) -> None:
    """Refuse (raise ``PallasGuardError``), or warn and record what ``plan`` does with ``kernel``.

    ``interpreter`` is the one running it (interpreted), or the one the caller chose (untouched);
    ``tried`` lists the interpreters verified before it, each with its outcome; ``notes`` what the
    checks asked for mean for this kernel (recorded, never warned: a check must not fail a test);
    ``memory`` what it takes of each TPU generation's memories, where the compile check compiled it.
    """
    __tracebackhide__ = True

    def record(action: str, warned: bool = False) -> None:
        if plan.record:
            why = [plan.reason]
            if plan.candidates is not None:
                why.append(plan.candidates.reason)
            if tried:
                why.append(f"tried {'; '.join(tried)}")
            reason = "; ".join(why)
            _record.note(
                kernel,
                called_at=call_site,
                platforms=(target.platform or "?",),
                policy=policy.value,
                action=action,
                interpreter=interpreter,
                reason=reason,
                layer=layer,
                warned=warned,
                tried=tried,
                steps=plan.steps,
                policy_source=policy.source,
                notes=notes,
                memory=memory,
                why=_diagnostics.reason_sentence(reason, layer),
            )

    if plan.action is Action.REFUSE and plan.over_budget:
        record("refused")
        assert grid is not None and plan.steps is not None and budget is not None
        raise _diagnostics.over_budget(
            kernel=kernel,
            call_site=call_site,
            grid=grid,
            steps=plan.steps,
            interpreter=interpreter or "plain",
            budget=budget,
        )
    if plan.action is Action.REFUSE:
        shown = policy
        if plan.fallback is not None:
            shown = Setting(
                Policy.STRICT,
                f"pallas_guard's fallback: {plan.fallback}, and policy {policy.value.value!r} (from "
                f"{policy.source}) needs it; pass interpret=True yourself, or use a jax version pallas_guard "
                f"supports (or force an interpreter with {INTERPRETER_ENV}=tpu|gpu)",
            )
        record("refused")
        raise _diagnostics.refusal(kernel=kernel, call_site=call_site, target=target, policy=shown)
    if plan.action is Action.INTERPRET:
        # Recorded first: a warning the filters turn into an error must still be counted.
        record("interpreted", plan.warn)
        if plan.warn:
            _diagnostics.warn(
                kernel=kernel, call_site=call_site, target=target, policy=policy, interpreter=interpreter or "plain"
            )
        return
    record("untouched")
