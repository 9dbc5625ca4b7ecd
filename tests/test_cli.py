"""The ``pallas-guard`` command: argument handling in process, each command in a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from pallas_guard import _autoload, _cli, _policy

AUTOLOAD_INSTALLED = bool(_autoload.installed_pth_files())


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_")}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    full_env["JAX_PLATFORMS"] = "cpu"
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pallas_guard", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--help"], ["run", "--help"], ["demo", "--help"]])
def test_help_everywhere(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _cli.main(argv)
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: pallas-guard")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required"),
        (["lint"], "invalid choice: 'lint'"),
        (["doctor", "--yaml"], "unrecognized arguments: --yaml"),
        (["run"], "run needs a command after --"),
        (["run", "--policy", "loud", "--", "true"], "--policy='loud' is not a valid pallas_guard policy"),
        (
            ["run", "--interpreter", "cuda", "--", "true"],
            "--interpreter='cuda' is not a valid pallas_guard interpreter",
        ),
        (["demo", "--policy", "sometimes"], "--policy='sometimes' is not a valid pallas_guard policy"),
    ],
)
def test_bad_arguments_exit_2_with_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _cli.main(argv)
    assert info.value.code == _cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pallas-guard") and message in err


def test_run_environment_always_sets_the_policy_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"PATH": "/bin"}
    assert _cli.guarded_environment(None, None, base) == {"PATH": "/bin", _policy.POLICY_ENV: "warn"}
    assert _cli.guarded_environment("STRICT", "tpu", base)[_policy.INTERPRETER_ENV] == "tpu"
    monkeypatch.setenv(_policy.POLICY_ENV, " Interpret ")
    assert _cli.guarded_environment(None, None, base)[_policy.POLICY_ENV] == "interpret"
    monkeypatch.setenv(_policy.INTERPRETER_ENV, "cuda")
    with pytest.raises(_policy.PallasGuardConfigError, match="PALLAS_GUARD_INTERPRETER='cuda'"):
        _cli.guarded_environment(None, None, base)


def test_doctor_reports_a_healthy_cpu_environment() -> None:
    result = cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("pallas-guard doctor\n")
    for row in (
        r"jax / jaxlib +\d",
        "plugins +none installed",
        "JAX_PLATFORMS +'cpu'",
        r"policy +warn \(from default\)",
    ):
        assert re.search(f"^  {row}", out, re.MULTILINE), row
    assert "[initialised by doctor; pallas_guard itself never does]" in out
    assert "verdict: Pallas kernels here will run interpreted on cpu (interpreter auto) under policy warn" in out


def test_doctor_json_names_an_invalid_variable_and_exits_1() -> None:
    result = cli("doctor", "--json", env={_policy.POLICY_ENV: "loud"})
    assert result.returncode == _cli.EXIT_PROBLEMS == 1
    report = json.loads(result.stdout)
    assert report["exit_code"] == 1
    assert report["settings"]["environment"][_policy.POLICY_ENV] == "loud"
    assert any("PALLAS_GUARD_POLICY='loud' is not a valid" in problem for problem in report["problems"])
    assert report["verdict"].startswith("A PALLAS_GUARD_* value is invalid")
    assert report["jax"]["backends"]["default_backend"] == "cpu"


def test_doctor_works_without_jax() -> None:
    code = (
        "import sys; sys.modules['jax'] = None  # `import jax` now fails, as when it is not installed\n"
        "from pallas_guard._cli import main; sys.exit(main(['doctor']))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 1, result.stderr
    assert re.search(r"^  jax / jaxlib +NOT INSTALLED$", result.stdout, re.MULTILINE)
    assert "verdict: jax is not installed: there are no Pallas kernels to guard here." in result.stdout


def test_run_sets_the_environment_and_passes_the_exit_code_through() -> None:
    child = (
        "import os, sys; print(os.environ['PALLAS_GUARD_POLICY'], os.environ['PALLAS_GUARD_INTERPRETER'], "
        "'pallas_guard' in sys.modules); sys.exit(7)"
    )
    result = cli("run", "--policy", "strict", "--interpreter", "plain", "--", sys.executable, "-c", child)
    assert result.returncode == 7, result.stderr
    # With the autoload installed, the child's Python activated the guard at start-up.
    assert result.stdout.split() == ["strict", "plain", str(AUTOLOAD_INSTALLED)]


def test_run_reports_a_missing_command() -> None:
    result = cli("run", "--", "pallas-guard-no-such-command")
    assert result.returncode == 127
    assert "command not found: pallas-guard-no-such-command" in result.stderr


@pytest.mark.skipif(os.name != "posix", reason="signals as POSIX delivers them")
def test_run_delivers_signals_to_the_command() -> None:
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(3)))\n"
        "print('ready', flush=True); time.sleep(60)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    with subprocess.Popen(
        [sys.executable, "-m", "pallas_guard", "run", "--", sys.executable, "-c", child],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 3
        assert process.stdout.read().strip() == "got SIGTERM"


def test_demo_shows_each_policy() -> None:
    result = cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    sections = out.split("=== ")[1:]
    assert [s.split()[0] for s in sections] == [f"PALLAS_GUARD_POLICY={p}" for p in _cli.DEMO_POLICIES]
    interpret, warn, strict, off = sections
    assert "(exit status 0)" in interpret and "result: [1. 2. 3. 4. 5. 6. 7. 8.]" in interpret
    assert "PallasGuardWarning" not in interpret
    assert "PallasGuardWarning: pallas_guard: Pallas kernel 'add_one_kernel'" in warn and "result:" in warn
    assert "raised pallas_guard.PallasGuardError: pallas_guard: Pallas kernel 'add_one_kernel'" in strict
    assert "To fix: set PALLAS_GUARD_POLICY=interpret" in strict
    assert "raised builtins.ValueError: Only interpret mode is supported on CPU backend." in off
