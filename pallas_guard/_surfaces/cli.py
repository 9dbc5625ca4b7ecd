"""The ``pallas-guard`` command: ``doctor``, ``run``, ``demo`` and ``--version``.

Every setting goes through the parsers of ``pallas_guard_autoload.OPTIONS`` and every activation
through ``install()`` (in ``run``'s children, through the autoload's ``.pth``/``.start`` entry point,
whose import hook imports the package, which calls it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from typing import Any

import pallas_guard_autoload
from pallas_guard._deciding import target as _target
from pallas_guard._jax import config as jax_config
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import source as jax_source
from pallas_guard._surfaces import install as _install
from pallas_guard._vocabulary import settings as _settings
from pallas_guard_autoload import OPTIONS, POLICY_ENV, printable

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""``doctor``: the environment contradicts itself (listed under "problems")."""
EXIT_USAGE = 2
"""Bad arguments or a bad ``PALLAS_GUARD_*`` value given to ``run`` (argparse's code)."""

_PROG = "pallas-guard"
START_FILES = ("pallas_guard_autoload.pth", "pallas_guard_autoload.start")
"""What the wheel installs at the top of site-packages: the start-up hooks for Python < 3.15 and >= 3.15."""


def installed_startup_files() -> list[str]:
    """The autoload files the running interpreter's ``site`` processes at start-up."""
    import site

    directories = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    return [
        os.path.join(directory, name)
        for directory in dict.fromkeys(directories)
        for name in START_FILES
        if os.path.isfile(os.path.join(directory, name))
    ]


# --- doctor ---------------------------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _settings_report(problems: list[str]) -> dict[str, Any]:
    """The settings new processes get from the environment, and this process's, with sources.

    Each option is read on its own, so one bad variable is one problem on its own row, and the
    other settings still show their values (from the environment or the default)."""
    variables = [env for option in OPTIONS.values() for env in option.variables()]
    settings: dict[str, Any] = {"environment": {env: os.environ.get(env) for env in variables}}
    errors = {}
    for name, option in OPTIONS.items():
        try:
            option.from_environment()
        except (ValueError, TypeError) as error:
            errors[name] = str(error)
            problems.append(str(error))
    for name, option in OPTIONS.items():
        if name in errors:
            settings[f"{name}_error"] = errors[name]
            continue
        if errors:  # the process values cannot load: this option as the environment alone sets it
            found = option.setting_from_environment()
            value, source = found if found is not None else (option.default, "default")
        else:
            value, source = _settings.current(name)
        settings[name] = {"value": option.word(value), "source": source}
    return settings


# What pytest reads its configuration from, in its order of precedence within one directory.
_PYTEST_FILES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def _pytest_section(path: str) -> dict[str, Any] | None:
    """The pytest settings in ``path``, or None when it has no pytest section (pytest skips it)."""
    name = os.path.basename(path)
    if name.endswith(".toml"):
        import tomllib

        with open(path, "rb") as file:
            data = tomllib.load(file)
        if name == "pyproject.toml":
            table = data.get("tool", {}).get("pytest", {})
            table = table.get("ini_options", table) if isinstance(table, dict) else None
            return table if isinstance(table, dict) and "tool" in data and "pytest" in data["tool"] else None
        return dict(data.get("pytest", {}))
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path, encoding="utf-8")
    section = {"setup.cfg": "tool:pytest"}.get(name, "pytest")
    if parser.has_section(section):
        return dict(parser.items(section))
    return {} if name in ("pytest.ini", ".pytest.ini") else None  # pytest.ini counts even when empty


def pytest_configuration(start: str) -> tuple[str, dict[str, str]] | None:
    """The configuration file pytest would read, started in ``start`` (the first with a pytest
    section, in ``start`` or the nearest directory above it), and its ``pallas_guard_*`` values."""
    directory = os.path.abspath(start)
    while True:
        for name in _PYTEST_FILES:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                continue
            try:
                section = _pytest_section(path)
            except (OSError, ValueError) as error:  # unreadable: pytest would stop on it too
                return path, {"error": f"{type(error).__name__}: {error}"}
            if section is not None:
                values = {}
                for option_name, option in OPTIONS.items():
                    value = section.get(option.ini)
                    if value is not None and value != "":
                        values[option_name] = ",".join(map(str, value)) if isinstance(value, list) else str(value)
                return path, values
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def _pytest_report(problems: list[str]) -> dict[str, Any]:
    """What pytest, run here, would take from its configuration file: each value with its source,
    in the words of pytest's own report header."""
    found = pytest_configuration(os.getcwd())
    if found is None:
        return {"file": None, "settings": {}}
    path, values = found
    if "error" in values:
        problems.append(f"pytest's configuration {path} cannot be read: {values['error']}")
        return {"file": path, "settings": {}}
    settings = {}
    for name, value in values.items():
        source = f"{OPTIONS[name].ini} in {os.path.basename(path)}"
        try:
            parsed = OPTIONS[name].parse(value, source)
        except (ValueError, TypeError) as error:
            problems.append(str(error))  # pytest stops with a usage error on it: no value to show
            continue
        settings[name] = {"value": OPTIONS[name].word(parsed), "source": source}
    return {"file": path, "settings": settings}


def _jax_facts(problems: list[str]) -> dict[str, Any]:
    facts: dict[str, Any] = {"jax": _distribution_version("jax"), "jaxlib": _distribution_version("jaxlib")}
    if facts["jax"] is None or jax_lookup.import_optional("jax") is None:
        problems.append("jax is not installed (or does not import): there are no Pallas kernels to guard here.")
        facts["installed"] = False
        return facts
    facts["installed"] = True
    facts["config"] = {
        "jax_platforms": jax_config.jax_config_value("jax_platforms"),
        "jax_default_device": repr(jax_config.jax_config_value("jax_default_device")),
        "forced_interpret_mode": repr(jax_config.forced_interpret_value()),
    }
    target = _target.detect()  # before initialising: what the guard sees at trace time
    facts["configured_target"] = {"platform": target.platform, "evidence": list(target.evidence)}
    import jax

    backends: dict[str, Any] = {"initialised_by": "doctor (jax.devices(); pallas_guard itself never initialises)"}
    try:
        devices = jax.devices()
        backends["default_backend"] = str(jax.default_backend())
        backends["devices"] = [f"{device.platform}:{device.id} ({device.device_kind})" for device in devices]
    except Exception as error:
        backends["error"] = _error_text(error)
        problems.append(f"JAX could not initialise a backend: {backends['error']}")
    facts["backends"] = backends
    return facts


def _error_text(error: BaseException) -> str:
    """``Type: message``; for an error without a message (jaxlib's bare asserts), where it was raised."""
    text = str(error).strip()
    if text:
        return f"{type(error).__name__}: {text}"
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    where = f" at {traceback.tb_frame.f_code.co_filename}:{traceback.tb_lineno}" if traceback is not None else ""
    return f"{type(error).__name__} without a message, raised{where}"


def _verdict(report: dict[str, Any]) -> str:
    jax_facts = report["jax"]
    if not jax_facts.get("installed"):
        return "jax is not installed: there are no Pallas kernels to guard here."
    settings = report["settings"]
    if any(key.endswith("_error") for key in settings):
        return (
            "A PALLAS_GUARD_* value is invalid (see problems): with the autoload, new Python processes print "
            "one line at start-up and keep the guard, whose first Pallas kernel raises the error; "
            "`import pallas_guard` raises it at once."
        )
    backends = jax_facts["backends"]
    configured = jax_facts["configured_target"]["platform"]
    platform = backends.get("default_backend")
    if platform is None:
        if configured is not None and configured != "cpu":
            return (
                f"JAX is configured for {configured} but could not initialise it ({backends.get('error')}): "
                "Pallas kernels here fail before the guard is involved. Install that platform's plugin, "
                "or set JAX_PLATFORMS=cpu (or unset it) to run on the CPU."
            )
        return "JAX could not initialise a backend, so where Pallas kernels lower is unknown."
    env_policy = pallas_guard_autoload.guard_wanted()  # PALLAS_GUARD_POLICY, or PALLAS_INTERPRET
    policy = str(OPTIONS["policy"].from_environment() or OPTIONS["policy"].default)
    outcome = _settings.outcome(policy, settings["interpreter"]["value"], platform).text
    if platform != "cpu":
        return f"Pallas kernels here will {outcome}."
    if env_policy and report["autoload"]["installed"]:
        where = "in every Python process (the environment's policy, with the autoload)"
    elif env_policy:
        where = "in processes that import pallas_guard (the autoload is not installed)"
    else:
        where = f"in processes that import pallas_guard; elsewhere JAX's own error ({POLICY_ENV} is unset)"
    verdict = f"Pallas kernels here will {outcome} {where}."
    in_pytest = report["pytest"]["settings"]
    if "policy" in in_pytest or "interpreter" in in_pytest:
        policy = in_pytest.get("policy", {}).get("value", policy)
        interpreter = in_pytest.get("interpreter", {}).get("value", settings["interpreter"]["value"])
        source = os.path.basename(report["pytest"]["file"])
        verdict += f" In pytest runs started here ({source}): {_settings.outcome(policy, interpreter, platform).text}."
    return verdict


def collect() -> dict[str, Any]:
    """Everything ``doctor`` reports, JSON-ready. Initialises JAX's backends (to list them)."""
    problems: list[str] = []
    package_dir = jax_source.PACKAGE_DIR
    report: dict[str, Any] = {
        "pallas_guard": {"version": _distribution_version("pallas_guard"), "location": package_dir},
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "settings": _settings_report(problems),
        "pytest": _pytest_report(problems),
    }
    start_files = installed_startup_files()
    report["autoload"] = {"installed": bool(start_files), "files": start_files}
    if pallas_guard_autoload.guard_wanted() and not start_files:
        problems.append(
            f"{POLICY_ENV} is set but the autoload ({', '.join(START_FILES)}) is not installed for "
            f"{sys.executable}: only processes that import pallas_guard are guarded."
        )
    report["accelerators"] = {
        "plugins": list(_target.installed_accelerator_plugins()),
        "nvidia_gpu_marker": _target.nvidia_gpu_marker(),
        "evidence": _target.accelerator_evidence(),
    }
    if any(line.startswith("!!") for line in report["accelerators"]["evidence"]):
        problems.append("An NVIDIA GPU seems present but no CUDA plugin is installed: JAX falls back to the CPU.")
    report["jax_platforms_env"] = os.environ.get("JAX_PLATFORMS")
    report["jax"] = _jax_facts(problems)
    problems.extend(pallas_guard_autoload.unknown_variables())
    # Found by arming, as a user's import of Pallas would: never assumed from the settings.
    armed = (
        _install.arm() if report["jax"].get("installed") else _install.Armed(False, "not armed: jax is not installed")
    )
    report["armed"] = armed._asdict()
    if report["jax"].get("installed") and not armed.armed:
        problems.append(f"The guard is not armed in this process: {armed.text}")
    report["guard_in_this_process"] = dataclasses.asdict(_install.status())
    report["notices"] = installation_notices() if report["jax"].get("installed") else []
    report["verdict"] = _verdict(report)
    report["problems"] = problems
    report["exit_code"] = EXIT_PROBLEMS if problems else EXIT_OK
    return report


def installation_notices() -> list[str]:
    """What concerns the installation rather than a kernel: a jax past the tested range, a JAX
    internal not found. ``doctor`` and the pytest header show them; neither is ever a warning (one
    while pytest configures would stop a ``filterwarnings = error`` session)."""

    notice = jax_lookup.tested_range_notice()
    missing = [f"JAX internal {name!r} not found: {why}" for name, why in sorted(jax_lookup.missing.items())]
    return ([notice] if notice else []) + missing


def _setting_line(settings: dict[str, Any], key: str) -> str:
    if f"{key}_error" in settings:  # the full error once, under problems
        return f"INVALID: {settings[f'{key}_error'].partition(' is not a valid ')[0]} (see problems)"
    value = settings[key]
    return f"{value['value']} (from {value['source']})"


def render(report: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [
        ("pallas_guard", f"{report['pallas_guard']['version']} ({report['pallas_guard']['location']})"),
        ("python", f"{report['python']['version']} ({report['python']['executable']})"),
    ]
    jax_facts = report["jax"]
    if jax_facts.get("installed"):
        rows.append(("jax / jaxlib", f"{jax_facts['jax']} / {jax_facts['jaxlib']}"))
    else:
        rows.append(("jax / jaxlib", "NOT INSTALLED"))
    accelerators = report["accelerators"]
    rows.append(("plugins", ", ".join(accelerators["plugins"]) or "none installed"))
    rows.append(("nvidia device", accelerators["nvidia_gpu_marker"] or "none found"))
    jax_platforms = report["jax_platforms_env"]
    rows.append(("JAX_PLATFORMS", "unset" if jax_platforms is None else repr(jax_platforms)))
    if jax_facts.get("installed"):
        rows.append(("jax.config", ", ".join(f"{k}={v!r}" for k, v in jax_facts["config"].items())))
        target = jax_facts["configured_target"]
        rows.append(("target (config)", f"{target['platform'] or 'unknown'}: {'; '.join(target['evidence'])}"))
        backends = jax_facts["backends"]
        found = backends.get("error") or f"default {backends['default_backend']}; {', '.join(backends['devices'])}"
        rows.append(("backends", f"{found} [initialised by doctor; pallas_guard itself never does]"))
    settings = report["settings"]
    environment = ", ".join(f"{name}={value!r}" for name, value in settings["environment"].items() if value is not None)
    rows.append(("environment", environment or "no PALLAS_GUARD_* variable set"))
    in_pytest = report["pytest"]["settings"]
    for name in OPTIONS:
        line = _setting_line(settings, name)
        if name in in_pytest:  # pytest's ini wins over the environment, in pytest only
            given = in_pytest[name]
            line += f"; in pytest here: {given['value']} (from {given['source']})"
        rows.append((name.replace("_", " "), line))
    config = report["pytest"]["file"]
    if config is None:
        found = "none found here or above (pytest would use the environment alone)"
    elif in_pytest:
        found = (
            f"{config}: its pallas_guard_* settings win over the environment in pytest runs started here; "
            "a --pallas-guard-* option wins over both"
        )
    else:
        found = f"{config}: no pallas_guard_* setting"
    rows.append(("pytest config", found))
    autoload = report["autoload"]
    rows.append(
        (
            "autoload",
            f"installed: {', '.join(autoload['files'])} (active when {POLICY_ENV} is set or PALLAS_INTERPRET is truthy)"
            if autoload["installed"]
            else f"not installed ({', '.join(START_FILES)} not in this Python's site-packages)",
        )
    )
    rows.append(("guard", report["armed"]["text"]))
    width = max(len(name) for name, _ in rows)
    lines = ["pallas-guard doctor", *(f"  {name:<{width}}  {value}" for name, value in rows)]
    lines.extend(f"  {line}" for line in accelerators["evidence"])
    if report.get("notices"):
        lines.append("notices:")
        lines.extend(f"  - {notice}" for notice in report["notices"])
    if report["problems"]:
        lines.append("problems:")
        lines.extend(f"  - {problem}" for problem in report["problems"])
    lines.append(f"verdict: {report['verdict']}")
    # Values from the environment (JAX_PLATFORMS, a variable's value) must not drive the terminal.
    return "\n".join(printable(line) for line in lines)


def _doctor(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return int(report["exit_code"])


# --- run --------------------------------------------------------------------------------------------


def _run_option(name: str) -> str:
    return "--" + name.replace("_", "-")


def guarded_environment(
    policy: str | None = None,
    interpreter: str | None = None,
    base: dict[str, str] | None = None,
    **given: str | None,
) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the ``PALLAS_GUARD_*`` variables ``run`` sets: one per
    option given (``--policy``, ``--interpreter``, ``--checks``, ``--max-steps``: every OPTIONS row).

    The policy variable is always set (to the environment's own value, else the default), since
    it is what makes the ``.pth`` autoload activate the guard. Raises on a bad value.
    """
    env = dict(os.environ if base is None else base)
    pallas_guard_autoload.read_environment(env)  # validate every variable before handing it to every child
    given = {"policy": policy, "interpreter": interpreter, **given}
    for name, option in OPTIONS.items():
        value = given.get(name)
        if value is not None:
            option.parse(value, _run_option(name))
            env[option.env] = value.strip()
    env[pallas_guard_autoload.EXIT_SUMMARY_ENV] = "1"  # each guarded process prints its compile figures (TPU, GPU)
    if policy is None:
        env[POLICY_ENV] = str(OPTIONS["policy"].from_environment(env) or OPTIONS["policy"].default)
    else:
        env[POLICY_ENV] = OPTIONS["policy"].parse(policy, "--policy")
    return env


def _forward_and_wait(command: list[str], env: dict[str, str]) -> int:
    # Where exec cannot replace the process (Windows): wait, passing SIGINT/SIGTERM on.
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: object) -> None:
        del frame
        child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command.pop(0)
    if not command:
        parser.error("run needs a command after --, e.g. pallas-guard run -- pytest")
    try:
        env = guarded_environment(**{name: getattr(args, name) for name in OPTIONS})
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    if not installed_startup_files():
        sys.stderr.write(
            f"pallas-guard run: the autoload ({', '.join(START_FILES)}) is not installed for {sys.executable}; "
            "Python processes started by the command are guarded only if they import pallas_guard.\n"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name != "posix":
        return _forward_and_wait(command, env)
    try:
        # exec: the command takes over this process, so its signals and exit code are its own.
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        sys.stderr.write(f"pallas-guard run: command not found: {command[0]}\n")
        return 127
    except PermissionError as error:
        sys.stderr.write(f"pallas-guard run: cannot execute {command[0]}: {error}\n")
        return 126
    return 0  # pragma: no cover - execvpe does not return


# --- demo -------------------------------------------------------------------------------------------

DEMO_KERNEL = '''\
"""A Pallas kernel written for GPU: no interpret= anywhere."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


x = jnp.arange(8, dtype=jnp.float32)
try:
    y = pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
except Exception as error:
    print(f"raised {type(error).__module__}.{type(error).__qualname__}: {error}")
    raise SystemExit(1) from None
print("result:", y)
'''

DEMO_POLICIES = tuple(OPTIONS["policy"].meanings)


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        policies = [OPTIONS["policy"].parse(p, "--policy") for p in (args.policy or DEMO_POLICIES)]
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    autoload = bool(installed_startup_files())
    package_parent = os.path.dirname(jax_source.PACKAGE_DIR)
    with tempfile.TemporaryDirectory(prefix="pallas-guard-demo-") as directory:
        script = os.path.join(directory, "gpu_kernel.py")
        with open(script, "w", encoding="utf-8") as file:
            file.write(DEMO_KERNEL)
        print(f"A Pallas kernel written for GPU ({script}):\n")
        print(textwrap.indent(DEMO_KERNEL.split("\n\n\n", 1)[1].split("\n\n", 1)[0], "    "))
        print(f"\nrun under each policy, each in a fresh `{os.path.basename(sys.executable)}`", end="")
        print(" (activated by the autoload: the script does not import pallas_guard).\n" if autoload else ".\n")
        # Without the autoload, the child imports pallas_guard itself before running the script.
        launcher = (
            [sys.executable, script]
            if autoload
            else [sys.executable, "-c", f"import pallas_guard, runpy; runpy.run_path({script!r}, run_name='__main__')"]
        )
        children = []
        for policy in policies:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_")}
            env[POLICY_ENV] = policy
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
            env["PYTHONWARNINGS"] = "default"
            child = subprocess.Popen(
                launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=directory
            )
            children.append((policy, child))
        worst = EXIT_OK
        for policy, child in children:
            output, _ = child.communicate()
            print(f"=== {POLICY_ENV}={policy} python gpu_kernel.py   (exit status {child.returncode})")
            print(textwrap.indent(output.rstrip(), "  "), end="\n\n")
            if child.returncode not in (0, 1):
                worst = EXIT_PROBLEMS
    return worst


# --- the parser ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="pallas_guard: Pallas kernels written for GPU/TPU behave well where they would lower for the CPU.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {version()}")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="{doctor,run,demo}")
    doctor = commands.add_parser(
        "doctor",
        help="report jax, plugins, backends, the policy in effect and where it came from",
        description=(
            "Report what decides where Pallas kernels run here, with a one-line verdict. Initialises "
            "JAX's backends to list them (pallas_guard itself never does). Exit status: 0 healthy, "
            f"{EXIT_PROBLEMS} when the environment contradicts itself (listed under 'problems'), "
            f"{EXIT_USAGE} for bad arguments."
        ),
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(subparser=doctor)
    run = commands.add_parser(
        "run",
        help="run a command with the guard active in it and its Python children",
        description=(
            f"Run COMMAND with {POLICY_ENV} (and the variable of each option given) set, so the autoload "
            "activates the guard in every Python process it starts. The command replaces pallas-guard "
            "(exec): its exit status and signals are its own."
        ),
        usage=f"{_PROG} run [-h] "
        + " ".join(f"[{_run_option(name)} {name.upper()}]" for name in OPTIONS)
        + " -- COMMAND [ARG ...]",
    )
    for name, option in OPTIONS.items():  # one option per setting, in the words of its row
        run.add_argument(
            _run_option(name),
            dest=name,
            metavar=name.upper(),
            # argparse formats help with %: a literal one ("5%") is written %%.
            help=f"{option.help}; accepted: {option.accepted} (default: ${option.env}, else "
            f"{option.word(option.default)})".replace("%", "%%"),
        )
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    run.set_defaults(subparser=run)
    demo = commands.add_parser(
        "demo",
        help="run a kernel written for GPU on this machine under each policy",
        description="Run a Pallas kernel written for GPU (no interpret=) under each policy, each in a fresh process.",
    )
    demo.add_argument(
        "--policy", action="append", help=f"only this policy (repeatable; default: {', '.join(DEMO_POLICIES)})"
    )
    demo.set_defaults(subparser=demo)
    return parser


def version() -> str:
    """This package's version, as installed (its distribution's metadata)."""
    return _distribution_version("pallas_guard") or "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``pallas-guard``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.subcommand == "doctor":
        return _doctor(args)
    if args.subcommand == "run":
        return _run(args, args.subparser)
    return _demo(args, args.subparser)
