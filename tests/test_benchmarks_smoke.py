"""benchmarks/run.py runs end to end and prints its table (shape only: no timed assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT


def test_run_quick_steady_row_prints_the_table_and_json(tmp_path: Path) -> None:
    """One cheap row, two pairs: the table has its header and the row; the JSON has the same row."""
    out = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "steady", "--pairs", "2", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    # 0: every target met, 1: one missed (two pairs are noise); 2 would mean the row crashed.
    assert completed.returncode in (0, 1), completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("pallas_guard benchmarks (")
    assert "jax " in lines[0]
    table = [line for line in lines if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "row"
    assert [line.split("|")[1].strip()[:9] for line in table[2:]] == ["5. steady"]
    cells = [cell.strip() for cell in table[2].split("|")[1:-1]]
    assert float(cells[1]) > 0  # the ratio
    assert cells[4] == "<= 1.01"
    assert cells[5] in ("pass", "MISS")
    assert cells[6] == "2"
    report = json.loads(out.read_text())
    assert report["mode"] == "quick"
    assert [row["group"] for row in report["rows"]] == ["steady"]
    assert report["rows"][0]["status"] == cells[5]


def test_startup_rows_measure_the_pth_line_and_the_start_entry_point(tmp_path: Path) -> None:
    """Row 1 in two pairs: 1a, 1b (.pth), 1b' (.start), and the 1c evidence that start-up imports
    ``pallas_guard_autoload`` and nothing else of ours."""
    out = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "startup", "--pairs", "2", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode in (0, 1), completed.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["name"].split()[0] for row in rows] == ["1a.", "1b.", "1b'.", "1c."]
    assert ".pth" in rows[1]["name"] and ".start" in rows[2]["name"]
    evidence = rows[3]
    assert evidence["status"] == "pass", evidence
    assert evidence["note"].startswith("modules of ours: pallas_guard_autoload; ")


def test_run_rejects_an_unknown_row() -> None:
    """--only with a name that is not a row: argparse error naming it, exit code 2."""
    completed = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--only", "startup,nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2
    assert "'nope'" in completed.stderr
    rows = "startup, pallas_import, trace, kernels, bounds, first_call, lowering, interpreted, steady"
    assert rows in completed.stderr
