"""The plan, row by row (a pure function: no jax needed). README "How it decides" is this table."""

from __future__ import annotations

import pytest

from pallas_guard import Policy
from pallas_guard._deciding.interpreters import PLAIN_ONLY, Candidates
from pallas_guard._deciding.plan import Action, Situation, plan

TPU_FIRST = Candidates(("tpu",), "cross-device")
VERIFIED = Candidates(("plain", "tpu"), "a Mosaic-TPU kernel", verify=True)


class FakeInterpretParams:
    """Stands for pltpu.InterpretParams: a dataclass instance, truthy."""


def front(policy: Policy, platform: str | None, candidates: Candidates = PLAIN_ONLY, **kwargs: object) -> Situation:
    return Situation("front door", policy, platform, candidates=lambda: candidates, **kwargs)  # type: ignore[arg-type]


def net(policy: Policy, interpret: object = None, **kwargs: object) -> Situation:
    return Situation("lowering", policy, "cpu", interpret=interpret, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu", None])
@pytest.mark.parametrize("interpret", [True, FakeInterpretParams()])
def test_an_explicit_interpreter_is_untouched_everywhere(
    policy: Policy, platform: str | None, interpret: object
) -> None:
    at_front = plan(front(policy, platform, interpret=interpret))
    assert (at_front.action, at_front.record) == (Action.UNTOUCHED, False)
    assert "explicit" in at_front.reason
    at_net = plan(net(policy, interpret))
    assert (at_net.action, at_net.record) == (Action.UNTOUCHED, True)  # the net records what ran


def test_what_the_front_door_injected_is_not_recorded_twice() -> None:
    assert plan(net(Policy.WARN, FakeInterpretParams(), injected=True)).record is False


@pytest.mark.parametrize("policy", list(Policy))
def test_jax_force_interpret_mode_is_untouched(policy: Policy) -> None:
    assert plan(front(policy, "cpu", forced_by_jax=FakeInterpretParams())).action is Action.UNTOUCHED


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu", "gpu"])
def test_accelerator_target_is_untouched_and_the_kernel_never_inspected(policy: Policy, platform: str) -> None:
    def never() -> Candidates:
        raise AssertionError("kernel facts read for an accelerator target")

    result = plan(Situation("front door", policy, platform, candidates=never))
    assert (result.action, result.warn, result.record) == (Action.UNTOUCHED, False, False)


def test_policy_off_is_untouched_at_both_layers() -> None:
    assert plan(front(Policy.OFF, "cpu")).action is Action.UNTOUCHED
    assert plan(net(Policy.OFF)).action is Action.UNTOUCHED


def test_strict_refuses_where_the_kernel_lowers_for_the_cpu() -> None:
    result = plan(net(Policy.STRICT))
    assert (result.action, result.record, result.fallback) == (Action.REFUSE, True, None)


@pytest.mark.parametrize("candidates", [None, TPU_FIRST, VERIFIED])
def test_strict_at_the_call_defers_to_lowering_whatever_the_kernel_needs(candidates: Candidates | None) -> None:
    """A call traced for the CPU may still lower for an accelerator (a branch, an AOT lowering)."""
    result = plan(front(Policy.STRICT, "cpu", candidates or PLAIN_ONLY))
    assert (result.action, result.record) == (Action.DEFER, False)


@pytest.mark.parametrize(("policy", "warn"), [(Policy.INTERPRET, False), (Policy.WARN, True)])
def test_the_net_substitutes_the_plain_interpreter(policy: Policy, warn: bool) -> None:
    result = plan(net(policy))
    assert (result.action, result.warn, result.record) == (Action.INTERPRET, warn, True)


def test_plain_only_kernels_are_left_to_the_net() -> None:
    result = plan(front(Policy.WARN, "cpu"))
    assert (result.action, result.record) == (Action.DEFER, False)


@pytest.mark.parametrize("candidates", [TPU_FIRST, VERIFIED])
@pytest.mark.parametrize(("policy", "warn"), [(Policy.INTERPRET, False), (Policy.WARN, True)])
def test_other_interpreters_or_verification_happen_at_the_front_door(
    candidates: Candidates, policy: Policy, warn: bool
) -> None:
    result = plan(front(policy, "cpu", candidates))
    assert (result.action, result.warn, result.candidates) == (Action.INTERPRET, warn, candidates)


@pytest.mark.parametrize("candidates", [None, TPU_FIRST, VERIFIED])
@pytest.mark.parametrize("policy", [Policy.INTERPRET, Policy.WARN, Policy.STRICT])
def test_unknown_target_defers_to_lowering(policy: Policy, candidates: Candidates | None) -> None:
    result = plan(front(policy, None, candidates or PLAIN_ONLY))
    assert result.action is Action.DEFER


def test_without_a_net_an_unknown_target_and_no_plugin_fall_back_to_strict() -> None:
    result = plan(front(Policy.INTERPRET, None, net_gap="the CPU lowering net is not installed"))
    assert (result.action, result.record) == (Action.REFUSE, True)
    assert result.fallback is not None and "no accelerator plugin" in result.fallback
    # With a plugin installed the target may be an accelerator: JAX decides.
    assert plan(front(Policy.INTERPRET, None, net_gap="gap", accelerator_plugins=True)).action is Action.DEFER


def test_without_a_net_only_what_the_net_would_substitute_is_refused() -> None:
    assert plan(front(Policy.INTERPRET, "cpu", net_gap="gap")).action is Action.REFUSE
    assert plan(front(Policy.INTERPRET, "cpu", TPU_FIRST, net_gap="gap")).action is Action.INTERPRET


def test_an_eager_call_is_refused_at_the_call_under_strict() -> None:
    """An eager call lowers for its target at once: refused before JAX wraps the error."""
    assert plan(front(Policy.STRICT, "cpu", eager=True)).action is Action.REFUSE
    assert plan(front(Policy.STRICT, "cuda", eager=True)).action is Action.UNTOUCHED


def test_an_eager_plain_kernel_over_the_budget_is_refused_at_the_call() -> None:
    result = plan(front(Policy.INTERPRET, "cpu", grid=(16,), max_steps=4, eager=True))
    assert (result.action, result.over_budget, result.steps) == (Action.REFUSE, True, 16)
    # Traced: the net refuses where it lowers for the CPU (a branch for an accelerator is not).
    assert plan(front(Policy.INTERPRET, "cpu", grid=(16,), max_steps=4)).action is Action.DEFER
