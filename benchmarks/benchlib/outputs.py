"""What the measuring scripts share: run a job of ranks that writes JSON, then print and keep the result."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

from minddp_lab.links import spawn


def ranks_json(rank_main: Callable, world_size: int, args: dict, link: str | None = None) -> Any:
    """Run ``rank_main(rank, world_size, args, path)`` on ``world_size`` Gloo ranks; what they wrote to ``path``.
    ``link``: a rate such as ``"1gbit"``: the ranks talk over shaped links (:mod:`minddp_lab.links.namespaces`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raw.json")
        spawn(rank_main, world_size, args, path, backend="gloo", link=link)
        with open(path) as f:
            return json.load(f)


def emit(text: str, text_path: str | None, json_path: str | None, payload: dict) -> None:
    """Print the table, and write it (``--text``) and the figures behind it (``--json``) where asked."""
    print(text)
    if text_path:
        with open(text_path, "w") as f:
            f.write(text + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)
