"""The ``pallas-guard`` command: argument handling in process, each command in a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

from pallas_guard import PallasGuardConfigError
from pallas_guard._deciding import target as _target
from pallas_guard._surfaces import cli as _cli
from pallas_guard_autoload import (
    CHECKS_ENV,
    DETECT_RACES_ENV,
    EXIT_SUMMARY_ENV,
    INTERPRETER_ENV,
    MAX_STEPS_ENV,
    OPTIONS,
    POLICY_ENV,
)

AUTOLOAD_INSTALLED = bool(_cli.installed_startup_files())


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pallas_guard", *args],
        env=clean_env({"JAX_PLATFORMS": "cpu", **(env or {})}),
        cwd=cwd,
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


def test_run_environment_always_sets_the_policy_variable() -> None:
    base = {"PATH": "/bin"}
    # and the one that makes each guarded process print its TPU memory figures at exit
    assert _cli.guarded_environment(None, None, base) == {"PATH": "/bin", POLICY_ENV: "warn", EXIT_SUMMARY_ENV: "1"}
    assert _cli.guarded_environment("STRICT", "tpu", base)[INTERPRETER_ENV] == "tpu"
    assert _cli.guarded_environment(None, None, {POLICY_ENV: " Interpret "})[POLICY_ENV] == "interpret"
    with pytest.raises(PallasGuardConfigError, match="PALLAS_GUARD_INTERPRETER='cuda'"):
        _cli.guarded_environment(None, None, {**base, INTERPRETER_ENV: "cuda"})
    with pytest.raises(PallasGuardConfigError, match="PALLAS_GUARD_DETECT_RACES='maybe'"):
        _cli.guarded_environment("strict", None, {**base, DETECT_RACES_ENV: "maybe"})


@pytest.mark.parametrize(
    ("variable", "kind"), [(POLICY_ENV, "policy"), (INTERPRETER_ENV, "interpreter"), (DETECT_RACES_ENV, "boolean")]
)
def test_run_refuses_a_bad_variable_before_running_anything(variable: str, kind: str) -> None:
    """Every PALLAS_GUARD_* variable is checked, PALLAS_GUARD_DETECT_RACES too."""
    result = cli("run", "--policy", "warn", "--", sys.executable, "-c", "print('ran')", env={variable: "maybe"})
    assert result.returncode == _cli.EXIT_USAGE == 2
    assert result.stdout == ""
    assert f"pallas-guard run: error: {variable}='maybe' is not a valid pallas_guard {kind}; accepted" in result.stderr


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
    # found by arming, as the user's import of Pallas would
    assert re.search(
        r"^  guard +armed on jax \S+: entry points .*pallas_call.* wrapped; CPU lowering rules on ", out, re.MULTILINE
    )
    assert (
        "verdict: Pallas kernels here will run interpreted, with a PallasGuardWarning at the caller's line "
        "(on cpu, interpreter auto, policy warn)"
    ) in out


def test_doctor_names_a_variable_it_does_not_read_and_the_closest_it_does() -> None:
    result = cli("doctor", "--json", env={"PALLAS_GUARD_CHECK": "compile"})
    assert result.returncode == _cli.EXIT_PROBLEMS
    report = json.loads(result.stdout)
    assert (
        "PALLAS_GUARD_CHECK is not a pallas_guard variable and is ignored; did you mean PALLAS_GUARD_CHECKS?"
        in report["problems"]
    )
    assert report["armed"]["armed"] is True


def test_doctor_json_names_an_invalid_variable_and_exits_1() -> None:
    result = cli("doctor", "--json", env={POLICY_ENV: "loud"})
    assert result.returncode == _cli.EXIT_PROBLEMS == 1
    report = json.loads(result.stdout)
    assert report["exit_code"] == 1
    assert report["settings"]["environment"][POLICY_ENV] == "loud"
    assert any("PALLAS_GUARD_POLICY='loud' is not a valid" in problem for problem in report["problems"])
    assert report["verdict"].startswith("A PALLAS_GUARD_* value is invalid")
    assert report["jax"]["backends"]["default_backend"] == "cpu"


def test_doctor_prints_a_look_alike_value_escaped() -> None:
    """A Cyrillic omega in 'warn' must not look like the accepted 'warn'."""
    result = cli("doctor", env={POLICY_ENV: "\u0461arn"})
    assert result.returncode == _cli.EXIT_PROBLEMS
    assert "PALLAS_GUARD_POLICY='\\u0461arn' is not a valid pallas_guard policy" in result.stdout
    assert "\u0461" not in result.stdout.split("environment", 1)[1].split("\n", 1)[1]  # only the raw variable row


@pytest.mark.skipif(
    any(p.startswith("jax-cuda") for p in _target.installed_accelerator_plugins()), reason="a CUDA plugin is installed"
)
def test_doctor_with_an_unavailable_configured_accelerator_tells_the_truth() -> None:
    """JAX_PLATFORMS=cuda without CUDA: the problem names the error, the verdict
    says kernels fail (not that they "will compile for cuda")."""
    result = cli("doctor", env={"JAX_PLATFORMS": "cuda"})
    assert result.returncode == _cli.EXIT_PROBLEMS, result.stderr
    problem = next(line for line in result.stdout.splitlines() if "JAX could not initialise a backend" in line)
    assert not re.search(r"Error: ?$", problem), problem  # never an empty "AssertionError: "
    assert re.search(r"initialise a backend: \w+(Error|Exception)\b.{8,}", problem), problem
    verdict = result.stdout.split("verdict: ", 1)[1]
    assert verdict.startswith("JAX is configured for cuda but could not initialise it (")
    assert "will compile for" not in verdict


def test_doctor_ignores_a_dist_info_folder_in_the_working_directory(tmp_path: Path) -> None:
    """Plugins are looked up where the interpreter loads them from."""
    (tmp_path / "libtpu-9.9.9.dist-info").mkdir()
    result = cli("doctor", "--json", cwd=tmp_path)
    report = json.loads(result.stdout)
    assert not any(plugin.startswith("libtpu") for plugin in report["accelerators"]["plugins"])
    assert not any("libtpu" in line and "installed:" in line for line in report["accelerators"]["evidence"])


def test_doctor_works_without_jax() -> None:
    code = (
        "import sys; sys.modules['jax'] = None  # `import jax` now fails, as when it is not installed\n"
        "from pallas_guard._surfaces.cli import main; sys.exit(main(['doctor']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 1, result.stderr
    assert re.search(r"^  jax / jaxlib +NOT INSTALLED$", result.stdout, re.MULTILINE)
    assert "verdict: jax is not installed: there are no Pallas kernels to guard here." in result.stdout


def test_run_sets_the_environment_and_passes_the_exit_code_through() -> None:
    child = (
        "import os, sys; print(os.environ['PALLAS_GUARD_POLICY'], os.environ['PALLAS_GUARD_INTERPRETER'], "
        "getattr(sys.modules.get('pallas_guard_autoload'), 'activated', False)); sys.exit(7)"
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
    with subprocess.Popen(
        [sys.executable, "-m", "pallas_guard", "run", "--", sys.executable, "-c", child],
        env=clean_env(),
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


def test_version_prints_the_installed_version() -> None:
    from importlib import metadata

    result = cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pallas-guard {metadata.version('pallas_guard')}"


def test_doctor_reports_one_bad_variable_once_on_its_own_row() -> None:
    """The other settings keep their values; the bad one is one row and one problem."""
    result = cli("doctor", env={POLICY_ENV: "interpret", CHECKS_ENV: "race"})
    assert result.returncode == _cli.EXIT_PROBLEMS
    rows = {line.split("  ")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("  ")}
    assert "interpret (from PALLAS_GUARD_POLICY)" in rows["policy"]
    assert "auto (from default)" in rows["interpreter"]
    assert "none (from default)" in rows["max steps"]
    assert rows["checks"].endswith("INVALID: PALLAS_GUARD_CHECKS='race' (see problems)")
    assert result.stdout.count("is not a valid pallas_guard") == 1
    assert "did you mean 'races'?" in result.stdout


def test_doctor_escapes_control_characters_from_the_environment() -> None:
    result = cli("doctor", env={"JAX_PLATFORMS": "cpu\x1b[2J\rforged", POLICY_ENV: "warn\x1b[31m"})
    assert "\x1b" not in result.stdout and "\r" not in result.stdout
    assert "cpu\\x1b[2J\\rforged" in result.stdout


def test_run_has_an_option_for_every_setting(tmp_path: Path) -> None:
    """--checks and --max-steps as --policy and --interpreter: every settings row, in its own words."""
    assert all(f"--{name.replace('_', '-')}" in cli("run", "--help").stdout for name in OPTIONS)
    child = f"import os; print(os.environ[{CHECKS_ENV!r}], os.environ[{MAX_STEPS_ENV!r}])"
    result = cli("run", "--checks", "races,bounds", "--max-steps", "64", "--", sys.executable, "-c", child)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["races,bounds", "64"]
    refused = cli("run", "--max-steps", "1e3", "--", "true")
    assert refused.returncode == _cli.EXIT_USAGE
    assert "--max-steps='1e3' is not a valid pallas_guard step budget" in refused.stderr


def test_doctor_and_pytest_agree_on_the_policy_of_this_folder(tmp_path: Path) -> None:
    """doctor reads the configuration pytest reads here and says that it wins in pytest."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\npallas_guard_policy = "interpret"\n')
    (tmp_path / "sub").mkdir()  # pytest finds the file in a parent folder; so does doctor
    doctor = cli("doctor", cwd=tmp_path / "sub")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    said = "interpret (from pallas_guard_policy in pyproject.toml)"
    assert re.search(rf"^  policy +warn \(from default\); in pytest here: {re.escape(said)}$", doctor.stdout, re.M)
    assert f"pytest config    {tmp_path / 'pyproject.toml'}: its pallas_guard_* settings win" in doctor.stdout
    assert "In pytest runs started here (pyproject.toml): run interpreted, silently" in doctor.stdout
    header = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider"],
        env=clean_env({"JAX_PLATFORMS": "cpu"}),
        cwd=tmp_path / "sub",
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert f"pallas_guard: policy {said}" in header.stdout, header.stdout


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("pytest.ini", "[pytest]\npallas_guard_policy = strict\n"),
        ("tox.ini", "[pytest]\npallas_guard_policy = strict\n"),
        ("setup.cfg", "[tool:pytest]\npallas_guard_policy = strict\n"),
        ("pyproject.toml", '[tool.pytest.ini_options]\npallas_guard_checks = ["races", "bounds"]\n'),
    ],
)
def test_doctor_reads_each_file_pytest_reads(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    (tmp_path / "setup.cfg").touch()  # no pytest section: pytest, and doctor, look past it
    path, values = _cli.pytest_configuration(str(tmp_path)) or ("", {})
    assert path == str(tmp_path / name)
    assert values == ({"checks": "races,bounds"} if name == "pyproject.toml" else {"policy": "strict"})


def test_doctor_names_a_bad_value_in_pytests_configuration(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\npallas_guard_policy = loud\n")
    doctor = cli("doctor", cwd=tmp_path)
    assert doctor.returncode == 1
    assert "pallas_guard_policy in pytest.ini='loud' is not a valid pallas_guard policy" in doctor.stdout
