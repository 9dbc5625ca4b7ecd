"""The ``pallas-guard`` command: ``doctor``, ``run`` and ``demo``.

Every setting goes through ``_policy``'s parsers and every activation through ``install()`` (here,
in ``run``'s children, through the ``.pth`` autoload, which calls it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from typing import Any

from . import _autoload, _install, _policy, _target

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""``doctor``: the environment contradicts itself (listed under "problems")."""
EXIT_USAGE = 2
"""Bad arguments or a bad ``PALLAS_GUARD_*`` value given to ``run`` (argparse's code)."""

_PROG = "pallas-guard"
_ENV_NAMES = (_policy.POLICY_ENV, _policy.INTERPRETER_ENV, _policy.DETECT_RACES_ENV)


# --- doctor ---------------------------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _settings(problems: list[str]) -> dict[str, Any]:
    """The settings new processes get from the environment, and this process's, with sources."""
    settings: dict[str, Any] = {"environment": {name: os.environ.get(name) for name in _ENV_NAMES}}
    for key, reader in (
        ("policy", _policy.policy_from_env),
        ("interpreter", _policy.interpreter_from_env),
        ("detect_races", _policy.detect_races_from_env),
    ):
        try:
            reader()
        except (ValueError, TypeError) as error:
            problems.append(str(error))
            settings[f"{key}_error"] = str(error)
    policy, interpreter = _policy.current_policy(), _policy.current_interpreter()
    settings["policy"] = {"value": policy.value.value, "source": policy.source}
    settings["interpreter"] = {"value": interpreter.value.value, "source": interpreter.source}
    settings["detect_races"] = _policy.detect_races()
    return settings


def _jax_facts(problems: list[str]) -> dict[str, Any]:
    from . import _internals

    facts: dict[str, Any] = {"jax": _distribution_version("jax"), "jaxlib": _distribution_version("jaxlib")}
    if facts["jax"] is None or _internals.import_optional("jax") is None:
        problems.append("jax is not installed (or does not import): there are no Pallas kernels to guard here.")
        facts["installed"] = False
        return facts
    facts["installed"] = True
    facts["config"] = {
        "jax_platforms": _internals.jax_config_value("jax_platforms"),
        "jax_default_device": repr(_internals.jax_config_value("jax_default_device")),
        "forced_interpret_mode": repr(_internals.forced_interpret_value()),
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
        backends["error"] = f"{type(error).__name__}: {error}"
        problems.append(f"JAX could not initialise a backend: {backends['error']}")
    facts["backends"] = backends
    return facts


def _verdict(report: dict[str, Any]) -> str:
    jax_facts = report["jax"]
    if not jax_facts.get("installed"):
        return "jax is not installed: there are no Pallas kernels to guard here."
    settings = report["settings"]
    if any(key.endswith("_error") for key in settings):
        return (
            "A PALLAS_GUARD_* value is invalid: new Python processes run without the guard "
            "(their start-up prints one line saying so) and `import pallas_guard` raises."
        )
    platform = jax_facts["backends"].get("default_backend") or jax_facts["configured_target"]["platform"]
    if platform is None:
        return "JAX could not initialise a backend, so where Pallas kernels lower is unknown."
    if platform != "cpu":
        return f"Pallas kernels here will compile for {platform}: the guard changes nothing."
    env_policy = settings["environment"][_policy.POLICY_ENV]
    policy = _policy.parse_policy(env_policy) if env_policy and env_policy.strip() else _policy.DEFAULT_POLICY
    interpreter = settings["interpreter"]["value"]
    outcome = {
        _policy.Policy.INTERPRET: f"run interpreted on cpu (interpreter {interpreter}) under policy interpret",
        _policy.Policy.WARN: f"run interpreted on cpu (interpreter {interpreter}) under policy warn",
        _policy.Policy.STRICT: "be refused on cpu with a diagnostic under policy strict",
        _policy.Policy.OFF: "fail on cpu with JAX's own error under policy off",
    }[policy]
    if env_policy and report["autoload"]["installed"]:
        where = f"in every Python process ({_policy.POLICY_ENV} with the autoload)"
    elif env_policy:
        where = "in processes that import pallas_guard (the autoload is not installed)"
    else:
        where = f"in processes that import pallas_guard; elsewhere JAX's own error ({_policy.POLICY_ENV} is unset)"
    return f"Pallas kernels here will {outcome} {where}."


def collect() -> dict[str, Any]:
    """Everything ``doctor`` reports, JSON-ready. Initialises JAX's backends (to list them)."""
    problems: list[str] = []
    package_dir = os.path.dirname(os.path.abspath(__file__))
    report: dict[str, Any] = {
        "pallas_guard": {"version": _distribution_version("pallas_guard"), "location": package_dir},
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "settings": _settings(problems),
    }
    pth_files = _autoload.installed_pth_files()
    report["autoload"] = {"installed": bool(pth_files), "pth_files": pth_files}
    if os.environ.get(_policy.POLICY_ENV, "").strip() and not pth_files:
        problems.append(
            f"{_policy.POLICY_ENV} is set but the autoload ({_autoload.PTH_NAME}) is not installed for "
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
    status = _install.status()
    report["guard_in_this_process"] = status
    if status["failure"]:
        problems.append(f"The guard disabled itself after an internal error: {status['failure']}")
    report["verdict"] = _verdict(report)
    report["problems"] = problems
    report["exit_code"] = EXIT_PROBLEMS if problems else EXIT_OK
    return report


def _setting_line(settings: dict[str, Any], key: str) -> str:
    if f"{key}_error" in settings:
        return f"INVALID: {settings[f'{key}_error']}"
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
    rows.append(("policy", _setting_line(settings, "policy")))
    rows.append(("interpreter", _setting_line(settings, "interpreter")))
    autoload = report["autoload"]
    rows.append(
        (
            "autoload",
            f"installed: {', '.join(autoload['pth_files'])} (active when {_policy.POLICY_ENV} is set)"
            if autoload["installed"]
            else f"not installed ({_autoload.PTH_NAME} is not in this Python's site-packages)",
        )
    )
    width = max(len(name) for name, _ in rows)
    lines = ["pallas-guard doctor", *(f"  {name:<{width}}  {value}" for name, value in rows)]
    lines.extend(f"  {line}" for line in accelerators["evidence"])
    if report["problems"]:
        lines.append("problems:")
        lines.extend(f"  - {problem}" for problem in report["problems"])
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


def _doctor(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return int(report["exit_code"])


# --- run --------------------------------------------------------------------------------------------


def guarded_environment(
    policy: str | None, interpreter: str | None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the ``PALLAS_GUARD_*`` variables ``run`` sets.

    The policy variable is always set (to the environment's own value, else the default), since
    it is what makes the ``.pth`` autoload activate the guard. Raises on a bad value.
    """
    env = dict(os.environ if base is None else base)
    if policy is not None:
        parsed_policy = _policy.parse_policy(policy, source="--policy")
    else:
        parsed_policy = _policy.policy_from_env() or _policy.DEFAULT_POLICY
    env[_policy.POLICY_ENV] = parsed_policy.value
    if interpreter is not None:
        env[_policy.INTERPRETER_ENV] = _policy.parse_interpreter(interpreter, source="--interpreter").value
    else:
        _policy.interpreter_from_env()  # validate before handing it to every child
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
        env = guarded_environment(args.policy, args.interpreter)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    if not _autoload.installed_pth_files():
        sys.stderr.write(
            f"pallas-guard run: the autoload ({_autoload.PTH_NAME}) is not installed for {sys.executable}; "
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

DEMO_POLICIES = ("interpret", "warn", "strict", "off")


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        policies = [_policy.parse_policy(p, source="--policy").value for p in (args.policy or DEMO_POLICIES)]
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    autoload = bool(_autoload.installed_pth_files())
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
            env[_policy.POLICY_ENV] = policy
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
            env["PYTHONWARNINGS"] = "default"
            child = subprocess.Popen(
                launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=directory
            )
            children.append((policy, child))
        worst = EXIT_OK
        for policy, child in children:
            output, _ = child.communicate()
            print(f"=== {_policy.POLICY_ENV}={policy} python gpu_kernel.py   (exit status {child.returncode})")
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
    policies = ", ".join(p.value for p in _policy.Policy)
    interpreters = ", ".join(i.value for i in _policy.Interpreter)
    run = commands.add_parser(
        "run",
        help="run a command with the guard active in it and its Python children",
        description=(
            f"Run COMMAND with {_policy.POLICY_ENV} (and {_policy.INTERPRETER_ENV}) set, so the autoload "
            "activates the guard in every Python process it starts. The command replaces pallas-guard "
            "(exec): its exit status and signals are its own."
        ),
        usage=f"{_PROG} run [-h] [--policy POLICY] [--interpreter INTERPRETER] -- COMMAND [ARG ...]",
    )
    run.add_argument("--policy", help=f"one of {policies} (default: {_policy.POLICY_ENV}, else warn)")
    run.add_argument("--interpreter", help=f"one of {interpreters} (default: {_policy.INTERPRETER_ENV}, else auto)")
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


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``pallas-guard``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.subcommand == "doctor":
        return _doctor(args)
    if args.subcommand == "run":
        return _run(args, args.subparser)
    return _demo(args, args.subparser)
