"""One picture of a run: what each kernel takes of each target's memories (a TPU generation's VMEM
and SMEM, a GPU's shared memory, registers and spills), by the target's compiler (the ``compile``
check), against the limit, with its verdict.

Read from decision rows (``pallas_guard_pytest``'s JSON-able dicts: ``kernel``, ``defined_at``,
``memory``), so the pytest summary, ``--pallas-guard-report`` (Markdown with an SVG, or HTML),
``$GITHUB_STEP_SUMMARY`` and the exit summary of ``pallas-guard run`` show the same figures.
No jax here: a report is written after the run.
"""

from __future__ import annotations

import html
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pallas_guard._vocabulary.record import MemoryUse
from pallas_guard_autoload import printable


class Bar(NamedTuple):
    """One kernel's use of one memory of one target: the tightest call of it."""

    kernel: str
    defined_at: str | None
    use: MemoryUse

    @property
    def verdict(self) -> str:
        if not self.use.compiled:
            return "refused"
        if not self.use.limit:  # spilled registers: it compiles, slower
            return "spills"
        return "over" if self.use.share > 1 else "compiles"


def as_row(use: MemoryUse) -> dict[str, Any]:
    """A ``MemoryUse`` as JSON-able fields (what pytest-xdist workers hand the controller)."""
    return {
        "generation": use.generation,
        "space": use.space,
        "used": use.used,
        "limit": use.limit,
        "compiled": use.compiled,
    }


def bars(rows: Iterable[Mapping[str, Any]]) -> list[Bar]:
    """Each (kernel, generation, memory) the kernel uses once, at its largest share, tightest first."""
    best: dict[tuple[Any, ...], Bar] = {}
    for row in rows:
        for fields in row.get("memory") or ():
            use = MemoryUse(**fields)
            if not use.used:  # no SMEM operands: nothing to show
                continue
            key = (row["kernel"], row.get("defined_at"), use.generation, use.space)
            if key not in best or use.share > best[key].use.share:
                best[key] = Bar(row["kernel"], row.get("defined_at"), use)
    return sorted(best.values(), key=lambda bar: (-bar.use.share, bar.kernel, bar.use.generation, bar.use.space))


def lines(found: list[Bar], *, count: int | None = None) -> list[str]:
    """Text lines, tightest first (``count``: the first few, with how many more)."""
    if not found:
        return []
    shown = found if count is None else found[:count]
    head = f"Memory by kernel (the compile check), tightest first: {len(found)} figure(s)"
    if len(shown) < len(found):
        head += f", the first {len(shown)} (--pallas-guard-details lists all)"
    out = [head]
    for bar in shown:
        where = f" ({bar.defined_at})" if bar.defined_at else ""
        out.append(printable(f"  {bar.kernel}{where} on {bar.use.generation}: {bar.use}, {bar.verdict}"))
    return out


def markdown(found: list[Bar], *, image: str | None = None) -> str:
    """A Markdown table (a text bar per row, which GitHub's step summary renders), with ``image``
    (the SVG beside the report) above it where given."""
    out = ["## pallas_guard: memory by kernel", ""]
    if not found:
        return "\n".join([*out, "No kernel was compiled for a TPU or GPU in this run (`checks=compile`).", ""])
    if image:
        out += [f"![Memory by kernel]({image})", ""]
    out += ["| kernel | generation | memory | used | limit | share | verdict |", "|---|---|---|---|---|---|---|"]
    for bar in found:
        cells = (
            f"`{_cell(bar.kernel)}`" + (f" ({_cell(bar.defined_at)})" if bar.defined_at else ""),
            bar.use.generation,
            bar.use.space,
            bar.use.amount(bar.use.used),
            bar.use.amount(bar.use.limit) if bar.use.limit else "none",
            f"{_text_bar(bar.use.share)} {_percent(bar.use)}",
            bar.verdict,
        )
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join([*out, ""])


_WIDTH, _ROW, _LABEL = 900, 22, 330
_COLOURS = {"compiles": "#2e7d32", "over": "#c62828", "refused": "#c62828", "spills": "#ef6c00"}


def svg(found: list[Bar]) -> str:
    """Each figure as a horizontal bar against its limit (the dashed line), tightest first."""
    height = _ROW * (len(found) + 1) + 10
    span = _WIDTH - _LABEL - 190
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="12" role="img"><title>Memory by kernel</title>'
    ]
    scale = max([1.0, *(_drawn(bar.use) for bar in found)])
    limit_x = _LABEL + span / scale
    for index, bar in enumerate(found):
        y = 10 + index * _ROW
        label = html.escape(f"{bar.kernel} · {bar.use.generation} · {bar.use.space}")
        width = max(1.0, span * _drawn(bar.use) / scale)
        colour = _COLOURS[bar.verdict] if bar.verdict != "compiles" or bar.use.share < 0.9 else "#ef6c00"
        parts.append(f'<text x="{_LABEL - 6}" y="{y + 14}" text-anchor="end">{label}</text>')
        parts.append(f'<rect x="{_LABEL}" y="{y + 3}" width="{width:.1f}" height="14" fill="{colour}"/>')
        text = html.escape(str(bar.use).removeprefix(bar.use.space + " "))
        parts.append(f'<text x="{_LABEL + width + 4:.1f}" y="{y + 14}">{text}</text>')
    parts.append(
        f'<line x1="{limit_x:.1f}" y1="4" x2="{limit_x:.1f}" y2="{height - 4}" stroke="#333" stroke-dasharray="4 3"/>'
    )
    parts.append("</svg>")
    return "\n".join(parts)


def write(path: str, found: list[Bar]) -> None:
    """The report at ``path``: HTML (``.html``/``.htm``, the SVG inline) or Markdown (the SVG
    written beside it, ``<path>.svg``)."""
    if path.lower().endswith((".html", ".htm")):
        table = markdown(found).split("\n", 2)[2]  # the Markdown table, without its heading
        picture = svg(found) if found else ""
        text = (
            '<!doctype html>\n<html><head><meta charset="utf-8"><title>pallas_guard</title></head><body>\n'
            f"<h2>pallas_guard: memory by kernel</h2>\n{picture}\n<pre>{html.escape(table)}</pre>\n</body></html>\n"
        )
    else:
        image = None
        if found:
            image = os.path.basename(path) + ".svg"
            _write_text(path + ".svg", svg(found) + "\n")
        text = markdown(found, image=image)
    _write_text(path, text)


def append_step_summary(found: list[Bar], environ: Mapping[str, str] | None = None) -> bool:
    """The table appended to ``$GITHUB_STEP_SUMMARY`` (GitHub Actions shows it on the run's
    page) where that is set and there are figures; whether it was."""
    path = (os.environ if environ is None else environ).get("GITHUB_STEP_SUMMARY")
    if not path or not found:
        return False
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.write(markdown(found) + "\n")
    except OSError:  # a summary file that cannot be written is GitHub's to report, not the run's
        return False
    return True


shown_by_pytest = False
"""Set by the pytest plugin where it printed the figures in its own summary."""


def summary_at_exit() -> None:
    """This process's figures on stderr (``pallas-guard run``, where no pytest summary shows them)."""
    if shown_by_pytest:
        return
    from pallas_guard._vocabulary import record as _record

    rows = [
        {"kernel": d.kernel, "defined_at": d.defined_at, "memory": [as_row(use) for use in d.memory]}
        for d in _record.snapshot()
    ]
    for line in lines(bars(rows)):
        sys.stderr.write(f"pallas_guard: {line.strip()}\n")


def _write_text(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)


def _cell(text: str) -> str:
    return html.escape(printable(text)).replace("|", "\\|").replace("`", "'")


def _percent(use: MemoryUse) -> str:
    return f"{use.share:.0%}" if use.limit else "spilled"


def _drawn(use: MemoryUse) -> float:
    """The share a bar is drawn at: a spill (no limit) as just over its limit."""
    return use.share if use.limit else 1.05


def _text_bar(share: float, width: int = 10) -> str:
    filled = min(width, round(min(share, 1.0) * width))
    return "█" * filled + "░" * (width - filled) + ("▶" if share > 1 else "")
