"""The test run's own plumbing: each real server's log lives in the run's temporary folder
(``server-logs/<test module>/``) and is removed once every test of its module passed; a module
with a failure keeps its logs there (pytest keeps the last three runs' folders). And the browser
tests' shared fixtures: ``page`` (the player of the module's own ``server`` fixture in Chromium)
and ``journals`` (a module's folder for its server's ``--record-dir``)."""

from __future__ import annotations

import shutil
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

import server_harness

_failed_modules: set[str] = set()


@pytest.fixture(scope="session", autouse=True)
def _server_logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    root = tmp_path_factory.mktemp("server-logs")
    server_harness.LOG_ROOT = root
    yield
    server_harness.LOG_ROOT = None
    for folder in root.iterdir():
        if folder.name not in _failed_modules:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        _failed_modules.add(item.path.stem)
    return report


@pytest.fixture(scope="module")
def journals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the journals of the module's server (``--record-dir``)."""
    return tmp_path_factory.mktemp("journals")


@pytest.fixture
def page(server: Any) -> Iterator[Any]:
    """The player page of the requesting module's ``server`` in Debian's headless Chromium, raw frames."""
    from test_browser import open_page  # Playwright is imported by the browser tests only

    with open_page(server) as opened:
        yield opened
