"""Whole flows under Prefect's test harness (a real temporary Prefect server, once per session)."""

from collections.abc import Iterator

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session", autouse=True)
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server (SQLite) for all integration tests."""
    with prefect_test_harness(server_startup_timeout=120):
        yield
