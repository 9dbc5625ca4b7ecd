"""Import-time behaviour, each in a fresh interpreter."""

from __future__ import annotations

import pytest
from conftest import run_python

KERNEL_SCRIPT = """
import pallas_guard
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def add_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

x = jnp.arange(4.0)
print(jax.jit(lambda x: pl.pallas_call(add_kernel, out_shape=x)(x))(x).tolist())
"""


def test_import_pallas_guard_imports_neither_jax_nor_wrapt() -> None:
    result = run_python(
        """
        import sys, pallas_guard
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'wrapt')))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("order", ["guard-first", "pallas-first"])
def test_patch_applies_in_either_import_order_without_initialising_backends(order: str) -> None:
    imports = (
        "import pallas_guard\nimport jax.experimental.pallas as pl"
        if order == "guard-first"
        else "import jax.experimental.pallas as pl\nimport pallas_guard"
    )
    result = run_python(
        imports
        + """
import wrapt
from jax._src import xla_bridge
from jax._src.pallas import pallas_call as module
wrapped = isinstance(pl.pallas_call, wrapt.FunctionWrapper)
print(wrapped, module.pallas_call is pl.pallas_call, xla_bridge.backends_are_initialized())
""",
        env={"JAX_PLATFORMS": ""},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False"]


def test_target_is_unknown_before_backends_exist_and_read_from_config_after() -> None:
    result = run_python(
        """
        import pallas_guard, jax
        from pallas_guard._deciding import target as _target
        print(_target.detect().platform)
        jax.config.update("jax_platforms", "cpu")
        print(_target.detect())
        """,
        env={"JAX_PLATFORMS": ""},
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.strip().splitlines()
    assert first == "None"
    assert "platform='cpu'" in second and "set in code" in second


@pytest.mark.parametrize(
    ("policy", "expect_ok", "expect_text"),
    [
        ("interpret", True, "[1.0, 2.0, 3.0, 4.0]"),
        ("", True, "PallasGuardWarning"),
        ("strict", False, "JAX_PLATFORMS='cpu'"),
        ("off", False, "Only interpret mode is supported on CPU backend."),
    ],
)
def test_policy_from_the_environment(policy: str, expect_ok: bool, expect_text: str) -> None:
    result = run_python(KERNEL_SCRIPT, env={"PALLAS_GUARD_POLICY": policy, "JAX_PLATFORMS": "cpu"})
    assert (result.returncode == 0) is expect_ok, result.stderr
    assert expect_text in result.stdout + result.stderr


REPEATED_KERNEL = """
import warnings
import pallas_guard
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

if ACTION:
    warnings.simplefilter(ACTION, pallas_guard.PallasGuardWarning)

def add_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

def add_one(x):
    return pl.pallas_call(add_kernel, out_shape=x)(x)  # one call site

for size in (4, 8, 16):  # three lowerings
    warnings.warn("control")  # an ordinary warning at one location, for comparison
    add_one(jnp.arange(float(size)))
"""


@pytest.mark.parametrize(("action", "shown"), [("", None), ("always", 3), ("ignore", 0)])
def test_warning_repetition_is_left_to_the_filters(action: str, shown: int | None) -> None:
    """The guard keeps no memory of its own: under the default action its warning repeats exactly
    as an ordinary warning at one location does (once; on jax 0.8, whose tracing enters
    ``warnings.catch_warnings()`` and so resets Python's memory, once per lowering)."""
    result = run_python(
        REPEATED_KERNEL.replace("ACTION", repr(action)), env={"PALLAS_GUARD_POLICY": "warn", "JAX_PLATFORMS": "cpu"}
    )
    assert result.returncode == 0, result.stderr
    control = result.stderr.count("UserWarning: control")
    assert control in (1, 3)
    expected = control if shown is None else shown
    assert result.stderr.count("PallasGuardWarning: pallas_guard: Pallas kernel 'add_kernel'") == expected


def test_warning_can_be_made_an_error_from_the_command_line() -> None:
    """With the checkout on PYTHONPATH, Python resolves the category itself (see test_autoload for
    an installed pallas_guard, where it cannot)."""
    result = run_python(
        KERNEL_SCRIPT,
        env={"PALLAS_GUARD_POLICY": "warn", "JAX_PLATFORMS": "cpu"},
        interpreter_args=("-W", "error::pallas_guard.PallasGuardWarning"),
    )
    assert result.returncode != 0
    assert "PallasGuardWarning" in result.stderr


@pytest.mark.parametrize("bad", ["bogus", "STRICT!", "1"])
def test_bad_environment_policy_makes_import_raise(bad: str) -> None:
    result = run_python("import pallas_guard", env={"PALLAS_GUARD_POLICY": bad})
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pallas_guard.PallasGuardConfigError: PALLAS_GUARD_POLICY=")
    assert repr(bad) in last_line and "'interpret', 'warn', 'strict', 'off'" in last_line
