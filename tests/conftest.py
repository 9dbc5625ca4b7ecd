"""Shared fixtures: the suite runs with the guard off unless a test opts in, and every test
leaves jax exactly as it found it (the originals of every patched attribute, the CPU rules)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pallas_guard
from pallas_guard import _record, _settings

REPO_ROOT = Path(__file__).resolve().parent.parent

# `import pallas_guard` installed the guard with the environment's policy; tests opt in instead.
pallas_guard.uninstall()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

ORIGINAL_PALLAS_CALL = pl.pallas_call


def _cpu_rules() -> dict[object, object]:
    from pallas_guard import _internals

    registry = _internals.lowering_registry()
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


def run_python(
    code: str,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 240,
    interpreter_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with this checkout importable; env entries of None unset."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PALLAS_GUARD_")}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *interpreter_args, "-c", textwrap.dedent(code)],
        env=full_env,
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
