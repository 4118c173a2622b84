"""Minimal stand-in for the GDN layer module (test data, not upstream code)."""

import torch

from megatron.core.jit import jit_fuser
from megatron.core.process_groups_config import ProcessGroupCollection


class GatedDeltaNet:
    """Toy layer."""

    def __init__(self, config, tp_size, cp_size):
        self.config = config
        self.tp_size = tp_size
        self.cp_size = cp_size
        self.v_dim_local_tp = 4 // tp_size
        self.built = True

    def forward(self, hidden_states, attention_mask):
        return hidden_states

    @jit_fuser
    def _prepare_qkv_for_gated_delta_rule(self, qkv, batch):
        heads = qkv // self.cp_size
        return heads, batch


def get_parameter_local_cp(param, dim, cp_group):
    cp_size = cp_group.size()
    cp_rank = cp_group.rank()
    slices = [slice(None)] * param.dim()
    slices[dim] = slice(cp_rank, None, cp_size)
    return param[slices]
