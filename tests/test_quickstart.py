"""The README's quick-start blocks, run as written: each in a fresh virtualenv, on a small project of
GPU-style kernels whose pytest configuration has ``filterwarnings = ["error"]``.

The Dockerfile and the GitHub Actions job run their own lines: ``pip install`` installs pallas_guard
from the built wheel, found through ``PIP_FIND_LINKS`` as the README tells a user to do before it is
on their index (jax, pytest and pytest-xdist are already there: the machine is offline); then their
variables are set and their commands run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, clean_env, dependency_paths, make_venv, venv_site_packages

from pallas_guard_autoload import OPTIONS

PROJECT = Path(__file__).resolve().parent / "quickstart" / "project"


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


@pytest.fixture
def bare_venv(built_wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A fresh virtualenv with pip and without pallas_guard, and a folder holding the built wheel.

    Its dependencies come from a mirror of this interpreter's site-packages without pallas_guard
    (whose metadata there would tell pip it is installed already)."""
    mirror = tmp_path / "dependencies"
    mirror.mkdir()
    for directory in dependency_paths():
        for entry in Path(directory).iterdir():
            ours = entry.name.startswith(("pallas_guard", "_editable_impl_pallas_guard", "__editable__"))
            if not ours and not (mirror / entry.name).exists():
                (mirror / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=240)
    python = tmp_path / "venv" / "bin" / "python"
    (venv_site_packages(python) / "_paths.pth").write_text(f"{mirror}\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy(built_wheel, wheels)
    return python, wheels


def _pip_install(command: str, python: Path, wheels: Path) -> None:
    """A quick start's ``pip install`` line, run as written, with the wheel on ``PIP_FIND_LINKS``."""
    assert shlex.split(command)[:2] == ["pip", "install"], command
    env = {"PIP_FIND_LINKS": str(wheels), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = _run(["sh", "-c", command], python, python.parent, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Successfully installed pallas_guard-" in result.stdout, result.stdout


def _run(command: list[str], python: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = clean_env({"JAX_PLATFORMS": "cpu", **env}, checkout_on_path=False)  # a CPU-only machine
    full["PATH"] = f"{python.parent}:{full.get('PATH', '')}"  # `python` is the venv's
    return subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True, timeout=600, check=False)


def _assert_green(result: subprocess.CompletedProcess[str], policy_from: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"=+ 3 passed in ", result.stdout), result.stdout
    assert f"pallas_guard: policy interpret (from {policy_from})" in result.stdout
    assert "4 Pallas kernel(s): 4 interpreted" in result.stdout  # the jitted test runs two


def test_the_dockerfile_commands_turn_a_failing_project_green(bare_venv: tuple[Path, Path], project: Path) -> None:
    venv, wheels = bare_venv
    dockerfile = block("quick start: Dockerfile")
    env: dict[str, str] = {}
    command: list[str] = []
    for line in dockerfile.strip().splitlines():
        instruction, _, argument = line.partition(" ")
        if instruction == "RUN":
            _pip_install(argument, venv, wheels)
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


def test_the_github_actions_job_runs_green(bare_venv: tuple[Path, Path], project: Path) -> None:
    venv, wheels = bare_venv
    job = block("quick start: GitHub Actions")
    env = dict(re.findall(r"^ {6}(\w+): (\S+)$", job, re.MULTILINE))
    runs = re.findall(r"^ +- run: (.+)$", job, re.MULTILINE)
    assert env == {"PALLAS_GUARD_POLICY": "interpret"} and len(runs) == 2
    _pip_install(runs[0], venv, wheels)
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
    """Under ``-W error`` too: nothing the guard does (its probes of JAX included) warns."""
    script = tmp_path / "example.py"
    script.write_text(block("quick start: Python"))
    result = _run([str(venv), "-W", "error", str(script)], venv, tmp_path, {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1. 2. 3. 4. 5. 6. 7. 8.]", "interpreted"]


ARMED_SCRIPT = """
import importlib, sys
import jax, jax.numpy as jnp
pl = importlib.import_module(sys.argv[1])
def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
x = jnp.zeros((8, 128), jnp.float32)
print(float(pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)[0, 0]))
import pallas_guard
print(pallas_guard.decisions()[-1].action)
"""


@pytest.mark.parametrize("module", ["jax.experimental.pallas", "jax.pallas"])
def test_the_autoload_arms_under_warnings_as_errors(venv: Path, tmp_path: Path, module: str) -> None:
    """The variable alone, ``python -W error`` and a kernel without ``interpret=``: the guard arms from
    whichever public face of Pallas the script imports (``jax.pallas`` is jax 0.12.1's), and nothing
    it does warns, whatever JAX deprecated."""
    if module == "jax.pallas" and importlib.util.find_spec("jax.pallas") is None:
        pytest.skip("this jax has no jax.pallas (added in jax 0.12.1)")
    script = tmp_path / "armed.py"
    script.write_text(ARMED_SCRIPT)
    env = {"PALLAS_GUARD_POLICY": "interpret"}
    result = _run([str(venv), "-W", "error", str(script), module], venv, tmp_path, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["1.0", "interpreted"], result.stdout + result.stderr
    assert result.stderr == "", result.stderr  # no warning printed, no line from the guard


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
