"""Chunkwise moves fewer bytes than headwise (issue 17's byte goal), measured with a spy.

One bf16 GatedDeltaNet step (forward + backward) per CP size 2, 4, 8 on a gloo world, at the
benchmark's shape (hidden 4096, 16 key / 32 value heads of 128) and a Qwen3-Next-like shape
(hidden 2048): the bytes each rank sends over CP collectives (``wire_bytes``). Chunkwise
converts the layout on the narrower side of each projection (``hidden_states`` before
``in_proj``, the layer output after ``out_proj``), so it must send at most 0.55x headwise's
bytes at CP=2 at the benchmark shape and less than headwise everywhere. The FLA stand-ins'
own gathers are excluded (they are not FLA's traffic; see ``wire_bytes``).
"""

from __future__ import annotations

import pytest

from _image_env import need_fla, need_tree

TOKENS = 64


def _worker(rank, world, _):
    import wire_bytes

    return wire_bytes.table(rank, world, ("bench", "qwen3_next"), TOKENS, modes=("headwise", "chunkwise"))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_chunkwise_sends_fewer_bytes_than_headwise(gloo_world, cp):
    need_tree()
    need_fla()
    ranks = gloo_world(_worker, cp, None, timeout=900)
    for rank, by_shape in enumerate(ranks):
        for shape, modes in by_shape.items():
            head, chunk = modes["headwise"]["layer"], modes["chunkwise"]["layer"]
            assert head > 0 and chunk > 0, (rank, shape, modes)
            ratio = chunk / head
            assert ratio < 1.0, f"CP={cp} rank {rank} {shape}: chunkwise/headwise bytes {ratio:.3f}"
            if cp == 2 and shape == "bench":
                assert ratio <= 0.55, f"CP=2 rank {rank} bench shape: chunkwise/headwise bytes {ratio:.3f} > 0.55"
