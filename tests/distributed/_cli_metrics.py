"""The metrics a CLI run's CSVLogger wrote, by name and step."""

from __future__ import annotations

import csv
from pathlib import Path


def metrics_by_step(csv_path: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from a Lightning ``metrics.csv`` (empty cells skipped)."""
    out: dict[str, dict[int, float]] = {}
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out
