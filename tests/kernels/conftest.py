"""The kernels' shared fixture: `kernels`, kvlm's native library built for each -march (all built at the session's
first use, tests/helpers/native_builds.py)."""
from __future__ import annotations

import pytest

from kvlm.kernels.native import compiler
from helpers.native_builds import MARCHES, build_all, kernels_for


@pytest.fixture(scope="session")
def libraries():
    if compiler() is None:
        pytest.skip("no C++ compiler here: the pure-torch path is tested instead")
    return build_all()


@pytest.fixture(scope="module", params=MARCHES)
def kernels(request, libraries):
    return kernels_for(request.param, libraries)
