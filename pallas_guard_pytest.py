"""pytest plugin (``pytest11`` entry point ``pallas_guard``; ``-p no:pallas_guard`` disables it).

PYTEST_DONT_REWRITE (a plugin; nothing of ours to rewrite).

A standalone module: it imports ``pallas_guard`` only when it acts, so installing pallas_guard
changes nobody's pytest runs. It acts in a test session when a policy is given:
``--pallas-guard-policy``, the ``pallas_guard_policy`` ini setting, or ``PALLAS_GUARD_POLICY``
(an interpreter given to pytest counts too), or when the guard was already asked for (the
autoload, a ``sitecustomize``). A bad value of any of them is then a usage error (exit 4) naming it.
``@pytest.mark.pallas_guard(...)`` scopes a policy to one test or class, activating the guard for
that test if the session has none.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import pallas_guard_autoload
from pallas_guard_autoload import OPTIONS, POLICY_ENV

POLICY_HELP = (
    f"pallas_guard policy for Pallas kernels that would lower for the CPU without interpret=: "
    f"{OPTIONS['policy'].accepted} (default: the ini setting, else ${POLICY_ENV}; none: the guard stays off)"
)
INTERPRETER_HELP = (
    f"pallas_guard interpreter for those kernels: {OPTIONS['interpreter'].accepted} "
    f"(default: the ini setting, else ${OPTIONS['interpreter'].env}, else auto)"
)
DETAILS_HELP = "list, per test, each Pallas kernel pallas_guard interpreted, refused or left alone"
MARKER = (
    "pallas_guard(policy=None, *, interpreter=None): run this test (or class) under this pallas_guard "
    "policy/interpreter (pallas_guard.policy() scope); activates the guard for it if the session has none"
)

OUTSIDE_TESTS = "(outside tests)"
_WORKER_KEY = "pallas_guard_decisions"


class _Session:
    """The plugin's state for one pytest run (``config.stash``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.active = False
        self.rows: list[dict[str, Any]] = []
        """One JSON-able dict per decision: what ``decisions()`` recorded, plus the test's node id."""
        self._seen = 0

    # --- activation ------------------------------------------------------------------------------

    def _given(self, name: str) -> tuple[str, str] | None:
        option = self.config.getoption(name)
        if option:
            return option, f"--{name.replace('_', '-')}"
        ini = self.config.getini(name)
        if ini:
            where = self.config.inipath.name if self.config.inipath else "ini"
            return str(ini), f"{name} in {where}"
        return None

    def configure(self) -> None:
        given = {}
        for name in ("policy", "interpreter"):
            where = self._given(f"pallas_guard_{name}")
            if where is not None:
                given[name] = where
        if not (given or pallas_guard_autoload.guard_wanted() or _guard_requested()):
            return
        try:
            pallas_guard_autoload.read_environment()  # a bad variable: a usage error, not a crash
            for name, (value, source) in given.items():
                OPTIONS[name].parse(value, source)
        except (ValueError, TypeError) as error:
            raise pytest.UsageError(f"pallas_guard: {error}") from None
        import pallas_guard  # noqa: F401 - installs the guard from the environment (the one code path)
        from pallas_guard import _install, _settings

        _install.installation.install(
            {
                name: _settings.Setting(_settings.parse(name, value, source), source)
                for name, (value, source) in given.items()
            }
        )
        self.active = True

    # --- records ---------------------------------------------------------------------------------

    def take(self, nodeid: str) -> None:
        """Attribute the decisions recorded since the last call to ``nodeid``."""
        if "pallas_guard" not in sys.modules:
            return
        from pallas_guard import _record

        records = _record.snapshot()
        if len(records) < self._seen:  # someone cleared them (clear_decisions())
            self._seen = 0
        self.rows.extend(_row(decision, nodeid) for decision in records[self._seen :])
        self._seen = len(records)


def _guard_requested() -> bool:
    if "pallas_guard" not in sys.modules:
        return pallas_guard_autoload.activated
    from pallas_guard import _install

    return _install.status().requested


def _parse(name: str, value: object, source: str) -> Any:
    try:
        return OPTIONS[name].parse(value, source)
    except (ValueError, TypeError) as error:
        raise pytest.UsageError(f"pallas_guard: {error}") from None


def _row(decision: Any, nodeid: str) -> dict[str, Any]:
    return {
        "test": nodeid,
        "kernel": decision.kernel,
        "defined_at": decision.defined_at,
        "called_at": decision.called_at,
        "action": decision.action,
        "interpreter": decision.interpreter,
        "policy": decision.policy.value,
        "layer": decision.layer,
        "entry_point": decision.entry_point,
    }


_KEY = pytest.StashKey[_Session]()


# --- hooks ------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pallas_guard", "pallas_guard: Pallas kernels written for GPU/TPU, on the CPU")
    group.addoption("--pallas-guard-policy", dest="pallas_guard_policy", metavar="POLICY", help=POLICY_HELP)
    group.addoption(
        "--pallas-guard-interpreter", dest="pallas_guard_interpreter", metavar="INTERPRETER", help=INTERPRETER_HELP
    )
    group.addoption("--pallas-guard-details", action="store_true", dest="pallas_guard_details", help=DETAILS_HELP)
    parser.addini("pallas_guard_policy", POLICY_HELP)
    parser.addini("pallas_guard_interpreter", INTERPRETER_HELP)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    session = _Session(config)
    config.stash[_KEY] = session
    session.configure()
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(), "pallas_guard_xdist")


def _setting_text(setting: Any) -> str:
    return f"{setting.value.value} (from {setting.source})"


def pytest_report_header(config: pytest.Config) -> str:
    session = config.stash[_KEY]
    if not session.active:
        return (
            "pallas_guard: inactive (give a policy with --pallas-guard-policy, the pallas_guard_policy ini "
            f"setting or {POLICY_ENV})"
        )
    from pallas_guard import _settings, _target

    target = _target.detect()
    where = target.platform or "decided when each kernel lowers"
    return (
        f"pallas_guard: policy {_setting_text(_settings.current_policy())}, interpreter "
        f"{_setting_text(_settings.current_interpreter())}, target {where} ({'; '.join(target.evidence)})"
    )


def _marker_settings(item: pytest.Item) -> tuple[str | None, str | None] | None:
    marker = item.get_closest_marker("pallas_guard")
    if marker is None:
        return None
    unknown = set(marker.kwargs) - {"policy", "interpreter"}
    if len(marker.args) > 1 or unknown or ("policy" in marker.kwargs and marker.args):
        raise pytest.UsageError(
            f"pallas_guard: @pytest.mark.pallas_guard on {item.nodeid} takes (policy=None, *, interpreter=None), "
            f"got args {marker.args!r} kwargs {marker.kwargs!r}"
        )
    source = f"@pytest.mark.pallas_guard on {item.nodeid}"
    policy = marker.args[0] if marker.args else marker.kwargs.get("policy")
    interpreter = marker.kwargs.get("interpreter")
    parsed_policy = None if policy is None else _parse("policy", policy, source)
    parsed_interpreter = None if interpreter is None else _parse("interpreter", interpreter, f"{source} (interpreter=)")
    return parsed_policy, parsed_interpreter


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    for item in items:
        _marker_settings(item)  # a bad marker value stops the run before any test, naming the test


@pytest.fixture(autouse=True)
def _pallas_guard_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Apply ``@pytest.mark.pallas_guard`` to this test: a ``pallas_guard.policy()`` scope."""
    settings = _marker_settings(request.node)
    if settings is None:
        yield
        return
    installed_here = not _guard_requested()
    try:
        import pallas_guard as guard
    except (ValueError, TypeError) as error:  # a bad PALLAS_GUARD_* variable
        raise pytest.UsageError(f"pallas_guard: {error}") from None
    if installed_here:
        guard.install()
    try:
        with guard.policy(settings[0], interpreter=settings[1]):
            yield
    finally:
        if installed_here:
            guard.uninstall()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    session = item.config.stash[_KEY]
    session.take(OUTSIDE_TESTS)
    yield
    session.take(item.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash[_KEY]
    state.take(OUTSIDE_TESTS)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: hand the rows to the controller
        workeroutput[_WORKER_KEY] = state.rows
        workeroutput["pallas_guard_active"] = state.active


class _XdistController:
    """pytest-xdist's controller hooks, registered only when xdist is loaded."""

    @pytest.hookimpl
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """Collect a finished worker's rows."""
        del error
        output = getattr(node, "workeroutput", None) or {}
        state = node.config.stash[_KEY]
        state.rows.extend(output.get(_WORKER_KEY, ()))
        state.active = state.active or bool(output.get("pallas_guard_active"))


def summary_lines(rows: list[dict[str, Any]], *, details: bool) -> list[str]:
    """The terminal summary: counts by outcome and interpreter, the tests, and (``details``) each kernel."""
    actions = Counter(row["action"] for row in rows)
    interpreters = Counter(row["interpreter"] or "?" for row in rows if row["action"] == "interpreted")
    by_interpreter = ", ".join(f"{name}: {count}" for name, count in sorted(interpreters.items()))
    tests = sorted({row["test"] for row in rows})
    lines = [
        f"{len(rows)} Pallas kernel(s): {actions['interpreted']} interpreted"
        + (f" ({by_interpreter})" if by_interpreter else "")
        + f", {actions['refused']} refused, {actions['untouched']} left alone; in {len(tests)} test(s)"
    ]
    if not rows:
        return lines
    if not details:
        shown = ", ".join(tests[:5]) + (f" and {len(tests) - 5} more" if len(tests) > 5 else "")
        lines.append(f"from {shown} (--pallas-guard-details lists each kernel)")
        return lines
    for row in sorted(rows, key=lambda r: (r["test"], r["action"], r["kernel"])):
        how = f" with the {row['interpreter']} interpreter" if row["action"] == "interpreted" else ""
        lines.append(
            f"{row['action'].upper()}{how} {row['test']}: {row['kernel']} ({row['entry_point']}, defined at "
            f"{row['defined_at'] or '?'}, called at {row['called_at'] or '?'}) [{row['layer']}, policy {row['policy']}]"
        )
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash[_KEY]
    if not state.active and not state.rows:
        return
    terminalreporter.write_sep("=", "pallas_guard summary")
    for line in summary_lines(state.rows, details=bool(config.getoption("pallas_guard_details"))):
        terminalreporter.write_line(line)
