"""What the suite reports after the last test: tables (the real-vLLM fault table) and leaks (a component
still running after the suite), printed by tests/conftest.py.

Under pytest-xdist the tests run in worker processes, and the controller (which prints the summary and
sets the exit status) never loads a folder's conftest.py; so each worker hands its `LINES` and `LEAKS`
to the controller (tests/conftest.py: pytest_sessionfinish -> workeroutput -> pytest_testnodedown).
A leak fails the run.
"""

from __future__ import annotations

LINES: list[str] = []  # printed as they are, in the order the workers finished
LEAKS: list[str] = []  # each printed as an ERROR; any one fails the run
