"""The README's quick-start blocks, run as written: each in a fresh virtualenv with the built wheel
installed (the autoload included), on a small project of GPU-style kernels whose pytest
configuration has ``filterwarnings = ["error"]``.

The Dockerfile and the GitHub Actions job are run as scripts that build nothing: their ``pip
install`` lines are checked against what the virtualenv already provides (jax and pytest from this
interpreter, pallas_guard from the wheel), their variables are set, and their commands run.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, clean_env, make_venv, venv_site_packages

from pallas_guard_autoload import OPTIONS

PROJECT = Path(__file__).resolve().parent / "quickstart" / "project"
# What the venv provides for each requirement a quick start installs, by its import name.
PROVIDED = {"jax[cpu]": "jax", "pytest": "pytest", "pallas_guard": "pallas_guard"}


def block(marker: str, path: Path = REPO_ROOT / "README.md") -> str:
    """The fenced block that follows the ``<!-- ... marker ... -->`` comment line in ``path``."""
    text = path.read_text()
    start = text.index(marker)
    match = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL).search(text, start)
    assert match is not None, marker
    return match.group(1)


@pytest.fixture(scope="module")
def venv(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the wheel unpacked (autoload files included); returns its python."""
    return make_venv(tmp_path_factory.mktemp("quickstart-venv"), autoload=True, wheel=built_wheel)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copytree(PROJECT, tmp_path / "project")
    return tmp_path / "project"


def _check_install(command: str, python: Path) -> None:
    """A quick start's ``pip install``: every requirement is one the venv already provides."""
    words = shlex.split(command)
    assert words[:2] == ["pip", "install"], command
    for requirement in words[2:]:
        module = PROVIDED[requirement]
        found = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, check=False)
        assert found.returncode == 0, (requirement, found.stderr)


def _run(command: list[str], python: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = clean_env({"JAX_PLATFORMS": "cpu", **env}, checkout_on_path=False)  # a CPU-only machine
    full["PATH"] = f"{python.parent}:{full.get('PATH', '')}"  # `python` is the venv's
    return subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True, timeout=600, check=False)


def _assert_green(result: subprocess.CompletedProcess[str], policy_from: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"=+ 3 passed in ", result.stdout), result.stdout
    assert f"pallas_guard: policy interpret (from {policy_from})" in result.stdout
    assert "4 Pallas kernel(s): 4 interpreted" in result.stdout  # the jitted test runs two


def test_the_dockerfile_commands_turn_a_failing_project_green(venv: Path, project: Path) -> None:
    dockerfile = block("quick start: Dockerfile")
    env: dict[str, str] = {}
    command: list[str] = []
    for line in dockerfile.strip().splitlines():
        instruction, _, argument = line.partition(" ")
        if instruction == "RUN":
            _check_install(argument, venv)
        elif instruction == "ENV":
            name, _, value = argument.partition("=")
            env[name] = value
        elif instruction == "CMD":
            command = json.loads(argument)
        else:
            assert instruction in ("FROM", "WORKDIR", "COPY"), line  # the image and the copied project
    assert env == {"PALLAS_GUARD_POLICY": "interpret"}  # the variable alone
    without = _run(command, venv, project, {})
    assert without.returncode == 1 and "Only interpret mode is supported on CPU backend" in without.stdout
    _assert_green(_run(command, venv, project, env), "PALLAS_GUARD_POLICY")


def test_the_github_actions_job_runs_green(venv: Path, project: Path) -> None:
    job = block("quick start: GitHub Actions")
    env = dict(re.findall(r"^ {6}(\w+): (\S+)$", job, re.MULTILINE))
    runs = re.findall(r"^ +- run: (.+)$", job, re.MULTILINE)
    assert env == {"PALLAS_GUARD_POLICY": "interpret"} and len(runs) == 2
    _check_install(runs[0], venv)
    _assert_green(_run(shlex.split(runs[1]), venv, project, env), "PALLAS_GUARD_POLICY")


def test_the_pytest_configuration_and_markers(venv: Path, project: Path) -> None:
    (project / "pyproject.toml").write_text(block("quick start: pyproject.toml"))
    (project / "test_markers.py").write_text(block("quick start: markers"))
    result = _run([str(venv), "-m", "pytest", "-rs"], venv, project, {})
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"=+ 4 passed, 1 skipped in ", result.stdout), result.stdout
    assert "pallas_guard: policy interpret (from pallas_guard_policy in pyproject.toml)" in result.stdout
    assert "max steps 10000 (from pallas_guard_max_steps in pyproject.toml)" in result.stdout
    assert "SKIPPED [1] test_markers.py:" in result.stdout and "too slow interpreted" in result.stdout


def test_the_python_example(venv: Path, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block("quick start: Python"))
    result = _run([str(venv), str(script)], venv, tmp_path, {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1. 2. 3. 4. 5. 6. 7. 8.]", "interpreted"]


def test_the_settings_table_names_each_setting_in_its_own_words() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    for name, option in OPTIONS.items():
        (row,) = [line for line in readme.splitlines() if line.startswith(f"| {name.replace('_', ' ')} | `PALLAS")]
        for word in (*option.variables(), option.pytest_option, option.ini, *option.meanings):
            assert f"`{word}" in row, (name, word)


def test_the_sitecustomize_recipe_is_silent_once_pallas_guard_is_uninstalled(built_wheel: Path, tmp_path: Path) -> None:
    """The recipe in the docs: activates the guard where pallas_guard is installed, and prints
    nothing where it is not (no ``Error in sitecustomize`` on every start)."""
    recipe = block("sitecustomize recipe", REPO_ROOT / "docs" / "activation-and-startup.md")
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    (venv_site_packages(bare / "bin" / "python") / "sitecustomize.py").write_text(recipe)
    result = _run([str(bare / "bin" / "python"), "-c", "print('started')"], bare / "bin" / "python", tmp_path, {})
    assert (result.stdout, result.stderr) == ("started\n", "")
    # Installed without its own start-up files: the recipe alone activates the guard.
    python = make_venv(tmp_path / "installed", autoload=False, wheel=built_wheel)
    (venv_site_packages(python) / "sitecustomize.py").write_text(recipe)
    code = "import sys; print(sys.modules['pallas_guard_autoload'].activated)"
    with_guard = _run([str(python), "-c", code], python, tmp_path, {"PALLAS_GUARD_POLICY": "interpret"})
    assert with_guard.stdout.split() == ["True"], with_guard.stderr
