"""Whole flows against a real Prefect server, one per test process (tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _prefect_for_all(prefect_api: str) -> str:
    """Every integration test's flows and `trainflow run`s use the session's Prefect server."""
    return prefect_api
