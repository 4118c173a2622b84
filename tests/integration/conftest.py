"""Shared by the integration tests: one backport cache for the whole session.

Each module used to clone both real mirrors into a fresh cache of its own (a cold clone of
Megatron-LM is the slowest part of a build); no test here asserts anything about a cold cache
(tests/unit covers cold, warm, offline and damaged caches on small repositories), so the session
shares one, filled by the first build that needs it.
"""

import pytest


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """A backport cache folder shared by every integration test of the session."""
    return tmp_path_factory.mktemp("real-mirrors-cache")
