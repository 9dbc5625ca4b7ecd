"""pytest plugin (``pytest11`` entry point ``pallas_guard``; ``-p no:pallas_guard`` disables it).

PYTEST_DONT_REWRITE (a plugin; nothing of ours to rewrite).

A standalone module: it imports ``pallas_guard`` only when it acts, so installing pallas_guard
changes nobody's pytest runs. It acts in a test session when a policy is given:
``--pallas-guard-policy``, the ``pallas_guard_policy`` ini setting, or ``PALLAS_GUARD_POLICY``
(an interpreter given to pytest counts too), or when the guard was already asked for (the
autoload, a ``sitecustomize``). A bad value of any of them is then a usage error (exit 4) naming it.
``@pytest.mark.pallas_guard(...)`` scopes settings to one test, class or module, activating the guard
for that test if the session has none; its ``skip_interpreted=``/``xfail_interpreted=`` arguments
skip or xfail a test only where the guard would run its kernels interpreted.

Every row of ``pallas_guard_autoload.OPTIONS`` is an option ``--pallas-guard-<name>`` and an ini
setting ``pallas_guard_<name>``; the ini ``pallas_guard_over_budget = skip`` reports tests whose
kernel was over the step budget as skipped; the summary lists the slowest tests that ran
interpreted kernels (``--pallas-guard-durations``).
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Generator, Iterator
from typing import Any, NamedTuple

import pytest

import pallas_guard_autoload
from pallas_guard_autoload import OPTIONS, POLICY_ENV, printable


def _option_help(name: str) -> str:
    """An option's help, from its row of ``OPTIONS`` (accepted values, ini key, variable, default)."""
    option = OPTIONS[name]
    default = "none: the guard stays off" if name == "policy" else f"default {option.word(option.default)}"
    return (
        f"pallas_guard {name.replace('_', ' ')}: {option.help}. Accepted: {option.accepted} "
        f"(else the ini setting {option.ini}, else ${option.env}; {default})"
    )


# Settings where a list is natural: a TOML array in the ini file (``pallas_guard_checks = ["races"]``).
_LIST_SETTINGS = frozenset({"checks"})
DETAILS_HELP = "list, per test, each Pallas kernel pallas_guard interpreted, refused or left alone"
DURATIONS_DEFAULT = 5
DURATIONS_HELP = (
    "list the N slowest tests that ran interpreted kernels, with each kernel's interpreter and grid steps "
    f"(default {DURATIONS_DEFAULT}; 0: all)"
)
REPORT_HELP = (
    "write what each kernel takes of each TPU generation's VMEM and SMEM (the compile check), against the "
    "limit, to PATH: HTML (.html) or Markdown with an SVG beside it (any other name); the same table is "
    "appended to $GITHUB_STEP_SUMMARY where that is set"
)
OVER_BUDGET_HELP = (
    "what a test whose Pallas kernel was over the step budget (pallas_guard_max_steps) reports: "
    "fail (default) or skip, with the guard's error as the reason"
)
OVER_BUDGET_CHOICES = ("fail", "skip")
_MARKER_ACTIONS = ("skip_interpreted", "xfail_interpreted")
MARKER = (
    "pallas_guard(policy=None, *, interpreter=None, checks=None, max_steps=None, vmem_headroom=None, "
    "skip_interpreted=None, xfail_interpreted=None): run this test (class, module) under these pallas_guard settings "
    "(pallas_guard.policy() scope; activates the guard for it if the session has none); skip or xfail it, "
    "with this reason, where the guard runs its kernels interpreted (target CPU, policy interpret or warn)"
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
        self.durations: dict[str, float] = {}
        """The call phase's duration of each test, as pytest measured it (``report.duration``)."""
        self.over_budget = "fail"
        self._seen = 0
        self.armed: list[dict[str, Any]] = []
        """Each process's armed state at the end (this one, and every xdist worker's)."""

    # --- activation ------------------------------------------------------------------------------

    def _given(self, name: str) -> tuple[str, str] | None:
        """The value of setting ``name`` given to pytest, and where: its option, else its ini key."""
        option = OPTIONS[name]
        given = self.config.getoption(option.ini)
        if given:
            return given, option.pytest_option
        ini = self.config.getini(option.ini)
        if isinstance(ini, list):  # a TOML array, or an ini line split into words
            ini = ",".join(ini)
        if ini:
            return str(ini), f"{option.ini} in {self._ini_file()}"
        return None

    def _ini_file(self) -> str:
        return self.config.inipath.name if self.config.inipath else "ini"

    def _plugin_settings(self) -> None:
        """The plugin's own settings (valid or a usage error, whether or not the guard acts)."""
        over_budget = str(self.config.getini("pallas_guard_over_budget") or "fail")
        if over_budget.strip().lower() not in OVER_BUDGET_CHOICES:
            raise pytest.UsageError(
                f"pallas_guard: pallas_guard_over_budget in {self._ini_file()}={over_budget!r} is not valid; "
                f"accepted values: {', '.join(map(repr, OVER_BUDGET_CHOICES))}"
            )
        self.over_budget = over_budget.strip().lower()
        durations = self.config.getoption("pallas_guard_durations")
        if durations is not None and durations < 0:
            raise pytest.UsageError(f"pallas_guard: --pallas-guard-durations={durations} must be 0 (all) or more")

    def configure(self) -> None:
        self._plugin_settings()
        given = {}
        for name in OPTIONS:  # every setting: --pallas-guard-<name>, ini pallas_guard_<name>
            where = self._given(name)
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
        from pallas_guard._surfaces import install as _install
        from pallas_guard._vocabulary import settings as _settings

        _install.installation.install(
            {
                name: _settings.Setting(_settings.parse(name, value, source), source)
                for name, (value, source) in given.items()
            }
        )
        self.active = True
        from pallas_guard._surfaces import report as _report

        _report.shown_by_pytest = True  # its summary (the controller's, under xdist) shows the figures

    # --- records ---------------------------------------------------------------------------------

    def take(self, nodeid: str) -> None:
        """Attribute the decisions recorded since the last call to ``nodeid``."""
        if "pallas_guard" not in sys.modules:
            return
        from pallas_guard._surfaces import report as _report
        from pallas_guard._vocabulary import record as _record

        records = _record.snapshot()
        if len(records) < self._seen:  # someone cleared them (clear_decisions())
            self._seen = 0
        for decision in records[self._seen :]:
            row = _row(decision, nodeid)
            row["memory"] = [_report.as_row(use) for use in getattr(decision, "memory", ())]
            self.rows.append(row)
        self._seen = len(records)


def _guard_requested() -> bool:
    if "pallas_guard" not in sys.modules:
        return pallas_guard_autoload.activated
    from pallas_guard._surfaces import install as _install

    return _install.status().requested


def _parse(name: str, value: object, source: str) -> Any:
    __tracebackhide__ = True  # the usage error is about the user's marker, not this frame
    try:
        return OPTIONS[name].parse(value, source)
    except (ValueError, TypeError) as error:
        raise pytest.UsageError(f"pallas_guard: {error}") from None


def _row(decision: Any, nodeid: str) -> dict[str, Any]:
    # getattr: a check's or a cost's note, where the recording guard has them.
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
        "steps": decision.steps,
        "notes": list(getattr(decision, "notes", ())),
        "checks": _verdicts(decision),
        "check": getattr(decision, "check", None),
        # The one reason sentence (repr(decision) prints it too); a recording guard without it: its reason.
        "why": getattr(decision, "why", "") or decision.reason,
    }


def _verdicts(decision: Any) -> list[str]:
    """What the agree, lowering and compile checks said of a kernel (``agree: ...``, ``lowering: ...``)."""
    tried = [entry for entry in getattr(decision, "tried", ()) if entry.startswith("agree:")]
    checks = ("agree:", "lowering:", "compile:")
    return tried + [note for note in getattr(decision, "notes", ()) if note.startswith(checks) and note not in tried]


_KEY = pytest.StashKey[_Session]()


# --- hooks ------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pallas_guard", "pallas_guard: Pallas kernels written for GPU/TPU, on the CPU")
    for name, option in OPTIONS.items():
        help = _option_help(name)
        group.addoption(option.pytest_option, dest=option.ini, metavar=name.upper(), help=help)
        if name not in _LIST_SETTINGS:
            parser.addini(option.ini, help)
            continue
        try:  # pytest >= 9.2: a TOML array or a string, each as written
            parser.addini(option.ini, help, type=("args", "string"))  # type: ignore[arg-type]
        except (AssertionError, TypeError, ValueError):  # older pytest: one type per setting
            parser.addini(option.ini, help, type="args")
    group.addoption("--pallas-guard-details", action="store_true", dest="pallas_guard_details", help=DETAILS_HELP)
    group.addoption("--pallas-guard-report", dest="pallas_guard_report", metavar="PATH", help=REPORT_HELP)
    group.addoption(
        "--pallas-guard-durations",
        type=int,
        default=DURATIONS_DEFAULT,
        dest="pallas_guard_durations",
        metavar="N",
        help=DURATIONS_HELP,
    )
    parser.addini("pallas_guard_over_budget", OVER_BUDGET_HELP)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    session = _Session(config)
    config.stash[_KEY] = session
    session.configure()
    config.pluginmanager.register(_Durations(session), "pallas_guard_durations")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(), "pallas_guard_xdist")


def unknown_settings(config: pytest.Config) -> list[str]:
    """The variables and ini keys that look like pallas_guard's but are not (a misspelling would
    otherwise read as "nothing set"), each with the closest known name."""
    known = [option.ini for option in OPTIONS.values()] + ["pallas_guard_over_budget"]
    sentences = list(pallas_guard_autoload.unknown_variables())
    # pytest's own list of the ini keys no plugin declared (it warns "Unknown config option" too);
    # private, so read where it exists (pytest 7 to 9) and skipped where it does not.
    unknown_keys: list[str] = getattr(config, "_get_unknown_ini_keys", list)()
    for key in sorted(k for k in unknown_keys if str(k).startswith("pallas_guard")):
        near = pallas_guard_autoload.closest(str(key), known)
        hint = f"; did you mean {near}?" if near else ""
        sentences.append(
            f"{key} in {config.inipath.name if config.inipath else 'ini'} is not a pallas_guard setting{hint}"
        )
    return sentences


def pytest_report_header(config: pytest.Config) -> str | list[str]:
    session = config.stash[_KEY]
    unknown = [printable(f"pallas_guard: warning: {sentence}") for sentence in unknown_settings(config)]
    if not session.active:
        return [
            "pallas_guard: inactive (give a policy with --pallas-guard-policy, the pallas_guard_policy ini "
            f"setting or {POLICY_ENV})",
            *unknown,
        ]
    from pallas_guard._deciding import target as _target
    from pallas_guard._vocabulary import settings as _settings

    target = _target.detect()
    where = target.platform or "decided when each kernel lowers"
    settings = []
    for name, option in OPTIONS.items():
        setting = _settings.current(name)
        settings.append(f"{name.replace('_', ' ')} {option.word(setting.value)} (from {setting.source})")
    from pallas_guard._surfaces import install as _install

    armed = _install.arm()  # found by arming, as the tests' import of Pallas would
    lines = [
        printable(f"pallas_guard: {', '.join(settings)}, target {where} ({'; '.join(target.evidence)})"),
        printable(f"pallas_guard: {armed.text}"),
        f"pallas_guard: Pallas kernels here will {_outcome().text}"
        if armed.armed
        else "pallas_guard: Pallas kernels here will NOT run interpreted: the guard is not armed (above)",
    ]
    from pallas_guard._surfaces.cli import installation_notices  # the same notices as doctor's

    lines.extend(f"pallas_guard: notice: {printable(notice)}" for notice in installation_notices())
    return lines + unknown


# --- the marker -----------------------------------------------------------------------------------


class _Marked(NamedTuple):
    """The merged ``@pytest.mark.pallas_guard`` arguments of one test (the closest of each wins)."""

    settings: dict[str, Any]
    """Option name -> the value given (validated), for a ``pallas_guard.policy(...)`` scope."""
    skip: str | None
    xfail: str | None


_MARKER_SIGNATURE = (
    "(policy=None, *, " + ", ".join(f"{key}=None" for key in (*list(OPTIONS)[1:], *_MARKER_ACTIONS)) + ")"
)


def _marker_arguments(item: pytest.Item, marker: pytest.Mark) -> dict[str, Any]:
    __tracebackhide__ = True
    where = f"@pytest.mark.pallas_guard on {item.nodeid}"
    unknown = set(marker.kwargs) - set(OPTIONS) - set(_MARKER_ACTIONS)
    if len(marker.args) > 1 or unknown or ("policy" in marker.kwargs and marker.args):
        raise pytest.UsageError(
            f"pallas_guard: {where} takes {_MARKER_SIGNATURE}, got args {marker.args!r} kwargs {marker.kwargs!r}"
        )
    given = dict(marker.kwargs)
    if marker.args:
        given["policy"] = marker.args[0]
    arguments = {}
    for key, value in given.items():
        if value is None:
            continue
        if key in _MARKER_ACTIONS:
            if not isinstance(value, str) or not value.strip():
                raise pytest.UsageError(
                    f"pallas_guard: {where}: {key}= takes the reason to report (a non-empty str), "
                    f"got {type(value).__name__} {value!r}"
                )
        else:
            _parse(key, value, where if key == "policy" else f"{where} ({key}=)")
        arguments[key] = value
    return arguments


def _marked(item: pytest.Item) -> _Marked | None:
    """The test's ``pallas_guard`` markers (function, class, module), merged: the closest of each
    argument wins. A bad argument is a usage error naming the test."""
    __tracebackhide__ = True
    markers = list(item.iter_markers("pallas_guard"))
    if not markers:
        return None
    merged: dict[str, Any] = {}
    for marker in markers:  # closest first
        for key, value in _marker_arguments(item, marker).items():
            merged.setdefault(key, value)
    settings = {key: value for key, value in merged.items() if key in OPTIONS}
    return _Marked(settings, merged.get("skip_interpreted"), merged.get("xfail_interpreted"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    for item in items:
        _marked(item)  # a bad marker value stops the run before any test, naming the test


def _outcome() -> Any:
    """What the guard does here to a kernel written for GPU/TPU (``_settings.outcome``, as ``doctor``
    says it); an unknown target with no accelerator plugin installed is the CPU, as the plan decides."""
    from pallas_guard._deciding import target as _target
    from pallas_guard._vocabulary import settings as _settings

    target = _target.detect()
    platform = target.platform
    if platform is None and not _target.installed_accelerator_plugins():
        platform = "cpu"
    policy, interpreter = _settings.current_policy().value, _settings.current_interpreter().value
    return _settings.outcome(policy.value, interpreter.value, platform)


def _runs_interpreted() -> bool:
    """Whether the guard would run an unmarked kernel interpreted here (target CPU, policy interpret or warn)."""
    return bool(_outcome().interpreted)


@pytest.fixture(autouse=True)
def _pallas_guard_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Apply ``@pytest.mark.pallas_guard`` to this test: a ``pallas_guard.policy()`` scope, and
    ``skip_interpreted``/``xfail_interpreted`` where the guard runs its kernels interpreted."""
    marked = _marked(request.node)
    # Only skip/xfail arguments and no guard in this session: nothing runs interpreted; as written.
    if marked is None or (not marked.settings and not _guard_requested()):
        yield
        return
    __tracebackhide__ = True  # a failure is the test's, not this fixture's
    installed_here = not _guard_requested()
    try:
        import pallas_guard as guard
        from pallas_guard._vocabulary import settings as _settings
    except (ValueError, TypeError) as error:  # a bad PALLAS_GUARD_* variable
        raise pytest.UsageError(f"pallas_guard: {error}") from None
    if installed_here:
        guard.install()
    # The scope's source names the marker, so advice and the step-budget error point at it.
    source = f"@pytest.mark.pallas_guard on {request.node.nodeid}"
    try:
        with _settings.scope(_settings.given(marked.settings, call="@pytest.mark.pallas_guard", source=source)):
            if (marked.skip or marked.xfail) and _runs_interpreted():
                if marked.skip:
                    raise pytest.skip.Exception(marked.skip, _use_item_location=True)
                # Seen by pytest's call phase, which evaluates xfail marks again when setup found none.
                request.node.add_marker(pytest.mark.xfail(reason=str(marked.xfail)))
            yield
    finally:
        if installed_here:
            guard.uninstall()


# --- over the step budget: fail (default) or skip ----------------------------------------------------


def _over_budget_error(error: BaseException | None) -> BaseException | None:
    """The guard's over-budget error in ``error`` or its chain (``__cause__``, ``__context__``)."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if getattr(current, "pallas_guard_over_budget", False):
            return current
        stack.extend((current.__context__, current.__cause__))
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """A test whose host code asked which TPU/GPU it runs on and got the CPU: its error gains a note
    naming the device setting that answers it (the error keeps its type). A guard's error is
    reported once, at the user's line: JAX's repetitions of it dropped."""
    __tracebackhide__ = True
    try:
        return (yield)
    except Exception as error:
        if "pallas_guard" not in sys.modules:
            raise
        from pallas_guard._deciding import diagnostics as _diagnostics
        from pallas_guard._guard.frontdoor import note_which_accelerator

        session = item.config.stash.get(_KEY, None)
        if session is not None and session.active:
            note_which_accelerator(error)
        # The guard's own error, once, where JAX repeats it or carries it inside its runtime error.
        shown = _diagnostics.as_reported(error)
        if shown is not error:
            raise shown from None
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    __tracebackhide__ = True
    report: pytest.TestReport = yield
    if (
        report.failed
        and report.when in ("setup", "call")
        and call.excinfo is not None
        and item.config.stash[_KEY].over_budget == "skip"
    ):
        error = _over_budget_error(call.excinfo.value)
        if error is not None:
            path, line = item.reportinfo()[:2]
            report.outcome = "skipped"
            report.longrepr = (os.fspath(path), (line or 0) + 1, f"Skipped: {error}")
    return report


# --- records and the summary ------------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    session = item.config.stash[_KEY]
    session.take(OUTSIDE_TESTS)
    yield
    session.take(item.nodeid)


class _Durations:
    """Records each test's call-phase duration (``report.duration``); under xdist the controller
    receives every worker's reports, so its summary has them all."""

    def __init__(self, state: _Session) -> None:
        self.state = state

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.state.durations[report.nodeid] = report.duration


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash[_KEY]
    state.take(OUTSIDE_TESTS)
    if state.active and any(name in sys.modules for name in pallas_guard_autoload.PALLAS_MODULES):
        from pallas_guard._surfaces import (
            install as _install,  # Pallas was imported here: the guard armed, or says why not
        )

        state.armed.append(_install.arm()._asdict())
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: hand the rows to the controller
        workeroutput[_WORKER_KEY] = state.rows
        workeroutput["pallas_guard_active"] = state.active
        workeroutput["pallas_guard_armed"] = state.armed


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
        state.armed.extend(output.get("pallas_guard_armed", ()))


def armed_lines(states: list[dict[str, Any]]) -> list[str]:
    """Whether the guard was armed in every process that imported Pallas: each distinct failure once."""
    if not states:
        return ["guard: no process of this run imported Pallas"]
    unarmed = Counter(state["text"] for state in states if not state["armed"])
    if not unarmed:
        return [printable(f"guard armed in {len(states)} process(es) that imported Pallas: {states[0]['text']}")]
    return [printable(f"guard {text} (in {count} of {len(states)} process(es))") for text, count in unarmed.items()]


def summary_lines(rows: list[dict[str, Any]], *, details: bool) -> list[str]:
    """The terminal summary: counts by outcome and interpreter, the tests, and (``details``) each kernel."""
    actions = Counter(row["action"] for row in rows)
    interpreters = Counter(row["interpreter"] or "?" for row in rows if row["action"] == "interpreted")
    by_interpreter = ", ".join(f"{name}: {count}" for name, count in sorted(interpreters.items()))
    tests = sorted({row["test"] for row in rows})
    kernels = [row for row in rows if row["action"] != "found"]  # a finding is about a kernel counted already
    lines = [
        f"{len(kernels)} Pallas kernel(s): {actions['interpreted']} interpreted"
        + (f" ({by_interpreter})" if by_interpreter else "")
        + f", {actions['refused']} refused, {actions['untouched']} left alone; in {len(tests)} test(s)"
    ]
    found = Counter(row.get("check") or "?" for row in rows if row["action"] == "found")
    if found:  # every finding of every check, counted where the refusals are
        by_check = ", ".join(f"{check}: {count}" for check, count in sorted(found.items()))
        lines[0] += f"; {sum(found.values())} finding(s) ({by_check})"
    if not rows:
        return lines
    # What a compile gave is a figure per kernel (the memory lines name the kernel), not a note.
    notes = Counter(note for row in rows for note in row.get("notes") or () if not note.startswith(_COMPILED))
    for note, count in notes.items():  # each distinct note once, with how many kernels it concerns
        lines.append(printable(f"note ({count} kernel(s)): {note}"))
    # An agree verdict is no note (it is in the reason sentence): counted the same way here.
    verdicts = Counter(v for row in rows for v in row.get("checks") or () if v.startswith("agree:"))
    for verdict, count in verdicts.items():
        lines.append(printable(f"check ({count} kernel(s)): {verdict}"))
    if not details:
        shown = ", ".join(tests[:5]) + (f" and {len(tests) - 5} more" if len(tests) > 5 else "")
        lines.append(printable(f"from {shown} (--pallas-guard-details lists each kernel)"))
        return lines
    for row in sorted(rows, key=lambda r: (r["test"], r["action"], r["kernel"])):
        how = f" with the {row['interpreter']} interpreter" if row["action"] == "interpreted" else ""
        how = f" by the {row.get('check')} check" if row["action"] == "found" else how
        steps = f", {_steps(row.get('steps'))}" if row.get("steps") is not None else ""
        lines.append(
            printable(
                f"{row['action'].upper()}{how} {row['test']}: {row['kernel']} ({row['entry_point']}, defined at "
                f"{row['defined_at'] or '?'}, called at {row['called_at'] or '?'}{steps}): {row['why']}"
            )
        )
        if row.get("checks"):  # the checks' verdicts on this kernel, in one short line under it
            lines.append(printable(f"    checks of {row['kernel']}: {'; '.join(row['checks'])}"))
    return lines


def _steps(steps: int | None) -> str:
    return "grid steps unknown" if steps is None else f"{steps} grid step{'s' if steps != 1 else ''}"


def duration_lines(rows: list[dict[str, Any]], durations: dict[str, float], *, count: int) -> list[str]:
    """The slowest tests that ran interpreted kernels (``count``; 0: all), slowest first: the
    test's call-phase duration, its id, and its kernels with interpreter and grid steps."""
    kernels: dict[str, Counter[str]] = {}
    whys: dict[str, dict[str, None]] = {}
    for row in rows:
        if row["action"] == "interpreted" and row["test"] != OUTSIDE_TESTS:
            steps = row.get("steps")
            counted = "grid steps unknown" if steps is None else f"{steps} step{'s' if steps != 1 else ''}"
            compiled = [
                f"compiled for {m.group(1)} in {m.group(2)} s"
                for m in _COMPILE_TOOK.finditer(" ".join(row.get("notes") or ()))
            ]
            what = f"{row['kernel']} ({', '.join([row['interpreter'] or '?', counted, *compiled])})"
            kernels.setdefault(row["test"], Counter())[what] += 1
            whys.setdefault(row["test"], {})[f"{row['kernel']}: {row['why']}"] = None
    if not kernels:
        return []
    slowest = sorted(kernels, key=lambda test: (-durations.get(test, 0.0), test))
    shown = slowest if count == 0 else slowest[:count]
    more = len(slowest) - len(shown)
    lines = [
        f"slowest {len(shown)} of {len(slowest)} test(s) that ran interpreted kernels"
        + (f" (--pallas-guard-durations=0 lists all {len(slowest)})" if more else "")
        + ":"
    ]
    for test in shown:
        took = f"{durations[test]:.2f}s" if test in durations else "?s"
        listed = ", ".join(what + (f" x{n}" if n > 1 else "") for what, n in sorted(kernels[test].items()))
        lines.append(printable(f"{took:>8} {test}: {listed}"))
        lines.extend(printable(f"{'':>8}   why {why}") for why in whys[test])
    return lines


def _memory(state: _Session, config: pytest.Config, *, details: bool) -> list[str]:
    """The compile check's memory figures (TPU and GPU): lines for the summary; the report and the
    step summary written."""
    path = config.getoption("pallas_guard_report")
    if not path and not any(row.get("memory") for row in state.rows):
        return []
    from pallas_guard._surfaces import report as _report

    found = _report.bars(state.rows)
    shown = _report.lines(found, count=None if details else _MEMORY_LINES)
    compiles = [
        part
        for row in state.rows
        for note in row.get("notes") or ()
        if note.startswith(_COMPILED)
        for part in note[len(_COMPILED) :].split("; ")
    ]
    if compiles:  # what the on-disk cache saved this run
        cached = sum("(cached: " in part for part in compiles)
        shown.append(f"compile cache: {cached} of {len(compiles)} compile(s) read from earlier runs")
    if path:
        try:
            _report.write(path, found)
            shown.append(printable(f"report: {path}"))
        except OSError as error:
            shown.append(printable(f"report: not written to {path}: {error}"))
    if _report.append_step_summary(found):
        shown.append("report: appended to $GITHUB_STEP_SUMMARY")
    return shown


_COMPILED = "compile: compiles for "
# A GPU compile's time in its note (``compile.COMPILE_TOOK``): ptxas is the long pole of a slow test.
_COMPILE_TOOK = re.compile(r"(?:compiles for |; )([\w-]+)[^;]*?\(XLA's compile: ([\d.]+) s\)")
_MEMORY_LINES = 10
"""Memory figures the summary shows without --pallas-guard-details: the tightest."""


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash[_KEY]
    if not state.active and not state.rows:
        return
    terminalreporter.write_sep("=", "pallas_guard summary")
    for line in armed_lines(state.armed):
        terminalreporter.write_line(line)
    details = bool(config.getoption("pallas_guard_details"))
    for line in summary_lines(state.rows, details=details):
        terminalreporter.write_line(line)
    for line in _memory(state, config, details=details):
        terminalreporter.write_line(line)
    count = config.getoption("pallas_guard_durations")
    for line in duration_lines(state.rows, state.durations, count=DURATIONS_DEFAULT if count is None else count):
        terminalreporter.write_line(line)
