"""Independent definitions of the two CP token layouts (plain Python, no Megatron).

zigzag (Megatron's load-balanced attention layout): every sequence of length ``L``
(``L % (2*P) == 0``) is cut into ``2*P`` equal chunks; rank ``r`` holds chunk ``r`` then
chunk ``2*P-1-r`` of each sequence, sequences in packed order.

contiguous (FLA's CP layout): the packed buffer of ``T`` tokens is cut into ``P`` equal
spans; rank ``r`` holds tokens ``[r*T/P, (r+1)*T/P)``.
"""

from __future__ import annotations

from typing import List, Sequence


def seq_lens_from_cu(cu_seqlens: Sequence[int]) -> List[int]:
    cu = [int(c) for c in cu_seqlens]
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def zigzag_rank_indices(seq_lens: Sequence[int], cp: int, rank: int) -> List[int]:
    """Global packed-token indices held by ``rank``, in the rank-local order."""
    out: List[int] = []
    start = 0
    for n in seq_lens:
        if n % (2 * cp):
            raise ValueError(f"sequence length {n} not divisible by 2*cp={2 * cp}")
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + chunk * c, start + (chunk + 1) * c))
        start += n
    return out


def contiguous_rank_indices(total: int, cp: int, rank: int) -> List[int]:
    if total % cp:
        raise ValueError(f"total tokens {total} not divisible by cp={cp}")
    part = total // cp
    return list(range(rank * part, (rank + 1) * part))
