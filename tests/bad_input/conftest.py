"""Prints how many inputs the bad-input suite tried, by class, at the end of a run."""

from __future__ import annotations

from tests.bad_input.checks import TRIED


def pytest_terminal_summary(terminalreporter) -> None:
    if not TRIED:
        return
    classes = ", ".join(f"{kind} {count}" for kind, count in sorted(TRIED.items()))
    terminalreporter.write_line(f"bad-input suite: {sum(TRIED.values())} inputs tried ({classes})")
