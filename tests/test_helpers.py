"""The test harness itself: ranks forked from the fork server (tests.helpers.run_distributed) see what a spawned
process would, the caller's environment, working directory and sys.path at the call."""

from __future__ import annotations

import os
import sys

from tests.helpers import run_distributed


def _started(rank, world):
    pass


def _sees(rank, world, key, value, cwd, entry):
    assert os.environ.get(key) == value, (key, os.environ.get(key))
    assert os.environ.get("CHUNKED_ENTROPY_TEST_HELPERS_UNSET") is None  # unset since the fork server started
    assert os.getcwd() == cwd, (os.getcwd(), cwd)
    assert sys.path[0] == entry, sys.path[:3]


def test_ranks_take_the_callers_environment_directory_and_sys_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKED_ENTROPY_TEST_HELPERS_UNSET", "1")
    run_distributed(_started, 2)  # the fork server is running from here on (in a full session, from earlier)
    monkeypatch.delenv("CHUNKED_ENTROPY_TEST_HELPERS_UNSET")
    monkeypatch.setenv("CHUNKED_ENTROPY_TEST_HELPERS", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_distributed(_sees, 2, "CHUNKED_ENTROPY_TEST_HELPERS", "set after the fork server started", str(tmp_path),
                    str(tmp_path))
