"""The results as tables: fault x layout (calls, ok, truthful errors, violations), and the violations by
kind; printed, and written into docs/faults.md between its two result markers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from faults.checker import NONE, OVERLAPPING, Cell, Verdict
from faults.plan import LAYOUTS, FaultKind

BEGIN = "<!-- faults:results -->"
END = "<!-- /faults:results -->"
ROWS = [*(str(kind) for kind in FaultKind), OVERLAPPING, NONE]


def table(verdicts: list[Verdict]) -> str:
    layouts = [layout for layout in LAYOUTS if any(v.layout == layout for v in verdicts)]
    merged: dict[str, dict[str, Cell]] = {layout: {} for layout in layouts}
    for verdict in verdicts:
        for row, cell in verdict.cells.items():
            into = merged[verdict.layout].setdefault(row, Cell())
            into.calls += cell.calls
            into.ok += cell.ok
            into.truthful += cell.truthful
            into.violations += cell.violations
    head = "| fault |" + "".join(
        f" {layout}: calls | ok | truthful errors | violations |" for layout in layouts
    )
    rule = "|---|" + "---:|---:|---:|---:|" * len(layouts)
    lines = [head, rule]
    totals = {layout: Cell() for layout in layouts}
    for row in ROWS:
        if not any(row in merged[layout] for layout in layouts):
            continue
        line = f"| {row} |"
        for layout in layouts:
            cell = merged[layout].get(row, Cell())
            total = totals[layout]
            total.calls, total.ok = total.calls + cell.calls, total.ok + cell.ok
            total.truthful, total.violations = (
                total.truthful + cell.truthful,
                total.violations + cell.violations,
            )
            line += f" {cell.calls} | {cell.ok} | {cell.truthful} | {cell.violations} |"
        lines.append(line)
    line = "| **all** |"
    for layout in layouts:
        t = totals[layout]
        line += f" **{t.calls}** | **{t.ok}** | **{t.truthful}** | **{t.violations}** |"
    lines.append(line)
    return "\n".join(lines)


def kinds_table(verdicts: list[Verdict]) -> str:
    by: dict[tuple[str, str, str], int] = Counter()
    for verdict in verdicts:
        for cell, kinds in verdict.by_cell().items():
            for kind, count in kinds.items():
                by[(verdict.layout, cell, kind)] += count
    if not by:
        return "No violations."
    lines = ["| layout | fault | violation | count |", "|---|---|---|---:|"]
    for (layout, cell, kind), count in sorted(by.items()):
        lines.append(f"| {layout} | {cell} | {kind} | {count} |")
    return "\n".join(lines)


def results(verdicts: list[Verdict], header: str) -> str:
    return f"{header}\n\n{table(verdicts)}\n\n{kinds_table(verdicts)}"


def write_docs(path: Path, text: str) -> None:
    """Replace what lies between the markers of ``path`` with ``text``."""
    doc = path.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    path.write_text(doc[:start] + "\n" + text.strip() + "\n" + doc[end:])
