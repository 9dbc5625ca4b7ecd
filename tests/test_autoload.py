"""Activation without code changes: the ``.pth`` line, the ``.start`` entry point and
``sitecustomize``, in real interpreters.

Each test runs a fresh interpreter from a throwaway venv whose site-packages holds the shipped
start-up files (and a path file making jax and this checkout importable), or the built wheel
unpacked, so site processing at start-up is the real one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT, clean_env, dependency_paths, make_venv, venv_site_packages

import pallas_guard_autoload
from pallas_guard._surfaces import install as _install
from pallas_guard_autoload import CHECKS_ENV, DETECT_RACES_ENV, INTERPRETER_ENV, MAX_STEPS_ENV, OPTIONS, POLICY_ENV

PTH_FILE = REPO_ROOT / "pallas_guard_autoload.pth"
START_FILE = REPO_ROOT / "pallas_guard_autoload.start"


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("venvs")
    return {
        "autoload": make_venv(root / "autoload", autoload=True),
        "plain": make_venv(root / "plain", autoload=False),
    }


def run(
    python: Path,
    code: str,
    env: dict[str, str],
    *,
    pythonpath: Path | None = None,
    cwd: Path | None = None,
    interpreter_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    full_env = clean_env({"JAX_PLATFORMS": "cpu", **env}, checkout_on_path=False)
    if pythonpath is not None:
        full_env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [str(python), *interpreter_args, "-c", textwrap.dedent(code)],
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
print('pallas_guard' in sys.modules, 'pallas_guard_autoload' in sys.modules, heavy)
"""

KERNEL = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def add_one_kernel(x_ref, o_ref):  # written for GPU: no interpret=
    o_ref[...] = x_ref[...] + 1.0

def add_one(x):
    return pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
"""


def test_pth_file_is_one_constant_line_gated_by_the_guards_variables() -> None:
    """Any non-blank ``PALLAS_GUARD_*``/``PALLAS_INTERPRET*`` variable opens the gate, a misspelled one
    too (start-up then names it): nothing else imports anything."""
    lines = PTH_FILE.read_text().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("import os;")  # site exec()s only lines starting with "import"
    gate = (
        'any(value.strip() for name, value in os.environ.items() if name.startswith(("PALLAS_GUARD_", '
        '"PALLAS_INTERPRET")))'
    )
    assert f'{gate} and __import__("pallas_guard_autoload").activate()' in lines[0]


def test_a_misspelled_variable_is_named_at_startup_with_the_closest_one(venvs: dict[str, Path]) -> None:
    """``PALLAS_GUARD_POLCY=interpret`` would read as "no guard wanted": start-up says so, once, and
    the process runs on as it would without the guard."""
    result = run(venvs["autoload"], LOADED, {"PALLAS_GUARD_POLCY": "interpret"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "pallas_guard: warning: PALLAS_GUARD_POLCY is not a pallas_guard variable and is ignored; "
        f"did you mean {POLICY_ENV}?"
    ]
    assert result.stdout.split() == ["False", "True", "[]"]  # the start-up module alone


def test_start_file_names_the_same_entry_point() -> None:
    """PEP 829: one ``pkg.mod:callable`` per line; the same function the .pth line calls."""
    assert START_FILE.read_text().splitlines() == ["pallas_guard_autoload:activate"]
    import pkgutil

    assert pkgutil.resolve_name("pallas_guard_autoload:activate") is pallas_guard_autoload.activate


def test_startup_module_imports_only_os_and_sys() -> None:
    """Every process with the variable set imports it: nothing but builtins may come with it."""
    code = (
        "import sys; before = set(sys.modules); import pallas_guard_autoload; print(sorted(set(sys.modules) - before))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['pallas_guard_autoload']"


@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_blank_variable_imports_nothing(venvs: dict[str, Path], value: str | None) -> None:
    env = {} if value is None else {POLICY_ENV: value}
    result = run(venvs["autoload"], LOADED, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "[]"]
    assert result.stderr == ""


def test_startup_with_the_policy_set_imports_only_the_startup_module(venvs: dict[str, Path]) -> None:
    """Start-up with the variable set costs one tiny module, not the package."""
    modules = "import sys; print(' '.join(sorted(sys.modules)))"
    guarded = run(venvs["autoload"], modules, {POLICY_ENV: "interpret"})
    plain = run(venvs["plain"], modules, {})
    assert guarded.returncode == plain.returncode == 0, guarded.stderr + plain.stderr
    assert set(guarded.stdout.split()) - set(plain.stdout.split()) == {"pallas_guard_autoload"}


def test_set_variable_installs_the_guard_when_pallas_is_imported(venvs: dict[str, Path]) -> None:
    code = (
        LOADED
        + "import jax.experimental.pallas as pl\n"
        + "from pallas_guard._surfaces import install as _install\n"
        + "from pallas_guard._vocabulary import settings as _settings\n"
        + "status = _install.status()\n"
        + "print(len(status.patched) > 0, status.requested, _settings.current_policy())"
    )
    result = run(venvs["autoload"], code, {POLICY_ENV: "Strict"})
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.split() == ["False", "True", "[]"]  # at start-up: the start-up module only
    assert second == "True True Setting(value=<Policy.STRICT: 'strict'>, source='PALLAS_GUARD_POLICY')"


@pytest.mark.parametrize("variable", [POLICY_ENV, INTERPRETER_ENV, DETECT_RACES_ENV])
def test_bad_value_prints_one_line_at_startup_and_explicit_import_still_raises(
    venvs: dict[str, Path], variable: str
) -> None:
    env = {POLICY_ENV: "warn", variable: "bogus"}
    code = "import sys; print('pallas_guard' in sys.modules, flush=True); import pallas_guard"
    result = run(venvs["autoload"], code, env)
    assert result.stdout.split() == ["False"]  # the process started
    startup_lines = [line for line in result.stderr.splitlines() if line.startswith("pallas_guard: ")]
    assert len(startup_lines) == 1  # once, although a 3.11/3.12 venv runs its .pth files twice
    rows = [o for o in OPTIONS.values() for o in (o, o.alias) if o is not None]
    kind = next(o.kind for o in rows if o.env == variable)
    assert startup_lines[0].startswith(f"pallas_guard: {variable}='bogus' is not a valid pallas_guard {kind}; ")
    assert "accepted values" in startup_lines[0]
    assert startup_lines[0].endswith("each Pallas kernel it sees raises this error until the value is fixed).")
    assert "Error processing line" not in result.stderr and "Traceback (most recent call last)" in result.stderr
    assert result.returncode != 0  # the explicit import raised
    assert result.stderr.strip().splitlines()[-1].startswith(f"pallas_guard.PallasGuardConfigError: {variable}=")


@pytest.mark.parametrize(
    ("variables", "named", "hint"),
    [
        ({POLICY_ENV: "interpret", CHECKS_ENV: "race"}, f"{CHECKS_ENV}='race'", "; did you mean 'races'?"),
        ({POLICY_ENV: "intepret"}, f"{POLICY_ENV}='intepret'", "; did you mean 'interpret'?"),
        ({POLICY_ENV: "interpret", MAX_STEPS_ENV: "1e3"}, f"{MAX_STEPS_ENV}='1e3'", "(grid steps)"),
    ],
)
def test_a_bad_value_keeps_the_guard_and_the_first_kernel_raises_the_configuration_error(
    venvs: dict[str, Path], variables: dict[str, str], named: str, hint: str
) -> None:
    """A typo in any setting never leaves the process silently unguarded: the kernel, eager or
    jitted, raises the configuration error naming the variable, the value, the accepted values and
    the closest valid one, not JAX's own CPU error."""
    code = KERNEL + textwrap.dedent(
        """
        import sys
        for call in (add_one, jax.jit(add_one)):
            try:
                call(jnp.arange(4.0))
                print("ran")
            except ValueError as error:
                print(type(error).__name__, "|", str(error).replace("\\n", " "))
        print('pallas_guard' in sys.modules)
        """
    )
    result = run(venvs["autoload"], code, variables)
    assert result.returncode == 0, result.stderr
    *outcomes, imported = result.stdout.splitlines()
    assert imported == "True"
    assert len(outcomes) == 2
    for outcome in outcomes:
        kind, _, text = outcome.partition(" | ")
        assert kind == "PallasGuardConfigError", outcome
        assert text.startswith(f"{named} is not a valid pallas_guard ") and "accepted values" in text and hint in text
    startup = [line for line in result.stderr.splitlines() if line.startswith("pallas_guard: ")]
    assert len(startup) == 1 and named in startup[0] and "the guard stays installed" in startup[0]


SPAWN_SCRIPT = """
import multiprocessing, subprocess, sys

def run_kernel(_):
    import jax, jax.numpy as jnp
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):  # written for GPU: no interpret=
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.arange(4, dtype=jnp.float32)
    y = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    import pallas_guard  # already imported by the autoload's hook: only to read the records
    return y.tolist(), [(d.action, d.policy.value) for d in pallas_guard.decisions()]

if __name__ == "__main__":
    import pallas_guard_autoload
    print("parent", pallas_guard_autoload.activated, "pallas_guard" in sys.modules, "jax" in sys.modules)
    code = "import pallas_guard_autoload; print(pallas_guard_autoload.activated)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
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
        {POLICY_ENV: "interpret"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "parent True False False",
        "subprocess True",
        "spawned ([1.0, 2.0, 3.0, 4.0], [('interpreted', 'interpret')])",
    ]


# --- Python's -W and PYTHONWARNINGS, with pallas_guard installed (not on PYTHONPATH) -------------

WARN_SCRIPT = KERNEL + "print(add_one(jnp.arange(4.0)).tolist())\n"


@pytest.mark.parametrize(
    ("venv", "how", "explicit_import"),
    [("autoload", "-W", False), ("plain", "PYTHONWARNINGS", True)],
    ids=["autoload, -W", "import, PYTHONWARNINGS"],
)
def test_python_warning_options_naming_the_category_are_honoured(
    venvs: dict[str, Path], venv: str, how: str, explicit_import: bool
) -> None:
    """Python drops the option at start-up (site-packages is not importable
    yet) and says so; pallas_guard applies it when it is imported."""
    option = "error::pallas_guard.PallasGuardWarning"
    env = {POLICY_ENV: "warn"}
    if how == "PYTHONWARNINGS":
        env["PYTHONWARNINGS"] = option
    code = ("import pallas_guard\n" if explicit_import else "") + WARN_SCRIPT
    result = run(venvs[venv], code, env, interpreter_args=("-W", option) if how == "-W" else ())
    assert "Invalid -W option ignored: invalid module name: 'pallas_guard'" in result.stderr  # Python's own line
    assert result.returncode == 1, result.stdout + result.stderr
    assert any(
        line.startswith("pallas_guard.PallasGuardWarning: pallas_guard: ") for line in result.stderr.splitlines()
    )
    assert result.stdout == ""


def test_a_message_filter_needs_no_import_at_startup(venvs: dict[str, Path]) -> None:
    """The documented alternative (docs/activation-and-startup.md): match our messages (they start with
    "pallas_guard:"), not the category."""
    result = run(
        venvs["autoload"], WARN_SCRIPT, {POLICY_ENV: "warn"}, interpreter_args=("-W", "error:pallas_guard:UserWarning")
    )
    assert "Invalid -W option ignored" not in result.stderr
    assert result.returncode == 1, result.stdout + result.stderr
    assert any(
        line.startswith("pallas_guard.PallasGuardWarning: pallas_guard: ") for line in result.stderr.splitlines()
    )


def test_a_later_warning_option_wins_as_in_python(venvs: dict[str, Path]) -> None:
    options = ("-W", "error::pallas_guard.PallasGuardWarning", "-W", "ignore::pallas_guard.PallasGuardWarning")
    result = run(venvs["autoload"], WARN_SCRIPT, {POLICY_ENV: "warn"}, interpreter_args=options)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1.0, 2.0, 3.0, 4.0]"
    assert "PallasGuardWarning" not in result.stderr


# --- sitecustomize ---------------------------------------------------------------------------------

ACTIVATE_SITECUSTOMIZE = """
import pallas_guard_autoload
pallas_guard_autoload.activate()
print("user sitecustomize ran to the end")
"""

IMPORT_SITECUSTOMIZE = """
import pallas_guard
print("user sitecustomize ran to the end")
"""


def test_sitecustomize_calling_activate_is_the_autoload(venvs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(ACTIVATE_SITECUSTOMIZE)
    code = (
        LOADED
        + KERNEL
        + "add_one(jnp.arange(4.0))\nimport pallas_guard\nprint([d.action for d in pallas_guard.decisions()])"
    )
    result = run(venvs["plain"], code, {POLICY_ENV: "interpret"}, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["user sitecustomize ran to the end", "False True []", "['interpreted']"]


def test_sitecustomize_calling_activate_with_a_bad_value_behaves_as_the_autoload(
    venvs: dict[str, Path], tmp_path: Path
) -> None:
    """One line at start-up, the program runs, an explicit import raises."""
    (tmp_path / "sitecustomize.py").write_text(ACTIVATE_SITECUSTOMIZE)
    code = "print('running', flush=True)\nimport pallas_guard"
    result = run(venvs["plain"], code, {POLICY_ENV: "loud"}, pythonpath=tmp_path)
    assert result.stdout.splitlines() == ["user sitecustomize ran to the end", "running"]
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("pallas_guard: PALLAS_GUARD_POLICY='loud' is not a valid pallas_guard policy")
    assert lines[-1].startswith("pallas_guard.PallasGuardConfigError: PALLAS_GUARD_POLICY='loud'")
    assert result.returncode == 1


def test_sitecustomize_importing_pallas_guard_installs_it(venvs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(IMPORT_SITECUSTOMIZE)
    code = """
    from pallas_guard._surfaces import install as _install; from pallas_guard._vocabulary import settings as _settings
    print(_install.status().requested, _settings.current_policy().value.value)
    """
    result = run(venvs["plain"], code, {POLICY_ENV: "interpret"}, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["user sitecustomize ran to the end", "True interpret"]


def test_sitecustomize_importing_pallas_guard_with_a_bad_value_keeps_running_and_the_api_raises(
    venvs: dict[str, Path], tmp_path: Path
) -> None:
    """No silently guard-less module that says ``warn``: the API names the variable."""
    (tmp_path / "sitecustomize.py").write_text(IMPORT_SITECUSTOMIZE)
    code = """
    import pallas_guard
    for call in (pallas_guard.get_policy, pallas_guard.install):
        try:
            print(call(), flush=True)
        except pallas_guard.PallasGuardConfigError as error:
            print("raised", str(error).split(" is not")[0], flush=True)
    from pallas_guard._surfaces import install as _install
    print("requested:", _install.status().requested)
    """
    result = run(venvs["plain"], code, {POLICY_ENV: "loud"}, pythonpath=tmp_path)
    assert result.stdout.splitlines() == [
        "user sitecustomize ran to the end",
        "raised PALLAS_GUARD_POLICY='loud'",
        "raised PALLAS_GUARD_POLICY='loud'",
        "requested: True",  # installed: its first kernel raises the same error
    ]
    assert result.returncode == 0, result.stderr
    accepted = OPTIONS["policy"].accepted
    assert result.stderr.splitlines() == [
        f"pallas_guard: PALLAS_GUARD_POLICY='loud' is not a valid pallas_guard policy; accepted values "
        f"(case-insensitive): {accepted} (the guard stays installed: each Pallas kernel it sees raises this "
        "error until the value is fixed)."
    ]


def test_users_own_sitecustomize_keeps_running_beside_the_autoload(venvs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.user_sitecustomize_ran = True\n")
    code = LOADED + "print(sys.user_sitecustomize_ran)"
    result = run(venvs["autoload"], code, {POLICY_ENV: "warn"}, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "[]", "True"]


def test_startup_detection_is_false_in_ordinary_code(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _install.during_site_startup()
    monkeypatch.setattr(sys, "argv", ["/venv/bin/pallas-guard", "doctor"])
    assert _install.cli_startup()
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-X", "importtime", "-m", "pallas_guard", "doctor"])
    assert _install.cli_startup()
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "-m", "pallas_guard"])
    assert not _install.cli_startup()  # `-m pallas_guard` there is pytest's marker expression


# --- the wheel: both start-up files, and the PEP 829 entry point as CPython 3.15's site calls it ---


def test_the_wheel_ships_the_start_file_beside_the_pth(built_wheel: Path) -> None:
    """Python >= 3.15 runs the .start entry point (and ignores the .pth import line)."""
    with zipfile.ZipFile(built_wheel) as archive:
        names = set(archive.namelist())
        assert archive.read("pallas_guard_autoload.start").decode() == START_FILE.read_text()
        assert archive.read("pallas_guard_autoload.pth").decode() == PTH_FILE.read_text()
    for top_level in ("pallas_guard_autoload.py", "pallas_guard_pytest.py", "pallas_guard/__init__.py"):
        assert top_level in names


SITE_315 = (
    """
# What CPython 3.15's site does with <name>.start files (PEP 829), after the path extensions:
# every non-blank, non-comment line is a "pkg.mod:callable" entry point, resolved with
# pkgutil.resolve_name() and called with no arguments.
import os, pkgutil, sys
site_packages, dependencies = sys.argv[1], sys.argv[2:]
sys.path.append(site_packages)
sys.path.extend(dependencies)
for name in sorted(os.listdir(site_packages)):
    if name.endswith(".start") and not name.startswith("."):
        with open(os.path.join(site_packages, name), encoding="utf-8-sig") as file:
            for line in file:
                line = line.strip()
                if line and not line.startswith("#"):
                    pkgutil.resolve_name(line)()
print("at start-up:", "pallas_guard" in sys.modules, sys.modules["pallas_guard_autoload"].activated, flush=True)
"""
    + KERNEL
    + """
print(add_one(jnp.arange(4.0)).tolist())
import pallas_guard
patched = pallas_guard._surfaces.install.status().patched
print(len(patched) > 0, [(d.action, d.policy.value) for d in pallas_guard.decisions()])
"""
)


def test_the_start_entry_point_called_as_python_315_calls_it_activates_the_guard(
    built_wheel: Path, tmp_path: Path
) -> None:
    """A fresh interpreter without site (-S), the wheel unpacked, its .start
    processed as PEP 829 says; only the entry point can have activated the guard."""
    python = make_venv(tmp_path / "venv", autoload=True, wheel=built_wheel)
    site_packages = venv_site_packages(python)
    (site_packages / "pallas_guard_autoload.pth").unlink()  # ignored by 3.15 anyway: prove it is not needed
    result = subprocess.run(
        [sys.executable, "-S", "-c", SITE_315, str(site_packages), *dependency_paths()],
        env=clean_env({POLICY_ENV: "interpret", "JAX_PLATFORMS": "cpu"}, checkout_on_path=False),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "at start-up: False True",
        "[1.0, 2.0, 3.0, 4.0]",
        "True [('interpreted', 'interpret')]",
    ]
    assert result.stderr == ""
