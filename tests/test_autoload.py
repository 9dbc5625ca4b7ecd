"""Activation without code changes: the ``.pth`` line and ``sitecustomize``, in real interpreters.

Each test runs a fresh interpreter from a throwaway venv whose site-packages holds the shipped
``.pth`` file (and a path file making jax and this checkout importable), so site processing at
start-up is the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from pallas_guard import _autoload, _policy, pytest_plugin

PTH_FILE = REPO_ROOT / _autoload.PTH_NAME
ACCEPTED = "'interpret', 'warn', 'strict', 'off'"


def _make_venv(root: Path, *, autoload: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    # A path file sorting before ours: the checkout first, then where jax lives. Paths listed in a
    # .pth are added without processing the .pth files inside them.
    paths = [str(REPO_ROOT), *(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))]
    (site_packages / "_paths.pth").write_text("\n".join(paths) + "\n")
    if autoload:
        (site_packages / _autoload.PTH_NAME).write_text(PTH_FILE.read_text())
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("venvs")
    return {
        "autoload": _make_venv(root / "autoload", autoload=True),
        "plain": _make_venv(root / "plain", autoload=False),
    }


def run(
    python: Path, code: str, env: dict[str, str], *, pythonpath: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_") and k != "PYTHONPATH"}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = str(pythonpath)
    full_env["JAX_PLATFORMS"] = "cpu"
    full_env.update(env)
    return subprocess.run(
        [str(python), "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


LOADED = """
import sys
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'wrapt'))
print('pallas_guard' in sys.modules, heavy)
"""


def test_pth_file_is_one_constant_line_gated_by_the_policy_variable() -> None:
    lines = PTH_FILE.read_text().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("import os;")  # site exec()s only lines starting with "import"
    assert f'os.environ.get("{_policy.POLICY_ENV}", "").strip() and __import__("pallas_guard")' in lines[0]
    # The pytest plugin cannot import the constant (importing pallas_guard installs the guard).
    assert pytest_plugin.POLICY_ENV == _policy.POLICY_ENV


@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_blank_variable_imports_nothing(venvs: dict[str, Path], value: str | None) -> None:
    env = {} if value is None else {_policy.POLICY_ENV: value}
    result = run(venvs["autoload"], LOADED, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "[]"]
    assert result.stderr == ""


def test_set_variable_installs_the_guard_without_importing_jax_or_wrapt(venvs: dict[str, Path]) -> None:
    code = (
        LOADED
        + "from pallas_guard import _install, _policy\nprint(_install.status()['requested'], _policy.current_policy())"
    )
    result = run(venvs["autoload"], code, {_policy.POLICY_ENV: "Strict"})
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.split() == ["True", "[]"]
    assert second == "True Setting(value=<Policy.STRICT: 'strict'>, source='PALLAS_GUARD_POLICY')"


@pytest.mark.parametrize("variable", [_policy.POLICY_ENV, _policy.INTERPRETER_ENV])
def test_bad_value_prints_one_line_at_startup_and_explicit_import_still_raises(
    venvs: dict[str, Path], variable: str
) -> None:
    env = {_policy.POLICY_ENV: "warn", variable: "bogus"}
    code = "import sys; print('pallas_guard' in sys.modules, flush=True); import pallas_guard"
    result = run(venvs["autoload"], code, env)
    assert result.stdout.split() == ["False"]  # the guard is off, the process started
    startup_lines = [line for line in result.stderr.splitlines() if line.startswith("pallas_guard: ")]
    assert len(startup_lines) == 1  # once, although a 3.11 venv runs its .pth files twice
    assert startup_lines[0].startswith(f"pallas_guard: {variable}='bogus' is not a valid pallas_guard ")
    assert "accepted values" in startup_lines[0] and startup_lines[0].endswith("the guard is off in this process.")
    assert "Error processing line" not in result.stderr and "Traceback (most recent call last)" in result.stderr
    assert result.returncode != 0  # the explicit import raised
    assert result.stderr.strip().splitlines()[-1].startswith(f"pallas_guard.PallasGuardConfigError: {variable}=")


SPAWN_SCRIPT = """
import multiprocessing, subprocess, sys

def run_kernel(_):
    import jax, jax.numpy as jnp
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):  # written for GPU: no interpret=
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.arange(4, dtype=jnp.float32)
    y = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    import pallas_guard  # already imported by the autoload: only to read the records
    return y.tolist(), [(d.action, d.policy.value) for d in pallas_guard.decisions()]

if __name__ == "__main__":
    print("parent", "pallas_guard" in sys.modules, "jax" in sys.modules)
    child = subprocess.run([sys.executable, "-c", "import sys; print('pallas_guard' in sys.modules)"],
                           capture_output=True, text=True, check=True)
    print("subprocess", child.stdout.strip())
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print("spawned", pool.map(run_kernel, [0])[0])
"""


def test_subprocesses_and_multiprocessing_spawn_inherit_the_guard(venvs: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text(SPAWN_SCRIPT)
    result = run(
        venvs["autoload"],
        f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
        {_policy.POLICY_ENV: "interpret"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "parent True False",
        "subprocess True",
        "spawned ([1.0, 2.0, 3.0, 4.0], [('interpreted', 'interpret')])",
    ]


USER_SITECUSTOMIZE = """
import pallas_guard
print("user sitecustomize ran to the end")
"""


def test_sitecustomize_importing_pallas_guard_installs_it(venvs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    code = (
        "from pallas_guard import _install, _policy\n"
        "print(_install.status()['requested'], _policy.current_policy().value)"
    )
    result = run(venvs["plain"], code, {_policy.POLICY_ENV: "interpret"}, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["user sitecustomize ran to the end", "True interpret"]


def test_sitecustomize_with_a_bad_value_keeps_running_and_leaves_the_guard_off(
    venvs: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    code = "from pallas_guard import _install; print(_install.status()['requested'])"
    result = run(venvs["plain"], code, {_policy.POLICY_ENV: "loud"}, pythonpath=tmp_path)
    assert result.stdout.splitlines() == ["user sitecustomize ran to the end", "False"]
    assert result.stderr.splitlines() == [
        f"pallas_guard: PALLAS_GUARD_POLICY='loud' is not a valid pallas_guard policy; accepted values "
        f"(case-insensitive): {ACCEPTED}; the guard is off in this process."
    ]


def test_users_own_sitecustomize_keeps_running_beside_the_autoload(venvs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.user_sitecustomize_ran = True\n")
    code = LOADED + "print(sys.user_sitecustomize_ran)"
    result = run(venvs["autoload"], code, {_policy.POLICY_ENV: "warn"}, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "[]", "True"]


def test_startup_detection_is_false_in_ordinary_code(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _autoload.during_site_startup()
    monkeypatch.setattr(sys, "argv", ["/venv/bin/pallas-guard", "doctor"])
    assert _autoload.cli_startup()
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-X", "importtime", "-m", "pallas_guard", "doctor"])
    assert _autoload.cli_startup()
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "-m", "pallas_guard"])
    assert not _autoload.cli_startup()  # `-m pallas_guard` there is pytest's marker expression
