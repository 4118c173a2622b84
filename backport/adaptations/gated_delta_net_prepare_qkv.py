# Downstream adaptation template of the gdn-backport recipe (our code, not upstream's).
# The transform `gdn_prepare_qkv_fused_copies` parses this file with libcst: the body of the
# method below replaces the body of `GatedDeltaNet._prepare_qkv_for_gated_delta_rule` (its
# decorator and signature stay as the earlier steps left them), and the two module-level
# functions go right after the class in megatron/core/ssm/gated_delta_net.py.
# It is never imported from here: names resolve in gated_delta_net.py's namespace.
# ruff: noqa


class GatedDeltaNet:
    def _prepare_qkv_for_gated_delta_rule(
        self, qkv, gate, beta, alpha, batch, seq_len, cp_size_headwise=1
    ):
        """
        Prepare query, key, value, gate, beta, alpha tensors for gated delta rule.

        Dynamo never traces this method (preserved downstream fix); FLA's l2norm runs eagerly
        between two jit_fuser functions that fuse the split, reshape, repeat_interleave and
        contiguous copies (and their backward) into a few kernels.
        """
        query_key, value = _split_query_key_value(
            qkv,
            batch,
            seq_len,
            self.qk_dim_local_tp // cp_size_headwise,
            self.v_dim_local_tp // cp_size_headwise,
            self.key_head_dim,
            self.value_head_dim,
        )
        if self.use_qk_l2norm:
            query_key = l2norm(query_key)
        return _expand_query_key_heads(
            query_key, value, gate, beta, alpha, self.num_value_heads // self.num_key_heads
        )


@jit_fuser
def _split_query_key_value(
    qkv: Tensor,
    batch: int,
    seq_len: int,
    qk_dim: int,
    v_dim: int,
    key_head_dim: int,
    value_head_dim: int,
):
    """Split the conv output into query_key and value, each contiguous.

    Args:
        qkv (Tensor): ``[b, s, 2 * qk_dim + v_dim]``, this rank's channels.
        batch (int): b.
        seq_len (int): s.
        qk_dim (int): channels of query (and of key) on this rank.
        v_dim (int): channels of value on this rank.
        key_head_dim (int): channels per key head.
        value_head_dim (int): channels per value head.

    Returns:
        (Tensor, Tensor): query_key ``[b, s, 2 * qk_dim / key_head_dim, key_head_dim]`` and value
        ``[b, s, v_dim / value_head_dim, value_head_dim]``, both contiguous, dtype of ``qkv``.
    """
    query_key, value = torch.split(qkv, [2 * qk_dim, v_dim], dim=-1)
    query_key = query_key.reshape(batch, seq_len, -1, key_head_dim).contiguous()
    value = value.reshape(batch, seq_len, -1, value_head_dim).contiguous()
    return query_key, value


@jit_fuser
def _expand_query_key_heads(
    query_key: Tensor, value: Tensor, gate: Tensor, beta: Tensor, alpha: Tensor, repeat_factor: int
):
    """Split query_key into query and key, repeat each key head for its value heads, and
    return all six tensors of the gated delta rule contiguous.

    Args:
        query_key (Tensor): ``[b, s, 2 * h_k, d_k]``, query heads first.
        value (Tensor): ``[b, s, h_v, d_v]``.
        gate (Tensor): ``[b, s, h_v, d_v]``.
        beta (Tensor): ``[b, s, h_v]``.
        alpha (Tensor): ``[b, s, h_v]``.
        repeat_factor (int): value heads per key head, ``h_v / h_k`` (1: no repeat).

    Returns:
        (Tensor, ...): query and key ``[b, s, h_k * repeat_factor, d_k]`` (each key head
        repeated ``repeat_factor`` times in a row, as ``repeat_interleave``), value, gate, beta
        and alpha unchanged in value; all contiguous.
    """
    query, key = torch.chunk(query_key, 2, dim=2)
    if repeat_factor > 1:
        query = query.repeat_interleave(repeat_factor, dim=2)
        key = key.repeat_interleave(repeat_factor, dim=2)
    return (
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        gate.contiguous(),
        beta.contiguous(),
        alpha.contiguous(),
    )
