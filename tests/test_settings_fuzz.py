"""Bad input refused: any string for a setting is either a valid value or the documented error.

The documented shape (docs/how-it-decides.md, "Settings"): ``PallasGuardConfigError`` (a ``ValueError``) saying
``<source>=<ascii(value)> is not a valid pallas_guard <kind>; accepted values (case-insensitive): ...``,
then ``; did you mean '<the closest accepted value>'?`` where one is close,
and ``TypeError`` naming the argument for a value of the wrong type. Never another exception,
never a silent default. (An empty or blank variable counts as unset, as documented.)
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pallas_guard
from pallas_guard import Interpreter, PallasGuardConfigError, Policy
from pallas_guard._surfaces import install as _install
from pallas_guard._vocabulary import settings as _settings
from pallas_guard_autoload import DETECT_RACES_ENV, INTERPRETER_ENV, OPTIONS, POLICY_ENV

KINDS: dict[str, tuple[type[Policy] | type[Interpreter], str]] = {
    POLICY_ENV: (Policy, "policy"),
    INTERPRETER_ENV: (Interpreter, "interpreter"),
}


def _accepted(enum_cls: type[Policy] | type[Interpreter]) -> str:
    return ", ".join(repr(member.value) for member in enum_cls)


def _documented_message(source: str, value: str, enum_cls: type[Policy] | type[Interpreter], kind: str) -> str:
    near = difflib.get_close_matches(value.strip().lower(), [member.value for member in enum_cls], n=1)
    return (
        f"{source}={value!a} is not a valid pallas_guard {kind}; "
        f"accepted values (case-insensitive): {_accepted(enum_cls)}" + (f"; did you mean {near[0]!r}?" if near else "")
    )


def _expected(value: str, enum_cls: type[Policy] | type[Interpreter]) -> Policy | Interpreter | None:
    """The oracle: a member when the trimmed, lower-cased value names one, else None (refused)."""
    word = value.strip().lower()
    return next((member for member in enum_cls if member.value == word), None)


# Strings an environment can hold (no NUL, no lone surrogates), biased towards near misses.
env_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)
members = st.sampled_from([m.value for m in Policy] + [m.value for m in Interpreter])
near_misses = st.builds(
    lambda word, case, left, right, cut: (left + "".join(case(c) for c in word) + right)[: len(word) + 2 - cut],
    members,
    st.sampled_from([str.lower, str.upper, str.swapcase, lambda c: c]),
    st.sampled_from(["", " ", "\t", "\n", "'", '"', "x", "\u00a0", "\u200b"]),
    st.sampled_from(["", " ", "\r\n", ",", "=1", "s", "\u3000", "\u0301"]),
    st.integers(0, 3),
)
any_setting = st.one_of(env_text, near_misses)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for option in OPTIONS.values():
        monkeypatch.delenv(option.env, raising=False)
    yield monkeypatch


def _env_outcome(name: str, value: str) -> Any:
    """What the process sees: None for the default, the value, or the error (through the settings)."""
    os.environ[name] = value
    _settings.reset()
    option = "policy" if name == POLICY_ENV else "interpreter"
    try:
        setting = _settings.current(option)
        return None if setting.source == "default" else setting.value
    except PallasGuardConfigError as error:
        return error
    finally:
        del os.environ[name]
        _settings.reset()


@pytest.mark.parametrize("name", list(KINDS))
@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(value=any_setting)
@example(value="")
@example(value=" \t ")
@example(value=" WARN ")
@example(value="İnterpret")  # lower() changes its length: still refused, not crashing
def test_any_environment_string(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    enum_cls, kind = KINDS[name]
    outcome = _env_outcome(name, value)
    if not value.strip():
        assert outcome is None  # documented: blank is unset (the default applies, by its own source)
        return
    expected = _expected(value, enum_cls)
    if expected is not None:
        assert outcome is expected
    else:
        assert isinstance(outcome, PallasGuardConfigError) and isinstance(outcome, ValueError)
        assert str(outcome) == _documented_message(name, value, enum_cls, kind)


def _scope(policy: Any = None, interpreter: Any = None) -> None:
    with pallas_guard.policy(policy, interpreter=interpreter):
        pass


SURFACES: dict[str, tuple[Callable[[Any], object], str, type[Policy] | type[Interpreter], str]] = {
    "set_policy": (pallas_guard.set_policy, "set_policy(policy)", Policy, "policy"),
    "install(policy)": (pallas_guard.install, "install(policy=...)", Policy, "policy"),
    "install(interpreter)": (
        lambda v: pallas_guard.install(interpreter=v),
        "install(interpreter=...)",
        Interpreter,
        "interpreter",
    ),
    "policy()": (_scope, "policy(policy)", Policy, "policy"),
    "policy(interpreter)": (
        lambda v: _scope(interpreter=v),
        "policy(interpreter=...)",
        Interpreter,
        "interpreter",
    ),
}


@pytest.mark.parametrize("surface", list(SURFACES))
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(value=any_setting)
@example(value="")
def test_any_api_string(clean_env: pytest.MonkeyPatch, surface: str, value: str) -> None:
    call, source, enum_cls, kind = SURFACES[surface]
    expected = _expected(value, enum_cls)
    if expected is not None:
        call(value)
        return
    before = _install.status()
    with pytest.raises(PallasGuardConfigError) as error:
        call(value)
    assert str(error.value) == _documented_message(source, value, enum_cls, kind)
    assert _install.status() == before  # refused before changing anything


BAD_STRINGS = [
    "",
    " ",
    "bogus",
    "warnings",
    "interpreted",
    "strict\x01",
    "off;rm -rf /",
    "$(echo warn)",
    "__import__('os')",
    "pallas_guard.Policy.WARN",
    "Policy.STRICT",
    "w a r n",
    "\uff37\uff21\uff32\uff2e",  # WARN in fullwidth letters: not case-folded to ASCII
    "warn\u200b",  # a zero-width space is not whitespace
    "auto,plain",
    "tpu:0",
    "0",
    "None",
]


@pytest.mark.parametrize("value", BAD_STRINGS)
@pytest.mark.parametrize("surface", list(SURFACES))
def test_explicit_bad_strings(clean_env: pytest.MonkeyPatch, surface: str, value: str) -> None:
    call, source, enum_cls, kind = SURFACES[surface]
    with pytest.raises(PallasGuardConfigError, match=r"is not a valid pallas_guard") as error:
        call(value)
    assert str(error.value) == _documented_message(source, value, enum_cls, kind)


@pytest.mark.parametrize("value", [v for v in BAD_STRINGS if v.strip()])
@pytest.mark.parametrize("name", list(KINDS))
def test_explicit_bad_variables_refuse_install(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    enum_cls, kind = KINDS[name]
    clean_env.setenv(name, value)
    before = _install.status()
    with pytest.raises(PallasGuardConfigError) as error:
        pallas_guard.install()
    assert str(error.value) == _documented_message(name, value, enum_cls, kind)
    assert _install.status() == before


BAD_TYPES = [1, 0, 1.5, True, b"warn", ["warn"], ("warn",), {"warn": 1}, object(), Policy]


@pytest.mark.parametrize("value", BAD_TYPES, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("surface", list(SURFACES))
def test_wrong_types_name_the_argument(clean_env: pytest.MonkeyPatch, surface: str, value: object) -> None:
    call, source, enum_cls, _ = SURFACES[surface]
    before = _install.status()
    with pytest.raises(TypeError) as error:
        call(value)
    text = str(error.value)
    assert text.startswith(f"{source} must be a str, got {type(value).__name__} ")
    assert text.endswith(f"accepted values: {_accepted(enum_cls)}")
    assert _install.status() == before


def test_members_of_the_other_enum_are_refused_by_value(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        PallasGuardConfigError, match=r"install\(interpreter=\.\.\.\)=<Policy.WARN: 'warn'> is not a valid"
    ):
        pallas_guard.install(interpreter=Policy.WARN)  # a str subclass, so its value is checked
    pallas_guard.install(Policy.STRICT, interpreter=Interpreter.PLAIN)
    assert pallas_guard.get_policy() is Policy.STRICT


@settings(max_examples=200, deadline=None)
@given(value=any_setting)
def test_detect_races_is_a_strict_boolean(value: str) -> None:
    option = OPTIONS["checks"]  # PALLAS_GUARD_DETECT_RACES is the alias of its races value
    assert option.alias is not None
    if not value.strip():
        assert option.from_environment({DETECT_RACES_ENV: value}) is None  # blank is unset: the default
        return
    word = value.strip().lower()
    if word in TRUE_WORDS | FALSE_WORDS:
        expected = frozenset({"races"}) if word in TRUE_WORDS else None  # falsy: nothing set
        assert option.from_environment({DETECT_RACES_ENV: value}) == expected
        return
    with pytest.raises(PallasGuardConfigError) as error:
        option.from_environment({DETECT_RACES_ENV: value})
    near = difflib.get_close_matches(word, ["1", "true", "yes", "on", "0", "false", "no", "off"], n=1)
    assert str(error.value) == (
        f"{DETECT_RACES_ENV}={value!a} is not a valid pallas_guard boolean; "
        f"accepted values (case-insensitive): {option.alias.accepted}"
        + (f"; did you mean {near[0]!r}?" if near else "")
    )


TRUE_WORDS = {"1", "true", "yes", "on", "y", "t"}
FALSE_WORDS = {"0", "false", "no", "off", "n", "f"}
