"""Fixtures every test module gets."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _keep_thread_count() -> Iterator[None]:
    """Runs with trainer.num_threads=1 (the machine's cores are shared) change torch's thread count for
    the whole process; each test module hands the count back as it found it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's shared launches (tests/launch_pool.py) wrote into one temporary directory."""
    from tests.launch_pool import remove_pool

    remove_pool()
