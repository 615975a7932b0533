"""Lines a test wants in the run's terminal summary (figures CI logs should show even when it passes:
fuzz request counts and seeds, soak results). conftest.py prints them at the end."""

from __future__ import annotations

LINES: list[str] = []


def report(line: str) -> None:
    print(line)
    LINES.append(line)
