"""Faults survived: the guard is never the reason a process breaks, and it loses nothing.

Import-order and missing-package cases run in fresh interpreters (real imports); the rest run
in-process against the real jax, with the conftest fixture checking jax is left as found.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ORIGINAL_PALLAS_CALL,
    REPO_ROOT,
    add,
    add_interpreted_by_hand,
    add_kernel,
    run_python,
)
from jax.experimental import pallas as pl

import pallas_guard
import pallas_guard_autoload
from pallas_guard._guard import lowering_net as _lowering
from pallas_guard._jax import config as jax_config
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._surfaces import install as _install

PACKAGE_DIR = REPO_ROOT / "pallas_guard"

# A sys.meta_path entry that makes the named top-level packages (or exact modules) unimportable.
BLOCKER = """
import sys

class _Blocker:
    def __init__(self, names, message):
        self.names, self.message = names, message

    def find_spec(self, name, path=None, target=None):
        if name in self.names or name.split(".")[0] in self.names:
            raise ModuleNotFoundError(self.message.format(name=name), name=name)
        return None

def block(*names, message="No module named {name!r}"):
    sys.meta_path.insert(0, _Blocker(set(names), message))
"""


def _last_json(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


# --- jax not installed --------------------------------------------------------------------------


def test_without_jax_import_and_install_are_harmless() -> None:
    result = run_python(
        BLOCKER
        + """
block("jax", "jaxlib")
import json
import pallas_guard
from pallas_guard._surfaces import install as _install
pallas_guard.install("strict")
pallas_guard.install()
pallas_guard.uninstall()
pallas_guard.uninstall()
pallas_guard.install("interpret", interpreter="tpu")
with pallas_guard.policy("off"):
    inside = pallas_guard.get_policy().value
try:
    import jax.experimental.pallas
    user_error = None
except ModuleNotFoundError as error:
    user_error = str(error)
status = _install.status()
print(json.dumps({
    "inside": inside, "user_error": user_error, "jax_loaded": "jax" in sys.modules,
    "wrapt_loaded": "wrapt" in sys.modules, "requested": status.requested,
    "patched": list(status.patched), "failure": status.failure, "decisions": len(pallas_guard.decisions()),
}))
""",
        env={"PALLAS_GUARD_POLICY": "warn"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = _last_json(result.stdout)
    assert report == {
        "inside": "off",
        "user_error": "No module named 'jax'",  # the user's own error, nothing of ours
        "jax_loaded": False,
        "wrapt_loaded": False,
        "requested": True,
        "patched": [],
        "failure": None,
        "decisions": 0,
    }


@pytest.mark.skipif(not (PACKAGE_DIR / "__main__.py").exists(), reason="no CLI in this checkout")
def test_without_jax_doctor_says_so() -> None:
    result = run_python(
        BLOCKER
        + """
block("jax", "jaxlib")
import runpy
sys.argv = ["pallas-guard", "doctor"]
try:
    runpy.run_module("pallas_guard", run_name="__main__")
except SystemExit as exit:
    print("exit", exit.code)
"""
    )
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    assert "jax" in output.lower() and "not installed" in output.lower(), output


# --- jax.experimental.pallas failing to import ------------------------------------------------

_BROKEN_IMPORT = (
    BLOCKER
    + """
import json, traceback
if GUARD:
    import pallas_guard
import jax
assert BLOCKED not in sys.modules
block(BLOCKED, message="simulated broken dependency: {name}")
outcomes = []
for attempt in range(2):
    try:
        importlib.import_module(TARGET)
        outcomes.append(None)
    except BaseException as error:
        chain = []
        while error is not None:
            chain.append([type(error).__name__, str(error)])
            error = error.__cause__ or error.__context__
        outcomes.append(chain)
sys.meta_path.pop(0)  # the dependency is fixed: the import works, and the guard catches up
for name in [n for n in sys.modules if n.startswith("jax.experimental.pallas") or n == BLOCKED]:
    del sys.modules[name]
pl = importlib.import_module("jax.experimental.pallas")
patched = getattr(pl.pallas_call, "_self_pallas_guard", False)
print(json.dumps({"outcomes": outcomes, "patched": patched}))
"""
)


def _broken_import(guard: bool, target: str, blocked: str) -> tuple[Any, str]:
    prelude = f"import importlib\nGUARD = {guard!r}\nTARGET = {target!r}\nBLOCKED = {blocked!r}\n"
    result = run_python(prelude + _BROKEN_IMPORT, env={"PALLAS_GUARD_POLICY": "interpret"})
    assert result.returncode == 0, result.stderr
    return _last_json(result.stdout), result.stderr


@pytest.mark.parametrize(
    ("target", "blocked"),
    [
        ("jax.experimental.pallas", "jax._src.pallas.pallas_call"),  # pallas itself cannot import
        ("jax.experimental.pallas.mosaic_gpu", "absl"),  # absl-py missing (jax 0.8.1-0.10.2 need it)
    ],
)
def test_pallas_import_error_is_the_users_unchanged(target: str, blocked: str) -> None:
    without, _ = _broken_import(False, target, blocked)
    with_guard, stderr = _broken_import(True, target, blocked)
    assert with_guard["outcomes"] == without["outcomes"]
    assert "pallas_guard" not in stderr  # no second error, no report of ours
    if blocked != "absl":  # (absl: the import fails only in jax 0.8.1-0.10.2; equal either way)
        assert without["outcomes"][0] is not None
        assert "pallas_call" in without["outcomes"][0][0][1]
    assert with_guard["patched"] is True


# --- an exception inside the guard's import hook ----------------------------------------------


def test_a_guard_that_cannot_arm_says_so_at_the_import_and_at_each_kernel() -> None:
    """wrapt is broken in this process: wrapping the entry points fails inside the post-import hook.
    The import of Pallas itself goes through (an exception raised inside it would leave JAX's modules
    half-imported) and prints one line naming the part that failed and the jax; nothing of the guard
    stays patched; each kernel that lowers for the CPU gets that reason as a PallasGuardError instead
    of JAX's bare "Only interpret mode" error; an explicit install() raises it, and arms once it can."""
    result = run_python(
        """
import json, sys
import pallas_guard
from pallas_guard._surfaces import install as _install
sys.modules["wrapt"] = None
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax._src.pallas import pallas_call as pallas_call_module
status = _install.status()
armed = _install.arm()
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
x = jnp.zeros(8)
try:
    pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
try:
    pallas_guard.install("interpret")   # explicit, outside any import: the failure raises
    raised = None
except pallas_guard.PallasGuardError as e:
    raised = str(e)
del sys.modules["wrapt"]
pallas_guard.install("interpret")   # an explicit install retries
jax.clear_caches()
again = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
print(json.dumps({
    "raised": raised, "patched": list(status.patched), "original": pl.pallas_call is pallas_call_module.pallas_call,
    "armed": armed._asdict(), "error": error, "again": again.tolist(), "rearmed": _install.arm().armed,
}))
""",
        env={"PALLAS_GUARD_POLICY": "interpret"},
    )
    assert result.returncode == 0, result.stderr
    report = _last_json(result.stdout)
    reports = [line for line in result.stderr.splitlines() if line.startswith("pallas_guard:")]
    assert len(reports) == 1, result.stderr
    assert "could not arm on jax " + jax.__version__ in reports[0]
    assert "wrapping the entry points of jax." in reports[0] and "wrapt" in reports[0]
    assert "PALLAS_GUARD_POLICY=off" in reports[0]  # what to do
    assert report["patched"] == [] and report["original"] is True  # nothing half-installed
    assert report["armed"]["armed"] is False and "NOT ARMED" in report["armed"]["text"]
    assert report["error"].startswith("PallasGuardError: pallas_guard could not arm"), report["error"]
    assert report["raised"] is not None and "could not arm" in report["raised"]
    assert report["again"] == [1.0] * 8
    assert report["rearmed"] is True


def test_a_guard_without_a_policy_that_cannot_arm_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """No policy given (the default, warn): the failure is one line on stderr, not an error in the
    user's import, and everything is undone."""

    def broken_rule(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug in the lowering net")

    monkeypatch.setattr(_lowering, "install_rule", broken_rule)
    pallas_guard.install()  # pallas is imported: the hook runs now, inside install()
    status = _install.status()
    assert status.failure == "installing the CPU lowering net failed: RuntimeError: simulated bug in the lowering net"
    assert status.patched == () and not status.active
    assert pl.pallas_call is ORIGINAL_PALLAS_CALL  # the wrappers applied first were taken off again
    _install.installation._on_import(sys.modules["jax.experimental.pallas"])  # the hook firing again
    err = capfd.readouterr().err
    assert err.count("pallas_guard: pallas_guard could not arm") == 1, err
    with pytest.raises(pallas_guard.PallasGuardError, match="installing the CPU lowering net failed"):
        pallas_guard.install("interpret")  # a policy given: the same failure raises
    pallas_guard.install("off")  # JAX's own behaviour asked for: nothing to arm, nothing raised
    assert _install.status().failure is not None


# --- install / uninstall, in any order and number -----------------------------------------------


def _finders() -> int:
    return sum(isinstance(entry, pallas_guard_autoload.PostImportFinder) for entry in sys.meta_path)


def test_install_twice_patches_once(xs: jax.Array) -> None:
    pallas_guard.install("interpret")
    first = _install.status()
    rules = list(_install.installation.rules)
    pallas_guard.install("interpret")
    assert _install.status() == first
    assert _install.installation.rules == rules
    assert pl.pallas_call.__wrapped__ is ORIGINAL_PALLAS_CALL  # one wrapper, not a wrapper of ours
    assert _finders() == 1
    np.testing.assert_array_equal(add(xs, xs), xs + xs)
    assert [d.action for d in pallas_guard.decisions()] == ["interpreted"]  # one record, not two


@pytest.mark.parametrize("order", ["uu", "iuu", "iiu", "uiiu", "iuiu"])
def test_install_uninstall_sequences(order: str, xs: jax.Array) -> None:
    for step in order:
        (pallas_guard.install if step == "i" else pallas_guard.uninstall)()  # type: ignore[operator]
    assert pl.pallas_call is ORIGINAL_PALLAS_CALL
    assert _install.status().patched == ()
    pallas_guard.install("interpret")
    np.testing.assert_array_equal(add(xs, xs), xs + xs)
    assert len(pallas_guard.decisions()) == 1


def test_reload_keeps_one_guard(monkeypatch: pytest.MonkeyPatch, xs: jax.Array) -> None:
    monkeypatch.delenv("PALLAS_GUARD_POLICY", raising=False)
    error_class = pallas_guard.PallasGuardError
    pallas_guard.install("interpret")
    reloaded = importlib.reload(pallas_guard)  # re-runs install() from the environment
    assert reloaded is pallas_guard
    assert pallas_guard.PallasGuardError is error_class  # `except` clauses written before still match
    assert _finders() == 1
    assert pl.pallas_call.__wrapped__ is ORIGINAL_PALLAS_CALL
    pallas_guard.set_policy("strict")
    with pytest.raises(error_class):
        add(xs, xs)
    assert len(pallas_guard.decisions()) == 1
    pallas_guard.uninstall()
    assert pl.pallas_call is ORIGINAL_PALLAS_CALL


_ORDERS = {
    "guard, jax, pallas": "import pallas_guard\nimport jax\nfrom jax.experimental import pallas as pl",
    "jax, guard, pallas": "import jax\nimport pallas_guard\nfrom jax.experimental import pallas as pl",
    "pallas.tpu, guard": "from jax.experimental.pallas import tpu\nimport pallas_guard\nimport jax\n"
    "from jax.experimental import pallas as pl",
}


@pytest.mark.parametrize("order", list(_ORDERS))
def test_install_before_and_after_import_jax(order: str) -> None:
    result = run_python(
        _ORDERS[order]
        + """
import json
import jax.numpy as jnp
from jax._src.pallas import pallas_call as module
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3
x = jnp.ones(4)
y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
print(json.dumps({
    "both": [getattr(f, "_self_pallas_guard", False) for f in (pl.pallas_call, module.pallas_call)],
    "y": y.tolist(), "decisions": [d.action for d in pallas_guard.decisions()],
}))
""",
        env={"PALLAS_GUARD_POLICY": "interpret"},
    )
    assert result.returncode == 0, result.stderr
    assert _last_json(result.stdout) == {"both": [True, True], "y": [3.0] * 4, "decisions": ["interpreted"]}


# --- nothing lost -------------------------------------------------------------------------------


def _grid_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    x = x_ref[...]
    o_ref[...] = jnp.sin(x) * jnp.exp(-x) + x * 0.1


def _int_kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = (x_ref[...] ^ (y_ref[...] << 3)) * 7 - (x_ref[...] >> 1)


def _sum_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = jnp.sum(x_ref[...] * x_ref[...], axis=1, keepdims=True)


def _programs(**extra: Any) -> dict[str, Any]:
    """The same kernels, with ``extra`` kwargs (``interpret=...``) or without."""

    def grid(x: jax.Array) -> jax.Array:
        spec = pl.BlockSpec((8, 16), lambda i: (i, 0))
        return pl.pallas_call(
            _grid_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(4,),
            in_specs=[spec],
            out_specs=spec,
            **extra,
        )(x)

    def ints(x: jax.Array, y: jax.Array) -> jax.Array:
        return pl.pallas_call(_int_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **extra)(x, y)

    def sums(x: jax.Array) -> jax.Array:
        return pl.pallas_call(_sum_kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), x.dtype), **extra)(x)

    def added(x: jax.Array, y: jax.Array) -> jax.Array:
        return pl.pallas_call(add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **extra)(x, y)

    return {"grid": grid, "ints": ints, "sums": sums, "add": added}


def _inputs() -> dict[str, tuple[jax.Array, ...]]:
    key = jax.random.PRNGKey(0)
    floats = jax.random.normal(key, (32, 16), dtype=jnp.float32)
    ints = jax.random.randint(key, (8, 16), -(2**20), 2**20, dtype=jnp.int32)
    return {"grid": (floats,), "ints": (ints, ints[::-1]), "sums": (floats,), "add": (floats, floats * 3)}


@pytest.mark.parametrize("policy", ["interpret", "warn"])
def test_results_bit_identical_to_interpret_true_by_hand(policy: str) -> None:
    inputs = _inputs()
    by_hand = {name: fn(*inputs[name]) for name, fn in _programs(interpret=True).items()}
    pallas_guard.install(policy)
    guarded = _programs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pallas_guard.PallasGuardWarning)
        for name, fn in guarded.items():
            for result in (fn(*inputs[name]), jax.jit(fn)(*inputs[name])):
                expected = np.asarray(by_hand[name])
                assert np.asarray(result).dtype == expected.dtype
                assert np.asarray(result).tobytes() == expected.tobytes(), name
    assert {d.action for d in pallas_guard.decisions()} == {"interpreted"}


def test_tpu_interpreter_bit_identical_to_interpret_params_by_hand() -> None:
    from jax.experimental.pallas import tpu as pltpu

    inputs = _inputs()
    by_hand = _programs(interpret=pltpu.InterpretParams())["grid"](*inputs["grid"])
    pallas_guard.install("interpret", interpreter="tpu")
    guarded = _programs()["grid"](*inputs["grid"])
    assert np.asarray(guarded).tobytes() == np.asarray(by_hand).tobytes()
    assert [d.interpreter for d in pallas_guard.decisions()] == ["tpu"]


def _bound_interpret_values(fn: Any, *args: Any) -> list[Any]:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [eqn.params["interpret"] for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]


@pytest.mark.parametrize("policy", ["interpret", "warn", "strict"])
def test_interpret_params_reach_jax_by_identity(policy: str, xs: jax.Array) -> None:
    from jax.experimental.pallas import tpu as pltpu

    pallas_guard.install(policy, interpreter="gpu")  # a forced interpreter must not replace the user's
    params = [pltpu.InterpretParams()]
    gpu_class = jax_pallas.gpu_params_class()
    if gpu_class is not None:
        params.append(gpu_class())
    for value in params:
        fn = _programs(interpret=value)["add"]
        (bound,) = _bound_interpret_values(fn, xs, xs)
        assert bound is value
    tpu_result = _programs(interpret=params[0])["add"](xs, xs)
    np.testing.assert_array_equal(tpu_result, xs + xs)
    assert [(d.action, d.interpreter) for d in pallas_guard.decisions()] == [("untouched", "tpu")]


def test_a_users_interpret_params_equal_to_an_injected_one_is_still_the_users() -> None:
    """InterpretParams compare by value: the net must recognise what the front door injected by
    identity, or a user's equal object goes unrecorded (seen when an earlier test left one alive)."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_guard._guard.ledger import Ledger

    ledger = Ledger()
    injected, users = pltpu.InterpretParams(), pltpu.InterpretParams()
    ledger.mark_injected(injected)
    assert ledger.is_injected(injected)
    assert not ledger.is_injected(users)


def _jax_state() -> dict[str, dict[str, Any]]:
    """Every callable in every Pallas module, and every lowering registry entry."""
    state: dict[str, dict[str, Any]] = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(("jax.experimental.pallas", "jax._src.pallas")):
            state[name] = {k: v for k, v in vars(module).items() if callable(v)}
    registry = jax_lowering.lowering_registry()
    assert registry is not None
    state["mlir._lowerings"] = dict(registry.common)
    mlir = importlib.import_module("jax._src.interpreters.mlir")
    for platform, rules in mlir._platform_specific_lowerings.items():
        state[f"mlir._platform_specific_lowerings[{platform}]"] = dict(rules)
    state["config"] = {"interpret_mode": jax_config.forced_interpret_value()}
    return state


def test_uninstall_leaves_jax_exactly_as_found(xs: jax.Array) -> None:
    with contextlib.suppress(ImportError):  # every module the guard patches, imported before the snapshot
        importlib.import_module("jax.experimental.pallas.mosaic_gpu")
    add_interpreted_by_hand(xs, xs)  # JAX's own lazy registrations happen before the snapshot
    before = _jax_state()
    pallas_guard.install("interpret")
    assert _jax_state() != before  # the guard did change something ...
    add(xs, xs)
    jax.jit(add)(xs, xs)
    pallas_guard.uninstall()
    after = _jax_state()
    assert after.keys() == before.keys()
    for where, values in before.items():
        assert after[where].keys() == values.keys(), where
        changed = [key for key, value in values.items() if after[where][key] is not value]
        assert changed == [], f"{where}: {changed}"  # ... and put back the very same objects


# --- security -----------------------------------------------------------------------------------


def test_nothing_named_by_a_variable_is_imported(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = """
import json, sys
outcomes = []
try:
    import pallas_guard
    outcomes.append("imported")
except ValueError as error:
    outcomes.append(type(error).__name__)
sys.modules.pop("pallas_guard", None)
import os
for name in [n for n in os.environ if n.startswith("PALLAS_GUARD_")]:
    del os.environ[name]
import pallas_guard
for call in (lambda: pallas_guard.set_policy("evilmod"), lambda: pallas_guard.install(interpreter="evilmod")):
    try:
        call()
    except ValueError as error:
        outcomes.append(type(error).__name__)
import jax.experimental.pallas
print(json.dumps({"outcomes": outcomes, "loaded": "evilmod" in sys.modules}))
"""
    for policy in ("evilmod", "__import__('evilmod')", "evilmod:main"):
        env = {
            "PALLAS_GUARD_POLICY": policy,
            "PALLAS_GUARD_INTERPRETER": "evilmod",
            "PALLAS_GUARD_DETECT_RACES": "evilmod",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tmp_path)]),
        }
        result = run_python(code, env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        report = _last_json(result.stdout)
        assert report == {"outcomes": ["PallasGuardConfigError"] * 3, "loaded": False}
        assert not marker.exists()


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.List | ast.Tuple):
        return all(_is_literal(element) for element in node.elts)
    return False


def _names_a_check(call: ast.Call) -> bool:
    """``import_module(CHECKS[name])``: the module of a check, from the settings table."""
    (arg,) = call.args
    return isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name) and arg.value.id == "CHECKS"


def test_the_package_evaluates_nothing_and_imports_only_constant_names() -> None:
    dynamic = {"eval", "exec", "compile", "__import__"}
    importers = {"import_optional", "first_attribute", "import_module"}
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            if isinstance(node.func, ast.Name) and name in dynamic:  # the builtins, not re.compile
                found.append(f"{path.name}:{node.lineno} calls {name}")
            # Only the JAX layer (the one place that locates JAX internals) imports by a variable,
            # its variables from the literal lists its callers pass; and the checks' registry, by
            # the module the settings table names.
            computed = not all(map(_is_literal, node.args))
            if name in importers and path.parent.name != "_jax" and computed and not _names_a_check(node):
                found.append(f"{path.name}:{node.lineno} imports a computed name")
    assert found == []
    for path in sorted((PACKAGE_DIR / "_jax").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _call_name(node) in importers:
                assert all(isinstance(arg, ast.Name | ast.Constant | ast.List) for arg in node.args)
        assert "environ" not in path.read_text()
    # The autoload .pth line: a constant import, gated by the variable's presence.
    for pth in REPO_ROOT.glob("*.pth"):
        for node in ast.walk(ast.parse(pth.read_text(), str(pth))):
            if isinstance(node, ast.Call) and _call_name(node) in dynamic | importers:
                assert _call_name(node) == "__import__" and all(map(_is_literal, node.args)), pth.name
