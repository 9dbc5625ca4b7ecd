"""Shared fixtures: the suite runs with the guard off unless a test opts in, and every test
leaves jax exactly as it found it (the originals of every patched attribute, the CPU rules)."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

import pallas_guard
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary import settings as _settings

REPO_ROOT = Path(__file__).resolve().parent.parent
# A user's project, run by tests/test_quickstart.py under the guard; not tests of this suite.
collect_ignore = ["quickstart", "jax_suite"]  # jax_suite: JAX's own tests, run by tests/jax_suite/run.py

# The compile check keeps the compiles that succeeded on disk (a CI re-run reads them): each run of
# the suite starts with none, in a directory of its own, so every test compiles with libtpu itself.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pallas_guard-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

# `import pallas_guard` installed the guard with the environment's policy; tests opt in instead.
pallas_guard.uninstall()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

ORIGINAL_PALLAS_CALL = pl.pallas_call


def _cpu_rules() -> dict[object, object]:
    from pallas_guard._jax import lowering as jax_lowering

    registry = jax_lowering.lowering_registry()
    assert registry is not None
    return dict(registry.cpu)


ORIGINAL_CPU_RULES = _cpu_rules()


def _reset_settings() -> None:
    _settings.reset()


@pytest.fixture(autouse=True)
def _leave_jax_as_found() -> Iterator[None]:
    yield
    pallas_guard.uninstall()
    # The policy applies when a function is traced; a cached executable would hide the next test's.
    jax.clear_caches()
    _reset_settings()
    _record.clear()
    assert pl.pallas_call is ORIGINAL_PALLAS_CALL
    assert _cpu_rules() == ORIGINAL_CPU_RULES


@pytest.fixture
def guard() -> Callable[..., None]:
    """``guard(policy, interpreter=...)`` installs the guard for this test only."""

    def install(policy: str = "interpret", **kwargs: object) -> None:
        pallas_guard.install(policy, **kwargs)  # type: ignore[arg-type]

    return install


# --- a kernel written for GPU/TPU: no interpret= anywhere -----------------------------------


def add_kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + y_ref[...]


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


def add_interpreted_by_hand(x: jax.Array, y: jax.Array) -> jax.Array:
    return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)


@pytest.fixture
def xs() -> jax.Array:
    return jnp.arange(16, dtype=jnp.float32).reshape(2, 8)


# --- fresh interpreters, for import-time and environment behaviour -----------------------------


STARTUP_FILES = ("pallas_guard_autoload.pth", "pallas_guard_autoload.start")


def guard_variables() -> frozenset[str]:
    """Every variable the guard reads: each setting's own and its alias (``PALLAS_INTERPRET``,
    ``PALLAS_GUARD_DETECT_RACES``), taken from the settings table so a new one is never missed."""
    from pallas_guard_autoload import OPTIONS

    return frozenset(env for option in OPTIONS.values() for env in option.variables())


def clean_env(
    overrides: Mapping[str, str | None] | None = None,
    *,
    checkout_on_path: bool = True,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``base`` (default: this environment) without any variable the guard reads (nor any other
    ``PALLAS_GUARD_*``), plus ``overrides`` (None unsets): a developer's own settings never leak
    into a subprocess test.

    ``checkout_on_path``: this checkout first on ``PYTHONPATH`` (a child imports the code under
    test); False drops ``PYTHONPATH`` altogether (a throwaway venv's path file provides it).
    """
    read = guard_variables()
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in read}
    env = {k: v for k, v in env.items() if not k.startswith("PALLAS_GUARD_")}
    if checkout_on_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    else:
        env.pop("PYTHONPATH", None)
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_python(
    code: str,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 240,
    interpreter_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with this checkout importable; env entries of None unset."""
    return subprocess.run(
        [sys.executable, *interpreter_args, "-c", textwrap.dedent(code)],
        env=clean_env(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def line_of(marker: str, path: str | None = None) -> int:
    """The line number of ``marker`` in ``path`` (default: the calling file), so call-site
    assertions survive edits."""
    path = path or sys._getframe(1).f_code.co_filename
    with open(path) as source:
        for number, line in enumerate(source, start=1):
            if marker in line and "line_of(" not in line:
                return number
    raise AssertionError(marker)


# --- throwaway virtualenvs, for start-up behaviour as an installed pallas_guard has it -----------


def dependency_paths() -> list[str]:
    """The site-packages directories this interpreter imports jax, pytest, ... from."""
    return [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]


def make_venv(root: Path, *, autoload: bool, wheel: Path | None = None) -> Path:
    """A venv without pip, made from this interpreter; returns its python.

    Its site-packages gets a path file (``_paths.pth``, processed before ours) that makes jax and
    the test dependencies importable (paths listed in a ``.pth`` are added without processing the
    ``.pth`` files inside them, so no other autoload runs). pallas_guard is either this checkout
    (on the same path file; ``autoload`` copies ``pallas_guard_autoload.pth`` and ``.start``
    beside it) or, given ``wheel``, the built wheel unpacked as an installer does, dist-info and
    RECORD included (``autoload=False`` then removes the two start-up files).
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    paths = dependency_paths() if wheel is not None else [str(REPO_ROOT), *dependency_paths()]
    (site_packages / "_paths.pth").write_text("\n".join(paths) + "\n")
    if wheel is not None:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site_packages)
    for name in STARTUP_FILES:
        if not autoload:
            (site_packages / name).unlink(missing_ok=True)
        elif wheel is None:
            shutil.copyfile(REPO_ROOT / name, site_packages / name)
    return root / "bin" / "python"


def venv_site_packages(python: Path) -> Path:
    root = python.parent.parent
    return Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))


def _wheel_builder(out: Path) -> list[str] | None:
    uv = shutil.which("uv")
    if uv is None:
        try:
            import uv as uv_package  # type: ignore[import-not-found]

            uv = uv_package.find_uv_bin()
        except ImportError:
            uv = None
    if uv is not None:
        return [uv, "build", "--wheel", "--quiet", "--out-dir", str(out), str(REPO_ROOT)]
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(REPO_ROOT)]
    return None


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout built into a wheel (``uv build --wheel``, else ``pip wheel --no-deps``)."""
    out = tmp_path_factory.mktemp("wheel")
    command = _wheel_builder(out)
    if command is None:
        pytest.skip("neither uv nor pip is available to build the wheel")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    (wheel,) = out.glob("pallas_guard-*.whl")
    return wheel


def abstract_tpu_device() -> object:
    """An abstract TPU device, for host code that asks "which TPU?" (the core count) on a CPU.

    jax >= 0.10 takes the platform as a third argument; older releases only kind and core count.
    """
    device_class = getattr(jax.sharding, "AbstractDevice", None)
    if device_class is None:
        pytest.skip("this jax has no jax.sharding.AbstractDevice")
    try:
        return device_class("TPU v5 lite", 1, "tpu")
    except TypeError:
        return device_class("TPU v5 lite", 1)


def tensorcore_mesh(axis_name: str) -> object:
    """A mesh of this TPU's TensorCores, as the installed jax spells it: ``pltpu.create_tensorcore_mesh``
    (removed in jax 0.12.1, where reading it raises) or ``pltpu.TensorCoreMesh``; both ask the device
    for its core count."""
    from jax.experimental.pallas import tpu as pltpu

    create = vars(pltpu).get("create_tensorcore_mesh")
    return create(axis_name) if create is not None else pltpu.TensorCoreMesh(axis_name=axis_name)  # type: ignore[no-any-return]
