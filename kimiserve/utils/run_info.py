"""Where a benchmark's numbers come from (the commit of the checkout it ran in) and where they go."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """Short commit id of the checkout kimiserve runs from, or "unknown" (no git, not a checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def results_path(name: str, smoke: bool) -> str:
    """Where a benchmark writes its JSON `name` when no --out is given: benchmarks/results/ for a real run, the
    temp dir for a CPU smoke run (--dry-run, --cpu-smoke), so that a plumbing check never writes over the GPU
    figures kept in the repository."""
    return str(Path(tempfile.gettempdir()) / f"smoke_{name}" if smoke else REPO / "benchmarks" / "results" / name)
