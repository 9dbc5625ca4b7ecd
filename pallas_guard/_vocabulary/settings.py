"""Settings: each option's value in this process and where it came from, and scoped overrides.

The options themselves (variable, parser, accepted values, default) are declared once, in
``pallas_guard_autoload.OPTIONS``, which start-up validates with before this package is imported.
Precedence, highest first: a ``policy()`` scope; a value given through the API (``install(...)``,
``set_policy()``, the pytest plugin's option or ini), which a later bare ``install()`` or a reload
keeps; the ``PALLAS_GUARD_*`` variable; the default.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import MappingProxyType
from typing import Any, Generic, NamedTuple, TypeVar

from pallas_guard._vocabulary.enums import Interpreter, Policy
from pallas_guard_autoload import OPTIONS, POLICIES, read_environment, report_unknown_variables

T = TypeVar("T")
__all__ = ["AbstractContextManager", "Setting"]


class Setting(NamedTuple, Generic[T]):
    """A resolved value and where it came from (for diagnostics and ``doctor``)."""

    value: T
    source: str


# Options whose values the public API shows as enums.
_PUBLIC_TYPES: dict[str, type] = {"policy": Policy, "interpreter": Interpreter}


def parse(name: str, value: object, source: str) -> Any:
    """``value`` for option ``name``, or ``TypeError``/``PallasGuardConfigError`` naming ``source``."""
    parsed = OPTIONS[name].parse(value, source)
    public = _PUBLIC_TYPES.get(name)
    return public(parsed) if public is not None else parsed


def given(values: Mapping[str, object], *, call: str, source: str | None = None) -> dict[str, Setting[Any]]:
    """The settings an API call was given (``None``: not given), parsed; errors name the argument
    as ``call(name=...)``, and the source is ``source`` (default: that same text)."""
    parsed = {}
    for name, value in values.items():
        if value is not None:
            where = f"{call}(policy)" if name == "policy" and call != "install" else f"{call}({name}=...)"
            parsed[name] = Setting(parse(name, value, where), source or where)
    return parsed


def _from(name: str, value: object, source: str) -> Setting[Any]:
    public = _PUBLIC_TYPES.get(name)
    return Setting(public(value) if public is not None else value, source)


class _Process:
    """The process-wide values; loaded from the environment on first use or by ``install()``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, Setting[Any]] | None = None
        self.pinned: set[str] = set()  # given through the API: the environment no longer applies


_process = _Process()
_unsettled: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_guard_unsettled", default=False)


@contextmanager
def unsettled() -> Iterator[None]:
    """Inside: a bad variable leaves the process values unloaded instead of raising, so the guard
    can be installed and the first read of a setting (the first kernel) raises the error, naming it."""
    token = _unsettled.set(True)
    try:
        yield
    finally:
        _unsettled.reset(token)


_NO_OVERRIDES: Mapping[str, Setting[Any]] = MappingProxyType({})
_scoped: contextvars.ContextVar[Mapping[str, Setting[Any]]] = contextvars.ContextVar(
    "pallas_guard_settings", default=_NO_OVERRIDES
)


def configure(given: Mapping[str, Setting[Any]] | None = None) -> None:
    """Settle every option: ``given`` (from the API), else a value pinned earlier, else the
    environment, else the default. Raises on a bad variable before changing anything (inside
    :func:`unsettled`, a bad variable leaves the values unloaded: the next read raises it)."""
    report_unknown_variables()
    try:
        environment = read_environment()
    except (ValueError, TypeError):
        if not _unsettled.get() or given:
            raise
        reset()
        return
    given = given or {}
    with _process.lock:
        previous = _process.values or {}
        values = {}
        for name, option in OPTIONS.items():
            if name in given:
                values[name] = given[name]
            elif name in _process.pinned and name in previous:
                values[name] = previous[name]
            elif name in environment:
                values[name] = _from(name, *environment[name])
            else:
                values[name] = _from(name, option.default, "default")
        _process.values = values
        _process.pinned.update(given)


def pin(name: str, setting: Setting[Any]) -> None:
    """Set one option for the process, as ``set_policy()`` does; the environment no longer applies."""
    configure({name: setting})


def reset() -> None:
    """Forget every value (tests): the next read loads the environment again."""
    with _process.lock:
        _process.values = None
        _process.pinned.clear()


def current(name: str) -> Setting[Any]:
    """The value in effect here: the innermost scope, else the process value."""
    scoped = _scoped.get().get(name)
    if scoped is not None:
        return scoped
    values = _process.values
    if values is None:
        configure()  # a bad variable raises here, naming it
        values = _process.values
        if values is None:  # left unloaded on purpose (``unsettled``): the bad variable's error
            read_environment()
            raise AssertionError("the settings are unloaded, yet the environment reads clean")
    return values[name]


def current_policy() -> Setting[Policy]:
    return current("policy")


def current_interpreter() -> Setting[Interpreter]:
    return current("interpreter")


def max_steps() -> Setting[int | None]:
    return current("max_steps")


@contextmanager
def scope(overrides: Mapping[str, Setting[Any]]) -> Iterator[None]:
    """Override options for the current context (thread / asyncio task) inside a ``with`` block."""
    token = _scoped.set({**_scoped.get(), **overrides})
    try:
        yield
    finally:
        _scoped.reset(token)


# --- the words a user reads about a setting -------------------------------------------------------


def how_to_set(name: str, value: object, source: str) -> str:  # noqa: PLR0911 - one phrasing per surface
    """How to set option ``name`` to ``value``, phrased for the surface that set it now (``source``),
    since only that surface (or one above it) can win: the pytest option, the ini key, the marker,
    a ``policy()`` scope, ``install()``/``set_policy()``, else the variable."""
    option = OPTIONS[name]
    word = option.word(value)
    python = repr(word) if not isinstance(value, int) or isinstance(value, bool) else word
    argument = python if name == "policy" else f"{name}={python}"
    if source.startswith(option.pytest_option):
        return f"pass {option.pytest_option}={word}"
    if source.startswith(option.ini):
        where = source.partition(" in ")[2] or "the ini file"
        return f"set {option.ini} = {word} in {where} (or pass {option.pytest_option}={word})"
    if source.startswith("@pytest.mark.pallas_guard"):
        return f"use @pytest.mark.pallas_guard({argument})"
    if "policy() scope" in source or source.startswith("policy("):
        return f"use pallas_guard.policy({argument})"
    if source.startswith("install("):
        return f"call pallas_guard.install({argument})"
    if source.startswith("set_policy("):
        return f"call pallas_guard.set_policy({python})"
    return f"set {option.env}={word}"


def stated(name: str) -> str:
    """Option ``name`` in force here and where it came from, as a finding names it:
    ``PALLAS_GUARD_CHECKS=bounds``, or ``checks=bounds from pallas_guard.policy() scope``."""
    setting = current(name)
    option = OPTIONS[name]
    word = option.word(setting.value)
    if setting.source.startswith(option.env):
        return f"{option.env}={word}"
    return f"{name}={word} from {setting.source}"


class Outcome(NamedTuple):
    """What the guard does here to a Pallas kernel written for GPU/TPU (``doctor``, the pytest plugin)."""

    interpreted: bool
    """It runs interpreted (on the CPU, under policy interpret or warn)."""
    text: str
    """The verdict, to follow "Pallas kernels here will ..."."""


def outcome(policy: str, interpreter: str, platform: str | None) -> Outcome:
    """The one verdict for ``policy`` and ``interpreter`` where kernels lower for ``platform``
    (None: decided per kernel when it lowers); each policy's words come from its OPTIONS row."""
    if platform is not None and platform != "cpu":
        return Outcome(False, f"compile for {platform}: the guard changes nothing")
    where = "on cpu" if platform == "cpu" else "where they lower for the cpu"
    interpreted = policy in ("interpret", "warn")
    how = f", interpreter {interpreter}" if interpreted else ""
    return Outcome(interpreted and platform == "cpu", f"{POLICIES[policy]} ({where}{how}, policy {policy})")
