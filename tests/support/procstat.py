"""What a process has cost so far, read from /proc: CPU seconds (user + system, independent of
the machine's load, unlike wall time) and resident memory. Shared by tests and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU of process ``pid`` (or of the /proc stat file at that path)."""
    path = Path(pid) if isinstance(pid, str) else Path(f"/proc/{pid}/stat")
    fields = path.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now (VmRSS); 0 if it has none."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
