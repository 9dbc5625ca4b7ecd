"""Settings: parsing, sources, process policy and contextvar scopes."""

from __future__ import annotations

import asyncio
import threading

import pytest

import pallas_guard
from pallas_guard import Interpreter, PallasGuardConfigError, Policy
from pallas_guard._policy import POLICY_ENV, current_policy, parse_policy, policy_from_env

BAD_VALUES = [
    "bogus",
    "interpreted",
    "warning",
    "STRICTLY",
    "of",
    "none",
    "true",
    "1",
    "auto",
    "interpret,warn",
    "inter pret",
    "'warn'",
    "warn!",
    "warn\tstrict",
    "stríct",
]


@pytest.mark.parametrize("raw", ["interpret", "WARN", "  Strict  ", "oFf\n", "\tinterpret"])
def test_env_policy_is_case_and_whitespace_insensitive(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, raw)
    assert policy_from_env() is Policy(raw.strip().lower())


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_env_policy_unset_or_empty_means_warn(raw: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if raw is None:
        monkeypatch.delenv(POLICY_ENV, raising=False)
    else:
        monkeypatch.setenv(POLICY_ENV, raw)
    pallas_guard.install()
    assert pallas_guard.get_policy() is Policy.WARN


@pytest.mark.parametrize("raw", BAD_VALUES)
def test_bad_env_policy_names_variable_value_and_accepted(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, raw)
    with pytest.raises(PallasGuardConfigError) as info:
        pallas_guard.install()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert POLICY_ENV in message
    assert repr(raw) in message
    for accepted in ("'interpret'", "'warn'", "'strict'", "'off'"):
        assert accepted in message


@pytest.mark.parametrize("bad", [1, 2.5, b"warn", ["warn"], object()])
def test_api_wrong_type_is_type_error_naming_argument(bad: object) -> None:
    with pytest.raises(TypeError, match=r"set_policy\(policy\) must be a str or pallas_guard.Policy"):
        pallas_guard.set_policy(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"install\(policy=\.\.\.\)"):
        pallas_guard.install(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"install\(interpreter=\.\.\.\)"):
        pallas_guard.install("warn", interpreter=bad)  # type: ignore[arg-type]


def test_set_policy_none_is_type_error() -> None:
    """None means "from the environment" only for install(); set_policy needs a value."""
    with pytest.raises(TypeError, match="got NoneType None"):
        pallas_guard.set_policy(None)  # type: ignore[arg-type]


def test_interpreter_member_is_not_a_policy() -> None:
    with pytest.raises(PallasGuardConfigError, match="not a valid pallas_guard policy"):
        pallas_guard.set_policy(Interpreter.AUTO)


def test_api_bad_value_is_config_error_naming_argument() -> None:
    with (
        pytest.raises(PallasGuardConfigError, match=r"policy\(policy\)='loud'.*'interpret', 'warn', 'strict', 'off'"),
        pallas_guard.policy("loud"),
    ):
        pass
    with pytest.raises(PallasGuardConfigError, match=r"interpreter=\.\.\.\)='cuda'.*'auto', 'plain', 'tpu', 'gpu'"):
        pallas_guard.install("warn", interpreter="cuda")


def test_bad_argument_changes_nothing() -> None:
    pallas_guard.set_policy("strict")
    with pytest.raises(PallasGuardConfigError):
        pallas_guard.install("nope")
    assert pallas_guard.get_policy() is Policy.STRICT


def test_strings_and_members_are_accepted() -> None:
    pallas_guard.set_policy(Policy.OFF)
    assert pallas_guard.get_policy() is Policy.OFF
    pallas_guard.set_policy(" Interpret ")
    assert pallas_guard.get_policy() is Policy.INTERPRET
    assert parse_policy(Policy.STRICT) is Policy.STRICT
    assert Policy.WARN == "warn"
    assert isinstance(Policy.WARN, str)


def test_scope_overrides_and_restores_with_source() -> None:
    pallas_guard.set_policy("warn")
    with pallas_guard.policy("strict"):
        assert pallas_guard.get_policy() is Policy.STRICT
        assert current_policy().source == "pallas_guard.policy() scope"
        with pallas_guard.policy(Policy.OFF):
            assert pallas_guard.get_policy() is Policy.OFF
        with pallas_guard.policy(interpreter="plain"):
            assert pallas_guard.get_policy() is Policy.STRICT
        assert pallas_guard.get_policy() is Policy.STRICT
    assert pallas_guard.get_policy() is Policy.WARN
    assert current_policy().source == "set_policy()"


def test_scope_restores_after_exception() -> None:
    with pytest.raises(RuntimeError), pallas_guard.policy("off"):
        raise RuntimeError
    assert pallas_guard.get_policy() is Policy.WARN


def test_scope_is_thread_local() -> None:
    seen: dict[str, Policy] = {}
    barrier = threading.Barrier(4)

    def worker(name: str) -> None:
        with pallas_guard.policy(name):
            barrier.wait(timeout=10)
            seen[name] = pallas_guard.get_policy()
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=worker, args=(p.value,)) for p in Policy]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert seen == {p.value: p for p in Policy}
    assert pallas_guard.get_policy() is Policy.WARN


def test_scope_is_asyncio_task_local() -> None:
    async def task(policy: Policy) -> Policy:
        with pallas_guard.policy(policy):
            await asyncio.sleep(0.01)
            return pallas_guard.get_policy()

    async def main() -> list[Policy]:
        return list(await asyncio.gather(*(task(p) for p in Policy)))

    assert asyncio.run(main()) == list(Policy)
