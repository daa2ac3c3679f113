"""Whole flows against a real Prefect server, one per test process (tests/conftest.py)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _prefect_for_all(prefect_api: str) -> str:
    """Every integration test's flows and `trainflow run`s use the session's Prefect server."""
    return prefect_api


@pytest.fixture(autouse=True)
def _served(served_commands: Path) -> Path:
    """Every integration test's `trainflow run`s go to this test process's warm command service
    (tests/conftest.py `served_commands`), as with the local stack up."""
    return served_commands
