"""The decision table, row by row (pure function: no jax needed)."""

from __future__ import annotations

import pytest

from pallas_guard import Policy
from pallas_guard._decide import Action, decide


class FakeInterpretParams:
    """Stands for pltpu.InterpretParams: a dataclass instance, truthy."""


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu", None])
@pytest.mark.parametrize("interpret", [True, FakeInterpretParams()])
def test_truthy_interpret_is_untouched_everywhere(policy: Policy, platform: str | None, interpret: object) -> None:
    """An explicit interpreter wins under every policy and target."""
    verdict = decide(policy=policy, platform=platform, interpret=interpret)
    assert verdict.action is Action.UNTOUCHED
    assert "explicit" in verdict.reason


@pytest.mark.parametrize("policy", list(Policy))
def test_jax_force_interpret_mode_is_untouched(policy: Policy) -> None:
    """JAX's own force_tpu_interpret_mode applies itself; the guard stays out of the way."""
    verdict = decide(policy=policy, platform="cpu", interpret=False, forced_by_jax=FakeInterpretParams())
    assert verdict.action is Action.UNTOUCHED


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu", "gpu"])
@pytest.mark.parametrize("interpret", [False, None, 0])
def test_accelerator_target_is_untouched(policy: Policy, platform: str, interpret: object) -> None:
    verdict = decide(policy=policy, platform=platform, interpret=interpret)
    assert verdict.action is Action.UNTOUCHED
    assert verdict.warn is False


@pytest.mark.parametrize("interpret", [False, None, 0])
def test_cpu_off_is_untouched(interpret: object) -> None:
    verdict = decide(policy=Policy.OFF, platform="cpu", interpret=interpret)
    assert verdict.action is Action.UNTOUCHED
    assert "off" in verdict.reason


def test_cpu_interpret_interprets_silently() -> None:
    verdict = decide(policy=Policy.INTERPRET, platform="cpu", interpret=False)
    assert (verdict.action, verdict.warn) == (Action.INTERPRET, False)


def test_cpu_warn_interprets_and_warns() -> None:
    verdict = decide(policy=Policy.WARN, platform="cpu", interpret=None)
    assert (verdict.action, verdict.warn) == (Action.INTERPRET, True)


def test_cpu_strict_refuses() -> None:
    verdict = decide(policy=Policy.STRICT, platform="cpu", interpret=0)
    assert verdict.action is Action.REFUSE


@pytest.mark.parametrize("policy", list(Policy))
def test_unknown_target_defers_to_lowering(policy: Policy) -> None:
    verdict = decide(policy=policy, platform=None, interpret=False)
    assert verdict.action is Action.DEFER
