"""Settings: the policy and the interpreter choice, where each came from, and scoped overrides.

Every surface (environment, ``install()``, ``set_policy()``, the ``policy()`` scope, the pytest
plugin, the CLI) parses through :func:`parse_policy` / :func:`parse_interpreter`, so a bad value
gets the same message wherever it comes from.
"""

from __future__ import annotations

import _thread
import os

from ._errors import PallasGuardConfigError

# Only the checker needs these; at run time this module imports no more than os (see _enums).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import contextvars
    from typing import Generic, NamedTuple, TypeVar

    from ._enums import Interpreter as Interpreter  # noqa: PLC0414 - re-exported for the checker
    from ._enums import Policy as Policy  # noqa: PLC0414

    T = TypeVar("T")

    class Setting(NamedTuple, Generic[T]):
        """A resolved value and where it came from (for diagnostics and ``doctor``)."""

        value: T
        source: str

    DEFAULT_POLICY: Policy
    DEFAULT_INTERPRETER: Interpreter
else:

    class Setting(tuple):
        """A resolved value and where it came from (for diagnostics and ``doctor``).

        The run-time twin of the NamedTuple the checker sees: ``collections`` costs ~1 ms at start-up.
        """

        __slots__ = ()

        def __new__(cls, value, source):
            return tuple.__new__(cls, (value, source))

        value = property(lambda self: self[0])
        source = property(lambda self: self[1])

        def __repr__(self):
            return f"Setting(value={self[0]!r}, source={self[1]!r})"


POLICY_ENV = "PALLAS_GUARD_POLICY"
"""Environment variable that activates the guard and sets its policy."""

INTERPRETER_ENV = "PALLAS_GUARD_INTERPRETER"
"""Environment variable that forces one interpreter instead of the per-kernel choice."""

DETECT_RACES_ENV = "PALLAS_GUARD_DETECT_RACES"
"""Environment variable: ``1`` runs kernels in TPU interpret mode with race detection."""

POLICY_VALUES = ("interpret", "warn", "strict", "off")
INTERPRETER_VALUES = ("auto", "plain", "tpu", "gpu")
_DEFAULT_POLICY_VALUE = "warn"
_DEFAULT_INTERPRETER_VALUE = "auto"

_TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off", "n", "f"})


def __getattr__(name: str) -> object:
    # The enums, and defaults as members, are built on first use: not at interpreter start-up.
    if name in ("Policy", "Interpreter"):
        from . import _enums

        return getattr(_enums, name)
    if name == "DEFAULT_POLICY":
        from ._enums import Policy

        return Policy(_DEFAULT_POLICY_VALUE)
    if name == "DEFAULT_INTERPRETER":
        from ._enums import Interpreter

        return Interpreter(_DEFAULT_INTERPRETER_VALUE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _normalise(value: object, values: tuple[str, ...], *, type_name: str, kind: str, source: str) -> str:
    """``value`` as one of ``values`` (a str; enum members are strs), or the documented error."""
    accepted = ", ".join(repr(v) for v in values)
    if not isinstance(value, str):
        raise TypeError(
            f"{source} must be a str or pallas_guard.{type_name}, "
            f"got {type(value).__name__} {value!r}; accepted values: {accepted}"
        )
    word = value.strip().lower()
    if word not in values:
        raise PallasGuardConfigError(
            f"{source}={value!r} is not a valid pallas_guard {kind}; accepted values (case-insensitive): {accepted}"
        )
    return word


def _policy_value(value: object, source: str) -> str:
    return _normalise(value, POLICY_VALUES, type_name="Policy", kind="policy", source=source)


def _interpreter_value(value: object, source: str) -> str:
    return _normalise(value, INTERPRETER_VALUES, type_name="Interpreter", kind="interpreter", source=source)


def parse_policy(value: object, *, source: str = "policy") -> Policy:
    """``value`` as a :class:`Policy`, or a ``TypeError``/``PallasGuardConfigError`` naming ``source``."""
    from ._enums import Policy

    return Policy(_policy_value(value, source))


def parse_interpreter(value: object, *, source: str = "interpreter") -> Interpreter:
    """``value`` as an :class:`Interpreter`, or a ``TypeError``/``PallasGuardConfigError`` naming ``source``."""
    from ._enums import Interpreter

    return Interpreter(_interpreter_value(value, source))


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


class _ProcessSettings:
    """The process-wide values, stored as validated strings; a ``policy()`` scope overrides them."""

    def __init__(self) -> None:
        self.policy: Setting[str] = Setting(_DEFAULT_POLICY_VALUE, "default")
        self.interpreter: Setting[str] = Setting(_DEFAULT_INTERPRETER_VALUE, "default")
        self.detect_races: Setting[bool] = Setting(False, "default")


_process = _ProcessSettings()

# One ContextVar per setting, so nested scopes compose; created by the first scope (contextvars
# is not imported at start-up), and until then no scope can be active.
_scoped_policy: contextvars.ContextVar[Setting[str] | None] | None = None
_scoped_interpreter: contextvars.ContextVar[Setting[str] | None] | None = None


def load_from_env() -> None:
    """Read every ``PALLAS_GUARD_*`` variable; raise on a bad one before changing anything."""
    policy = _env_setting(POLICY_ENV)
    interpreter = _env_setting(INTERPRETER_ENV)
    policy_setting = (
        Setting(_policy_value(policy, POLICY_ENV), POLICY_ENV)
        if policy is not None
        else Setting(_DEFAULT_POLICY_VALUE, "default")
    )
    interpreter_setting = (
        Setting(_interpreter_value(interpreter, INTERPRETER_ENV), INTERPRETER_ENV)
        if interpreter is not None
        else Setting(_DEFAULT_INTERPRETER_VALUE, "default")
    )
    detect_races = detect_races_from_env()
    _process.policy = policy_setting
    _process.interpreter = interpreter_setting
    _process.detect_races = Setting(detect_races, DETECT_RACES_ENV if detect_races else "default")


def set_process_policy(policy: Policy | str, source: str) -> None:
    _process.policy = Setting(_policy_value(policy, source), source)


def set_process_interpreter(interpreter: Interpreter | str, source: str) -> None:
    _process.interpreter = Setting(_interpreter_value(interpreter, source), source)


def current_policy() -> Setting[Policy]:
    from ._enums import Policy

    scoped = _scoped_policy.get() if _scoped_policy is not None else None
    setting = scoped if scoped is not None else _process.policy
    return Setting(Policy(setting.value), setting.source)


def current_interpreter() -> Setting[Interpreter]:
    from ._enums import Interpreter

    scoped = _scoped_interpreter.get() if _scoped_interpreter is not None else None
    setting = scoped if scoped is not None else _process.interpreter
    return Setting(Interpreter(setting.value), setting.source)


def detect_races() -> bool:
    return bool(_process.detect_races.value)


class scoped:
    """Set the policy and/or interpreter for the current context (thread / asyncio task) inside a block."""

    __slots__ = ("_interpreter", "_interpreter_token", "_policy", "_policy_token", "_source")

    def __init__(self, policy: Policy | str | None, interpreter: Interpreter | str | None, source: str) -> None:
        self._policy = policy
        self._interpreter = interpreter
        self._source = source
        self._policy_token: contextvars.Token[Setting[str] | None] | None = None
        self._interpreter_token: contextvars.Token[Setting[str] | None] | None = None

    def __enter__(self) -> None:
        policy_var, interpreter_var = _context_vars()
        if self._policy is not None:
            self._policy_token = policy_var.set(Setting(str(self._policy), self._source))
        if self._interpreter is not None:
            self._interpreter_token = interpreter_var.set(Setting(str(self._interpreter), self._source))

    def __exit__(self, *exc_info: object) -> None:
        policy_var, interpreter_var = _context_vars()
        if self._interpreter_token is not None:
            interpreter_var.reset(self._interpreter_token)
        if self._policy_token is not None:
            policy_var.reset(self._policy_token)


def _context_vars() -> tuple[contextvars.ContextVar[Setting[str] | None], contextvars.ContextVar[Setting[str] | None]]:
    global _scoped_policy, _scoped_interpreter  # noqa: PLW0603 - created once, on first use
    if _scoped_policy is None or _scoped_interpreter is None:
        import contextvars

        with _create_lock:
            if _scoped_policy is None or _scoped_interpreter is None:
                _scoped_interpreter = contextvars.ContextVar("pallas_guard_interpreter", default=None)
                _scoped_policy = contextvars.ContextVar("pallas_guard_policy", default=None)
    return _scoped_policy, _scoped_interpreter


_create_lock = _thread.allocate_lock()
