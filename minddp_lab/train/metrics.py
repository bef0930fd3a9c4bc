"""``metrics.jsonl``: one JSON object per line, written by rank 0 beside the checkpoint.

Two kinds of rows, both with ``step`` (optimizer steps so far) and ``epoch``
(1-based): training rows (``loss``: the mean over the steps since the
previous row, ``samples_per_s``) and evaluation rows (``val_loss``, and
``val_accuracy`` for classifiers).

Resuming from a checkpoint at step S redoes the steps after S, so the rows
after S are removed when the run starts (the file is rewritten atomically);
a fresh run starts a fresh file. Each row is flushed as written, so a killed
run leaves whole lines behind, at most the last one cut (and dropped on read).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

__all__ = ["METRICS", "MetricsLog", "read_metrics"]

METRICS = "metrics.jsonl"


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics file; a line cut short by a crash is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class MetricsLog:
    """Appends rows to ``directory/metrics.jsonl`` on rank 0; does nothing elsewhere or without a directory."""

    def __init__(self, directory: str | None, rank: int, resumed_at: int | None):
        self.path = os.path.join(directory, METRICS) if directory and rank == 0 else None
        if self.path is None:
            return
        os.makedirs(directory, exist_ok=True)
        kept = []
        if resumed_at is not None and os.path.exists(self.path):
            kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= resumed_at]
        fd, tmp = tempfile.mkstemp(prefix=".metrics-", dir=directory)
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(tmp, self.path)

    def write(self, **row: Any) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
