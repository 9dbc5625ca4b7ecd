"""JAX's own TPU Pallas tests, run on a CPU under pallas_guard, with and without its checks.

    python tests/jax_suite/run.py [--checks all,agree] [--files tpu_pallas_test.py ...] [--out FILE]

Each test file runs twice in one pytest process each (policy ``interpret``, device ``tpu-v5e``):
once with ``PALLAS_GUARD_CHECKS=none``, once with the checks asked for. A **false finding** is a
test that passes without the checks and fails (or errors) with them, or a finding the guard
records (``found by the ... check``) in a test that passes without the checks, whether the test
then fails or catches it. A test that fails without the checks and passes with them is counted
too, and those among them that passed because the ``compile`` check refused a kernel (JAX's
tests that expect the TPU compiler's refusal: ``MosaicError``, ``JaxRuntimeError`` for VMEM) are
listed. The exit code is 1 where any false finding was seen, 0 otherwise (also when JAX's tests
could not be found: the run is then skipped, saying so).

JAX's tests are not in this repository, nor in jax's sdist on PyPI (measured for 0.10.2: it
holds ``jax/`` only). They are read, at the tag of the installed jax (``jax-vX.Y.Z``), from a git
repository of jax: ``--jax-source`` or ``JAX_SUITE_SOURCE`` (a bare git directory, a clone, or a
checkout at that version), else a mirror at a known place, else a shallow ``git clone`` from
GitHub (where the network allows it). Two test helpers that the jax wheel lacks
(``jax/_src/pallas/pallas_test_util.py``, ``jax/_src/hypothesis_test_util.py``) come from the same
place; ``conftest.py`` beside this file registers them and presents a TPU v5e to JAX's test
utilities, so that the TPU tests run (their kernels interpreted by the guard).

Needs jax, libtpu (the compile check: the version ``jax[tpu]`` pins), pytest, absl-py and
hypothesis, and this project installed (its pytest plugin loads from its entry point).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("tpu_pallas_test.py", "tpu_pallas_state_test.py", "tpu_ops_test.py")
OTHER_FILES = ("tpu_pallas_distributed_test.py", "tpu_pallas_interpret_distributed_test.py")
"""Run when named (--files): the distributed tests need several CPU devices (``--devices``); JAX's
interpret-mode ones (``--interpret-classes``) pass ``interpret=`` themselves."""
HELPERS = {
    "pallas_test_util.py": "jax/_src/pallas/pallas_test_util.py",
    "hypothesis_test_util.py": "jax/_src/hypothesis_test_util.py",
}
MIRRORS = (
    "/work/.mirror/jax-ml+jax/repo",
    os.path.expanduser("~/.cache/pallas_guard-ci/jax.git"),
)
CLONE_URL = "https://github.com/jax-ml/jax"
# JAX's interpret-mode classes (INTERPRET = True) pass interpret=True themselves: the guard does
# not choose their interpreter. Left out unless --interpret-classes.
NOT_INTERPRET = "not Interpret"
FAILED = ("failed", "error", "crashed")


# --- JAX's tests, from git ------------------------------------------------------------------------


def _git(git_dir: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False)


def _git_dir(path: str) -> str | None:
    """The git directory of ``path`` (bare, or a clone's ``.git``), else None."""
    for candidate in (os.path.join(path, ".git"), path):
        if os.path.isdir(candidate) and _git(candidate, "rev-parse", "--git-dir").returncode == 0:
            return candidate
    return None


def _extract_from_git(git_dir: str, tag: str, files: list[str], into: Path) -> str | None:
    """Writes JAX's test files and helpers at ``tag`` into ``into``; None, else why not."""
    wanted = {name: f"tests/pallas/{name}" for name in files}
    wanted |= {f"_helpers/{name}": path for name, path in HELPERS.items()}
    for target, path in wanted.items():
        shown = _git(git_dir, "show", f"{tag}:{path}")
        if shown.returncode != 0:
            return f"{git_dir} has no {tag}:{path} ({shown.stderr.decode(errors='replace').strip()})"
        (into / target).parent.mkdir(parents=True, exist_ok=True)
        (into / target).write_bytes(shown.stdout)
    return None


def _extract_from_checkout(root: str, files: list[str], into: Path) -> str | None:
    wanted = {name: f"tests/pallas/{name}" for name in files}
    wanted |= {f"_helpers/{name}": path for name, path in HELPERS.items()}
    for target, path in wanted.items():
        source = Path(root) / path
        if not source.is_file():
            return f"{root} has no {path}"
        (into / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, into / target)
    return None


def extract(source: str | None, jax_version: str, files: list[str], into: Path) -> tuple[str | None, str]:
    """JAX's tests into ``into``: (None, where from) or (why not, what was tried)."""
    tag = f"jax-v{jax_version}"
    tried = []
    candidates = [source] if source else [*MIRRORS]
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate):
            tried.append(f"{candidate}: absent")
            continue
        git_dir = _git_dir(candidate)
        if git_dir is not None and _git(git_dir, "rev-parse", "--verify", "-q", f"{tag}^{{commit}}").returncode == 0:
            why = _extract_from_git(git_dir, tag, files, into)
            if why is None:
                return None, f"{git_dir} at {tag}"
            tried.append(why)
        elif source:  # a checkout given by hand, at the version it is at
            why = _extract_from_checkout(candidate, files, into)
            if why is None:
                return None, f"{candidate} (a checkout; its version unchecked)"
            tried.append(why)
        else:
            tried.append(f"{candidate}: no tag {tag}")
    if not source and shutil.which("git"):
        clone = into.parent / "jax.git"
        command = ["git", "clone", "-q", "--bare", "--depth", "1", "--filter=blob:none", "--branch", tag]
        cloned = subprocess.run(
            [*command, CLONE_URL, str(clone)],
            capture_output=True,
            check=False,
            timeout=300,
        )
        if cloned.returncode == 0:
            why = _extract_from_git(str(clone), tag, files, into)
            if why is None:
                return None, f"{CLONE_URL} at {tag}"
            tried.append(why)
        else:
            error = cloned.stderr.decode(errors="replace").strip()[-200:]
            tried.append(f"git clone {CLONE_URL} --branch {tag}: {error}")
    return "JAX's tests were not found", "; ".join(tried)


# --- running and reading --------------------------------------------------------------------------


@dataclass
class Run:
    checks: str
    outcomes: dict[str, str] = field(default_factory=dict)
    """test id -> passed, failed, error or skipped."""
    messages: dict[str, str] = field(default_factory=dict)
    """test id -> the failure's text (failed and error only)."""
    findings: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """test id -> the findings the guard recorded in it."""
    seconds: float = 0.0
    returncode: int = 0
    header: str = ""
    crashed: list[str] = field(default_factory=list)
    """Node ids of tests that aborted the pytest process."""
    started: set[str] = field(default_factory=set)


def run_pytest(
    suite: Path, files: list[str], checks: str, args: argparse.Namespace, logs: Path, *, policy: str = "interpret"
) -> Run:
    """One pytest process over ``files``; where a test aborts the process (a crash in native code),
    that test is recorded as ``crashed`` and pytest runs again over the tests not yet run. Policy
    ``off``: JAX's own behaviour on the CPU, the run without the guard."""
    name = checks if policy == "interpret" else f"policy-{policy}"
    results = logs / f"results-{name}.jsonl"
    findings = logs / f"findings-{name}.jsonl"
    done = logs / f"done-{name}.txt"
    for path in (results, findings, done):
        path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        PALLAS_GUARD_POLICY=policy,
        PALLAS_GUARD_DEVICE=args.device,
        PALLAS_GUARD_CHECKS=checks,
        JAX_SUITE_UNDER_GUARD=str(suite),
        JAX_SUITE_UNDER_GUARD_FINDINGS=str(findings),
        JAX_SUITE_UNDER_GUARD_RESULTS=str(results),
        JAX_SUITE_UNDER_GUARD_DONE=str(done),
        PYTHONUNBUFFERED="1",
    )
    for variable in (
        "PALLAS_GUARD_INTERPRETER",
        "PALLAS_GUARD_DETECT_RACES",
        "PALLAS_GUARD_MAX_STEPS",
        "PALLAS_INTERPRET",
    ):
        env.pop(variable, None)
    if args.devices:  # several CPU devices, as the distributed tests need: set before the backend starts
        count = f"--xla_force_host_platform_device_count={args.devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {count}".strip()
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE"]
    if not _plugin_installed():
        command += ["-p", "pallas_guard_pytest"]
    selection = [] if args.interpret_classes else [NOT_INTERPRET]
    if args.k:
        selection.append(f"({args.k})")
    if selection:
        command += ["-k", " and ".join(selection)]
    command += files
    print(f"jax_suite: checks={name}: {' '.join(command[1:])}", flush=True)
    result = Run(name)
    started = time.monotonic()
    for attempt in range(1, args.max_restarts + 2):
        log = logs / f"pytest-{name}-{attempt}.log"
        with log.open("w", encoding="utf-8") as out:
            completed = subprocess.run(command, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
        result.returncode = completed.returncode
        text = log.read_text(encoding="utf-8", errors="replace")
        result.header = result.header or next((x for x in text.splitlines() if x.startswith("pallas_guard:")), "")
        crashed = _read_results(results, result)
        if crashed is None or completed.returncode in (0, 1, 5):
            break
        result.crashed.append(crashed)
        tail = " ".join(line.strip() for line in text.splitlines()[-400:] if "Fatal Python error" in line)
        print(
            f"jax_suite: checks={name}: {crashed} aborted the process ({tail or completed.returncode}); "
            f"again over the tests not yet run (log {log})",
            flush=True,
        )
        done.write_text("".join(f"{test}\n" for test in result.started), encoding="utf-8")
    result.seconds = time.monotonic() - started
    if findings.exists():
        for line in findings.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            result.findings.setdefault(_test_id(row["test"]), []).append(row)
    print(
        f"jax_suite: checks={name}: {dict(sorted(Counter(result.outcomes.values()).items()))} "
        f"in {result.seconds:.0f} s (pytest exit {result.returncode}); logs in {logs}",
        flush=True,
    )
    return result


def _plugin_installed() -> bool:
    return any(ep.value == "pallas_guard_pytest" for ep in importlib.metadata.entry_points(group="pytest11"))


def _test_id(nodeid: str) -> str:
    """``tpu_ops_test.py::OpsTest::test_x`` -> ``tpu_ops_test.OpsTest.test_x``."""
    return nodeid.replace(".py::", ".", 1).replace("::", ".")


def _read_results(path: Path, result: Run) -> str | None:
    """Each test's outcome from the conftest's lines; the node id of a test started but never
    reported (the process died in it), else None."""
    last_started = None
    reported: set[str] = set()
    if not path.exists():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        nodeid, test = row["test"], _test_id(row["test"])
        result.started.add(nodeid)
        if row["when"] == "start":
            last_started = nodeid
            continue
        reported.add(nodeid)
        outcome = row["outcome"]
        if outcome == "failed":
            outcome = "failed" if row["when"] == "call" else "error"
            result.messages.setdefault(test, row["message"])
        if result.outcomes.get(test) in FAILED:
            continue  # a teardown error after a failure: the failure stands
        if outcome != "passed" or row["when"] == "call":
            result.outcomes[test] = outcome
    for nodeid in result.crashed:
        result.outcomes[_test_id(nodeid)] = "crashed"
    if last_started is not None and last_started not in reported:
        result.outcomes[_test_id(last_started)] = "crashed"
        return last_started
    return None


# --- comparing ------------------------------------------------------------------------------------


def false_findings(base: Run, checked: Run) -> list[tuple[str, str]]:
    """(test, what) for each test that passes without checks and fails with them, or has a finding."""
    rows = []
    for test, outcome in sorted(base.outcomes.items()):
        if outcome != "passed":
            continue
        after = checked.outcomes.get(test)
        finds = checked.findings.get(test, [])
        if after == "crashed":
            rows.append((test, f"aborted the pytest process with checks={checked.checks} (a crash in native code)"))
        elif after in FAILED:
            text = _first_finding_line(checked.messages.get(test, "")) or "(no finding text)"
            rows.append((test, f"{after} with checks={checked.checks}: {text}"))
        elif finds:
            what = "; ".join(f"{row['check']}: {row['reason']}" for row in finds)
            rows.append((test, f"passes, but the guard found: {what}"))
    return rows


def _first_finding_line(message: str) -> str:
    for line in message.splitlines():
        if "found by the" in line or "PallasGuardError" in line:
            return line.strip()[:600]
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0][:600] if lines else ""


def now_passing(base: Run, checked: Run) -> list[tuple[str, str]]:
    """(test, checks that found something in it) for tests failing without checks, passing with them."""
    rows = []
    for test, outcome in sorted(base.outcomes.items()):
        if outcome in FAILED and checked.outcomes.get(test) == "passed":
            found = sorted({row["check"] for row in checked.findings.get(test, [])})
            rows.append((test, ",".join(found)))
    return rows


def per_file(run: Run) -> dict[str, Counter[str]]:
    table: dict[str, Counter[str]] = {}
    for test, outcome in run.outcomes.items():
        table.setdefault(test.split(".", 1)[0] + ".py", Counter())[outcome] += 1
    return table


def report(
    base: Run, checked: Run, source: str, jax_version: str, device: str, *, without: Run | None = None
) -> tuple[str, int]:
    false = false_findings(base, checked)
    passing = now_passing(base, checked)
    refusals = [test for test, found in passing if "compile" in found.split(",")]
    runs = [run for run in (without, base, checked) if run is not None]
    heads = {"policy-off": "without the guard (policy off)", "none": "checks=none"}
    lines = [
        f"JAX {jax_version} TPU Pallas tests on a CPU under pallas_guard (policy interpret, "
        f"device {device}); tests from {source}",
        "",
        "| file | tests | "
        + " | ".join(
            f"passed / failed / error / skipped / crashed, {heads.get(r.checks, f'checks={r.checks}')}" for r in runs
        )
        + " |",
        "|---|---|" + "---|" * len(runs),
    ]
    tables = [per_file(run) for run in runs]
    for name in sorted(set().union(*tables)):
        cells = [
            " / ".join(
                str(t.get(name, Counter())[word]) for word in ("passed", "failed", "error", "skipped", "crashed")
            )
            for t in tables
        ]
        lines.append(f"| {name} | {sum(tables[-2].get(name, Counter()).values())} | {' | '.join(cells)} |")
    lines += [
        "| time | | " + " | ".join(f"{run.seconds:.0f} s" for run in runs) + " |",
        "",
        f"False findings (pass with checks=none; fail with checks={checked.checks}, or a finding recorded): "
        f"{len(false)}",
    ]
    lines += [f"- {test}: {what}" for test, what in false]
    lines += [
        "",
        f"Failing with checks=none, passing with checks={checked.checks}: {len(passing)}",
    ]
    lines += [f"- {test}" + (f" (found by: {found})" if found else "") for test, found in passing]
    lines += [
        "",
        "... of which pass because the compile check refused a kernel (tests that expect the TPU "
        f"compiler's refusal): {len(refusals)}",
    ]
    if without is not None:
        rescued = now_passing(without, base)
        lines += ["", f"Failing without the guard, passing under it (checks=none): {len(rescued)}"]
        lines += [f"- {test}" for test, _ in rescued]
        broken = [t for t, o in sorted(without.outcomes.items()) if o == "passed" and base.outcomes.get(t) in FAILED]
        lines += ["", f"Passing without the guard, failing under it (checks=none): {len(broken)}"]
        lines += [f"- {test}: {_first_finding_line(base.messages.get(test, ''))[:300]}" for test in broken]
    crashes = [test for test, outcome in sorted(checked.outcomes.items()) if outcome == "crashed"]
    if crashes:
        lines += ["", f"Aborted the pytest process with checks={checked.checks} (any outcome without): {len(crashes)}"]
        lines += [f"- {test} (checks=none: {base.outcomes.get(test)})" for test in crashes]
    changed = [
        (test, outcome, checked.outcomes.get(test))
        for test, outcome in sorted(base.outcomes.items())
        if outcome in FAILED
        and checked.outcomes.get(test) in FAILED
        and _first_finding_line(checked.messages.get(test, "")).find("found by the") >= 0
    ]
    if changed:
        lines += ["", f"Failing either way, with a finding under checks={checked.checks}: {len(changed)}"]
        lines += [f"- {test}: {_first_finding_line(checked.messages.get(test, ''))[:300]}" for test, _, _ in changed]
    return "\n".join(lines) + "\n", len(false)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checks", default="all,agree", help="the checks compared with none (default: all,agree, every check)"
    )
    parser.add_argument("--files", nargs="+", default=list(FILES), choices=FILES + OTHER_FILES, metavar="FILE")
    parser.add_argument("--out", type=Path, help="also write the summary (Markdown) to this file")
    parser.add_argument("--jax-source", default=os.environ.get("JAX_SUITE_SOURCE"), help="a jax git repo or checkout")
    parser.add_argument("--device", default="tpu-v5e", help="PALLAS_GUARD_DEVICE for both runs")
    parser.add_argument("--interpret-classes", action="store_true", help="also JAX's INTERPRET = True classes")
    parser.add_argument("-k", help="a pytest -k expression to narrow the tests")
    parser.add_argument("--max-restarts", type=int, default=20, help="runs again after so many aborts at most")
    parser.add_argument("--keep", type=Path, help="keep the extracted tests and the logs here")
    parser.add_argument(
        "--without-guard", action="store_true", help="also a run with policy off (JAX's own behaviour on a CPU)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        help="CPU devices (XLA_FLAGS) for every run; default: 4 where a distributed test file is run",
    )
    args = parser.parse_args(argv)
    if args.devices is None and set(args.files) & set(OTHER_FILES):
        args.devices = 4

    jax_version = importlib.metadata.version("jax")
    work = Path(tempfile.mkdtemp(prefix="pallas_guard-jax-suite."))
    try:
        suite = work / "suite"
        suite.mkdir()
        why, source = extract(args.jax_source, jax_version, args.files, suite)
        if why is not None:
            print(
                f"jax_suite: skipped: {why} for jax {jax_version} ({source}). Give a jax git repository "
                "with --jax-source or JAX_SUITE_SOURCE."
            )
            return 0
        shutil.copyfile(HERE / "conftest.py", suite / "conftest.py")
        logs = args.keep or work
        logs.mkdir(parents=True, exist_ok=True)
        print(f"jax_suite: JAX {jax_version}'s tests from {source}", flush=True)
        without = run_pytest(suite, args.files, "none", args, logs, policy="off") if args.without_guard else None
        base = run_pytest(suite, args.files, "none", args, logs)
        checked = run_pytest(suite, args.files, args.checks, args, logs)
        if not base.outcomes or not checked.outcomes:
            print("jax_suite: a run produced no test results; see its log above")
            return 2
        for run in (base, checked):
            print(f"jax_suite: checks={run.checks}: {run.header or 'no pallas_guard header line in the pytest log'}")
        text, false = report(base, checked, source, jax_version, args.device, without=without)
        print()
        print(text)
        if args.out:
            args.out.write_text(text, encoding="utf-8")
        # Last, in pytest's words, for .ci/run (it reads the counts off the last such line): each of
        # JAX's tests compared is one check here, failed where it is a false finding.
        compared = len(set(base.outcomes) | set(checked.outcomes))
        print(
            f"jax_suite: {compared - false} passed, {false} failed: JAX's tests compared, checks=none "
            f"against checks={checked.checks} (a failure is a false finding)"
        )
        return 1 if false else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
