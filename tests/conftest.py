from __future__ import annotations

from collections.abc import Iterator

import pytest

from client.store import StoreClient
from tests.helpers import StoreProcess


@pytest.fixture
def store_process(tmp_path) -> Iterator[StoreProcess]:
    """A running store process on a free loopback port, stopped (SIGTERM) afterwards."""
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log").start()
    yield proc
    proc.stop()


@pytest.fixture
def store(store_process) -> Iterator[StoreClient]:
    with store_process.client() as client:
        yield client
