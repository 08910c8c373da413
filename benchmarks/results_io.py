"""Writing a benchmark's figures: JSON for tools, Markdown for people, side by side."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(
    name: str,
    title: str,
    meta: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
) -> None:
    """benchmarks/results/<name>.json and <name>.md: how it was measured, then one row each."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    about = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    (RESULTS / f"{name}.md").write_text(f"# {title}\n\n{about}\n\n" + "\n".join(table) + "\n")
