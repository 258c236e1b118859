"""kvlm.startup.in_passing_thread: work on a thread that is gone when its result comes back."""
from __future__ import annotations

import threading

import pytest

from kvlm.startup import in_passing_thread


def test_work_runs_on_another_thread_that_ends():
    seen = {}

    def work():
        seen["thread"] = threading.current_thread()
        return 42

    assert in_passing_thread(work) == 42
    assert seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()


def test_an_exception_reaches_the_caller():
    def work():
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        in_passing_thread(work)
