"""Settings: the policy and the interpreter choice, where each came from, and scoped overrides.

Every surface (environment, ``install()``, ``set_policy()``, the ``policy()`` scope, the pytest
plugin, the CLI) parses through :func:`parse_policy` / :func:`parse_interpreter`, so a bad value
gets the same message wherever it comes from.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
from collections import namedtuple

from ._errors import PallasGuardConfigError

POLICY_ENV = "PALLAS_GUARD_POLICY"
"""Environment variable that activates the guard and sets its policy."""

INTERPRETER_ENV = "PALLAS_GUARD_INTERPRETER"
"""Environment variable that forces one interpreter instead of the per-kernel choice."""

DETECT_RACES_ENV = "PALLAS_GUARD_DETECT_RACES"
"""Environment variable: ``1`` runs kernels in TPU interpret mode with race detection."""


class Policy(enum.StrEnum):
    """What the guard does with a Pallas kernel that would lower for the CPU without ``interpret=``."""

    INTERPRET = "interpret"
    """Run it in the right interpret mode, silently."""
    WARN = "warn"
    """Run it interpreted and emit one :class:`PallasGuardWarning` per call site."""
    STRICT = "strict"
    """Raise :class:`PallasGuardError` with a diagnostic."""
    OFF = "off"
    """Do nothing: JAX's own error comes back."""


class Interpreter(enum.StrEnum):
    """Which interpreter runs a kernel on the CPU."""

    AUTO = "auto"
    """Choose per kernel: plain unless the kernel needs TPU or Mosaic-GPU semantics."""
    PLAIN = "plain"
    """JAX's HLO interpreter (``interpret=True``)."""
    TPU = "tpu"
    """TPU interpret mode (``pltpu.InterpretParams``)."""
    GPU = "gpu"
    """The Mosaic-GPU interpreter (``InterpretGPUParams``)."""


DEFAULT_POLICY = Policy.WARN
DEFAULT_INTERPRETER = Interpreter.AUTO

_TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off", "n", "f"})


def _accepted(enum_cls: type[enum.Enum]) -> str:
    return ", ".join(repr(member.value) for member in enum_cls)


def _parse_member(
    enum_cls: type[Policy] | type[Interpreter], value: object, *, source: str, kind: str
) -> Policy | Interpreter:
    if isinstance(value, enum_cls):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{source} must be a str or pallas_guard.{enum_cls.__name__}, "
            f"got {type(value).__name__} {value!r}; accepted values: {_accepted(enum_cls)}"
        )
    try:
        return enum_cls(value.strip().lower())
    except ValueError:
        raise PallasGuardConfigError(
            f"{source}={value!r} is not a valid pallas_guard {kind}; "
            f"accepted values (case-insensitive): {_accepted(enum_cls)}"
        ) from None


def parse_policy(value: object, *, source: str = "policy") -> Policy:
    """``value`` as a :class:`Policy`, or a ``TypeError``/``PallasGuardConfigError`` naming ``source``."""
    result = _parse_member(Policy, value, source=source, kind="policy")
    assert isinstance(result, Policy)
    return result


def parse_interpreter(value: object, *, source: str = "interpreter") -> Interpreter:
    """``value`` as an :class:`Interpreter`, or a ``TypeError``/``PallasGuardConfigError`` naming ``source``."""
    result = _parse_member(Interpreter, value, source=source, kind="interpreter")
    assert isinstance(result, Interpreter)
    return result


def parse_bool(value: object, *, source: str) -> bool:
    """A strict boolean, as JAX's ``bool_env`` parses it: no "any non-empty string is true"."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{source} must be a bool or str, got {type(value).__name__} {value!r}")
    word = value.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise PallasGuardConfigError(
        f"{source}={value!r} is not a valid boolean; accepted values (case-insensitive): "
        f"{', '.join(sorted(_TRUE_WORDS))} / {', '.join(sorted(_FALSE_WORDS - {''}))}, or empty"
    )


def _env_setting(name: str) -> str | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw


def policy_from_env() -> Policy | None:
    """The policy ``PALLAS_GUARD_POLICY`` sets, ``None`` when unset or empty."""
    raw = _env_setting(POLICY_ENV)
    return None if raw is None else parse_policy(raw, source=POLICY_ENV)


def interpreter_from_env() -> Interpreter | None:
    """The interpreter ``PALLAS_GUARD_INTERPRETER`` sets, ``None`` when unset or empty."""
    raw = _env_setting(INTERPRETER_ENV)
    return None if raw is None else parse_interpreter(raw, source=INTERPRETER_ENV)


def detect_races_from_env() -> bool:
    raw = _env_setting(DETECT_RACES_ENV)
    return False if raw is None else parse_bool(raw, source=DETECT_RACES_ENV)


# typing (and the re it imports) is ~40% of the cost of importing pallas_guard at interpreter
# start-up, so the checker sees the generic NamedTuple and the run time a plain namedtuple, which
# is what typing.NamedTuple builds anyway.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Generic, NamedTuple, TypeVar

    T = TypeVar("T")

    class Setting(NamedTuple, Generic[T]):
        """A resolved value and where it came from (for diagnostics and ``doctor``)."""

        value: T
        source: str
else:
    Setting = namedtuple("Setting", ("value", "source"))
    Setting.__doc__ = "A resolved value and where it came from (for diagnostics and ``doctor``)."


class _ProcessSettings:
    """The process-wide values; a scope (``policy()``) overrides them per context."""

    def __init__(self) -> None:
        self.policy: Setting[Policy] = Setting(DEFAULT_POLICY, "default")
        self.interpreter: Setting[Interpreter] = Setting(DEFAULT_INTERPRETER, "default")
        self.detect_races: Setting[bool] = Setting(False, "default")


_process = _ProcessSettings()

# One ContextVar per setting: a scope sets only what it names, so nested scopes compose.
_scoped_policy: contextvars.ContextVar[Setting[Policy] | None] = contextvars.ContextVar(
    "pallas_guard_policy", default=None
)
_scoped_interpreter: contextvars.ContextVar[Setting[Interpreter] | None] = contextvars.ContextVar(
    "pallas_guard_interpreter", default=None
)


def load_from_env() -> None:
    """Read every ``PALLAS_GUARD_*`` variable; raise on a bad one before changing anything."""
    policy = policy_from_env()
    interpreter = interpreter_from_env()
    detect_races = detect_races_from_env()
    _process.policy = Setting(policy, POLICY_ENV) if policy is not None else Setting(DEFAULT_POLICY, "default")
    _process.interpreter = (
        Setting(interpreter, INTERPRETER_ENV) if interpreter is not None else Setting(DEFAULT_INTERPRETER, "default")
    )
    _process.detect_races = Setting(detect_races, DETECT_RACES_ENV if detect_races else "default")


def set_process_policy(policy: Policy, source: str) -> None:
    _process.policy = Setting(policy, source)


def set_process_interpreter(interpreter: Interpreter, source: str) -> None:
    _process.interpreter = Setting(interpreter, source)


def current_policy() -> Setting[Policy]:
    scoped = _scoped_policy.get()
    return scoped if scoped is not None else _process.policy


def current_interpreter() -> Setting[Interpreter]:
    scoped = _scoped_interpreter.get()
    return scoped if scoped is not None else _process.interpreter


def detect_races() -> bool:
    return bool(_process.detect_races.value)


@contextlib.contextmanager
def scoped(policy: Policy | None, interpreter: Interpreter | None, source: str) -> Iterator[None]:
    policy_token = _scoped_policy.set(Setting(policy, source)) if policy is not None else None
    interpreter_token = _scoped_interpreter.set(Setting(interpreter, source)) if interpreter is not None else None
    try:
        yield
    finally:
        if interpreter_token is not None:
            _scoped_interpreter.reset(interpreter_token)
        if policy_token is not None:
            _scoped_policy.reset(policy_token)
