"""``_target``: the evidence about accelerator plugins, from where the interpreter loads packages."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_python

from pallas_guard._deciding import target as _target

STRICT_KERNEL = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import pallas_guard

def add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

x = jnp.arange(4.0)
pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
"""


@pytest.fixture
def fresh_lookup() -> Iterator[None]:
    _target.installed_accelerator_plugins.cache_clear()
    yield
    _target.installed_accelerator_plugins.cache_clear()


def _distribution(directory: Path, name: str, version: str | None) -> None:
    info = directory / f"{name}-{version or '9.9.9'}.dist-info"
    info.mkdir(parents=True)
    if version is not None:
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_a_dist_info_folder_in_the_working_directory_is_no_plugin(
    fresh_lookup: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -c`/`-m` put the working directory on sys.path; a folder there is
    no plugin JAX would load."""
    _distribution(tmp_path, "libtpu", "9.9.9")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])
    assert not any(plugin.startswith("libtpu") for plugin in _target.installed_accelerator_plugins())


def test_a_plugin_where_packages_are_installed_is_found(
    fresh_lookup: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the test above: the same folder in a site directory is reported, with its version."""
    _distribution(tmp_path / "site", "libtpu", "9.9.9")
    _distribution(tmp_path / "site", "jax-cuda13-plugin", None)  # no METADATA: not an installed distribution
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "site")])
    plugins = _target.installed_accelerator_plugins()
    assert "libtpu 9.9.9" in plugins
    assert not any(plugin.startswith("jax-cuda13-plugin") for plugin in plugins)


def test_a_strict_error_does_not_claim_a_plugin_from_the_working_directory(tmp_path: Path) -> None:
    """As a user meets it: an empty libtpu-9.9.9.dist-info beside the script."""
    (tmp_path / "libtpu-9.9.9.dist-info").mkdir()
    result = run_python(STRICT_KERNEL, env={"PALLAS_GUARD_POLICY": "strict", "JAX_PLATFORMS": "cpu"}, cwd=tmp_path)
    assert result.returncode == 1
    assert "pallas_guard.PallasGuardError: pallas_guard: Pallas kernel 'add_one_kernel'" in result.stderr
    if not _target.installed_accelerator_plugins():
        assert "No accelerator plugin is installed" in result.stderr
    assert "libtpu None" not in result.stderr and "libtpu 9.9.9" not in result.stderr
