"""The pytest plugin, run with pytester in subprocesses, on real kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import REPO_ROOT

pytest_plugins = ("pytester",)

# Installed (the pytest11 entry point loads the plugin by itself) or only on PYTHONPATH.
_ENTRY_POINT = any(
    ep.name == "pallas_guard" and ep.value == "pallas_guard.pytest_plugin"
    for ep in metadata.entry_points(group="pytest11")
)
PLUGIN = () if _ENTRY_POINT else ("-p", "pallas_guard.pytest_plugin")

KERNELS = """
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl


def add_one_kernel(x_ref, o_ref):  # written for GPU: no interpret=
    o_ref[...] = x_ref[...] + 1.0


def add_one(x):
    return pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


X = jnp.arange(8, dtype=jnp.float32)
"""

TESTS = (
    KERNELS
    + """

def test_session_policy():
    assert float(add_one(X)[0]) == 1.0


@pytest.mark.pallas_guard("strict")
def test_marked_strict():
    import pallas_guard

    with pytest.raises(pallas_guard.PallasGuardError, match="policy 'strict'"):
        jax.jit(add_one)(X + 1)


@pytest.mark.pallas_guard(policy="interpret", interpreter="plain")
class TestMarkedClass:
    def test_in_class(self):
        import pallas_guard

        assert pallas_guard.get_policy() == "interpret"
        assert float(jax.jit(add_one)(X + 2)[0]) == 3.0
"""
)


@pytest.fixture
def tester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in list(os.environ):
        if name.startswith("PALLAS_GUARD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    return pytester


def runpytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", *args, timeout=240)


def test_option_marker_header_and_summary(tester: pytest.Pytester) -> None:
    tester.makepyfile(test_kernels=TESTS)
    result = runpytest(tester, "--pallas-guard-policy=warn", "--pallas-guard-details")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "pallas_guard: policy warn (from --pallas-guard-policy), interpreter auto (from default), target cpu *",
            "*= pallas_guard summary =*",
            "3 Pallas kernel(s): 2 interpreted (plain: 2), 1 refused, 0 left alone; in 3 test(s)",
        ]
    )
    details = [line for line in result.outlines if line.startswith(("INTERPRETED", "REFUSED"))]
    assert [line.split(": ", 1)[0] for line in details] == [
        "INTERPRETED with the plain interpreter test_kernels.py::TestMarkedClass::test_in_class",
        "REFUSED test_kernels.py::test_marked_strict",
        "INTERPRETED with the plain interpreter test_kernels.py::test_session_policy",
    ]
    assert [line.rsplit("policy ", 1)[1] for line in details] == ["interpret]", "strict]", "warn]"]


def test_without_a_policy_the_guard_stays_off_until_imported(tester: pytest.Pytester) -> None:
    tester.makepyfile(
        test_plain="""
        import sys

        def test_untouched():
            assert "pallas_guard" not in sys.modules  # the plugin took its own import back

        def test_explicit_import_installs_as_documented():
            import pallas_guard
            from pallas_guard import _install

            assert _install.status()["requested"] and pallas_guard.get_policy() == "warn"
        """
    )
    result = runpytest(tester)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["pallas_guard: inactive (give a policy with --pallas-guard-policy*"])
    result.stdout.no_fnmatch_line("*pallas_guard summary*")


@pytest.mark.parametrize(
    ("ini", "args", "message"),
    [
        ("", ("--pallas-guard-policy=loud",), "--pallas-guard-policy='loud' is not a valid pallas_guard policy"),
        (
            "pallas_guard_interpreter = cuda",
            (),
            "pallas_guard_interpreter in tox.ini='cuda' is not a valid pallas_guard interpreter",
        ),
    ],
)
def test_bad_values_are_usage_errors(tester: pytest.Pytester, ini: str, args: tuple[str, ...], message: str) -> None:
    tester.makefile(".ini", tox=f"[pytest]\n{ini}\n")
    tester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = runpytest(tester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: pallas_guard: {message}*'interpret'*" if "policy" in message else f"*{message}*"]
    )


def test_bad_marker_is_a_usage_error_naming_the_test(tester: pytest.Pytester) -> None:
    tester.makepyfile(
        test_marked="""
        import pytest

        @pytest.mark.pallas_guard("sometimes")
        def test_marked():
            pass
        """
    )
    result = runpytest(tester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*@pytest.mark.pallas_guard on test_marked.py::test_marked='sometimes' is not a valid pallas_guard policy*"]
    )


def test_xdist_summary_counts_kernels_from_every_worker(tester: pytest.Pytester) -> None:
    tester.makefile(".ini", pytest="[pytest]\npallas_guard_policy = interpret\n")
    tester.makepyfile(
        test_spread=KERNELS
        + """

@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_kernel(size):  # a new shape each: four lowerings, whichever worker runs them
    assert float(jax.jit(add_one)(jnp.ones(8 * size))[0]) == 2.0
"""
    )
    result = runpytest(tester, "-n", "2")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "pallas_guard: policy interpret (from pallas_guard_policy in pytest.ini)*",
            "*= pallas_guard summary =*",
            "4 Pallas kernel(s): 4 interpreted (plain: 4), 0 refused, 0 left alone; in 4 test(s)",
        ]
    )


def test_pallas_guard_run_activates_the_guard_in_pytest(tester: pytest.Pytester) -> None:
    tester.makepyfile(
        test_strict=KERNELS
        + """

def test_refused():
    import pallas_guard

    with pytest.raises(pallas_guard.PallasGuardError):
        add_one(X)
"""
    )
    command = [sys.executable, "-m", "pallas_guard", "run", "--policy", "strict", "--"]
    command += [sys.executable, "-m", "pytest", *PLUGIN, "-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=tester.path, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pallas_guard: policy strict (from PALLAS_GUARD_POLICY)" in result.stdout
    assert "1 Pallas kernel(s): 0 interpreted, 1 refused, 0 left alone; in 1 test(s)" in result.stdout
