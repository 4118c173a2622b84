"""pytest setup for the image regression suite (CPU part).

* ``$GDN_TREE`` (default ``<repo>/build/tree/patched``) goes first on ``sys.path`` so that
  ``import megatron`` resolves to the patched tree itself, never to a copy.
* Prerequisites are probed once (``_image_env``). A missing torch, FLA or tree makes the
  tests that need it skip with the reason; once the tree is present, a missing patched
  symbol is a failure (tests import the contract's names directly).
* ``gloo_world`` runs a function in a multi-process gloo world on CPU (see ``_world``).
* Marker ``fla_interpret``: the real-kernel CPU tier (``test_image_fla_interpret``), the
  slowest part of the CPU suite; ``-m "not fla_interpret"`` leaves it out.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

from _image_env import need_torch  # noqa: E402  (also sets up sys.path)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fla_interpret: real FLA kernels under the Triton interpreter (minutes on CPU)"
    )


@pytest.fixture
def gloo_world():
    """``gloo_world(fn, world_size, *args, timeout=...) -> [result of rank 0, 1, ...]``."""
    need_torch()
    from _world import run_world

    return run_world
