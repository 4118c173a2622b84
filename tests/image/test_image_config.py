"""``linear_cp_mode`` in the patched TransformerConfig and gdn_context_parallel's rules.

Head rule (design decision 3): headwise needs heads % (TP*CP) == 0; chunkwise and
all_gather need heads % TP == 0; ``auto`` and unknown values fail with the valid modes in
the message; a headwise geometry that does not split names chunkwise and all_gather.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from _image_env import need_tree
from _world import FakeGroup

VALID = ("headwise", "chunkwise", "all_gather")


def gdn_config(mode=None, tp=1, cp=1, k_heads=4, v_heads=8, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
    )
    if mode is not None:
        kw["linear_cp_mode"] = mode
    kw.update(extra)
    return TransformerConfig(**kw)


def test_suite_imports_megatron_from_the_patched_tree():
    need_tree()
    import megatron.core.ssm.gated_delta_net as gdn
    import megatron.core.transformer.transformer_config as tc

    from _image_env import GDN_TREE

    for mod in (gdn, tc):
        assert mod.__file__.startswith(str(GDN_TREE) + "/"), mod.__file__


def test_default_mode_is_headwise():
    need_tree()
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert TransformerConfig.__dataclass_fields__["linear_cp_mode"].default == "headwise"
    assert gdn_config().linear_cp_mode == "headwise"


def test_linear_cp_modes_constant_and_error_type():
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LINEAR_CP_MODES, LinearCPError

    assert tuple(LINEAR_CP_MODES) == VALID
    assert issubclass(LinearCPError, ValueError)


@pytest.mark.parametrize("bad", ["auto", "AUTO", "Chunkwise", "ring", "", "head_wise"])
def test_unknown_mode_rejected_with_valid_modes_listed(bad):
    need_tree()
    with pytest.raises(ValueError) as info:
        gdn_config(mode=bad)
    msg = str(info.value)
    for m in VALID:
        assert m in msg, (m, msg)


# (k_heads, v_heads, tp, cp) grid; legality follows the head rule of each mode.
GEOMS = [(k, v, tp, cp) for (k, v), tp, cp in itertools.product(
    [(4, 8), (2, 6), (6, 6), (8, 16)], [1, 2], [1, 2, 4])]


def _legal(mode, k, v, tp, cp):
    split = tp * cp if mode == "headwise" else tp
    return k % split == 0 and v % split == 0


@pytest.mark.parametrize("mode", VALID)
@pytest.mark.parametrize("k,v,tp,cp", GEOMS)
def test_head_rule_per_mode(mode, k, v, tp, cp):
    need_tree()
    if _legal(mode, k, v, tp, cp):
        cfg = gdn_config(mode=mode, tp=tp, cp=cp, k_heads=k, v_heads=v)
        assert cfg.linear_cp_mode == mode
        return
    with pytest.raises(ValueError) as info:
        gdn_config(mode=mode, tp=tp, cp=cp, k_heads=k, v_heads=v)
    if mode == "headwise" and k % tp == 0 and v % tp == 0:
        # only the CP split fails: the message must point at the two other modes
        assert "chunkwise" in str(info.value) and "all_gather" in str(info.value)


def test_headwise_illegal_geometry_names_chunkwise_and_all_gather():
    need_tree()
    with pytest.raises(ValueError) as info:
        gdn_config(mode="headwise", cp=4, k_heads=2, v_heads=6)
    assert "chunkwise" in str(info.value) and "all_gather" in str(info.value)
    # ... and the same geometry is legal for the two other modes
    for mode in ("chunkwise", "all_gather"):
        assert gdn_config(mode=mode, cp=4, k_heads=2, v_heads=6).linear_cp_mode == mode


@pytest.mark.parametrize("mode", VALID)
def test_check_linear_cp_geometry(mode):
    need_tree()
    from megatron.core.ssm.gdn_context_parallel import LinearCPError, check_linear_cp_geometry

    check_linear_cp_geometry(mode, 4, 8, 2, 2)
    if mode == "headwise":
        with pytest.raises(LinearCPError, match="chunkwise") as info:
            check_linear_cp_geometry(mode, 2, 6, 1, 4)
        assert "all_gather" in str(info.value)
    else:
        check_linear_cp_geometry(mode, 2, 6, 1, 4)
    with pytest.raises(LinearCPError):
        check_linear_cp_geometry(mode, 3, 6, 2, 1)  # heads % TP != 0 in every mode
    with pytest.raises(LinearCPError):
        check_linear_cp_geometry("auto", 4, 8, 1, 1)


# ---------------------------------------------------------------- downstream fixes


def test_prepare_qkv_is_excluded_from_dynamo_only():
    """Fix (a): ``_prepare_qkv_for_gated_delta_rule`` carries torch.compiler.disable."""
    need_tree()
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    fn = GatedDeltaNet._prepare_qkv_for_gated_delta_rule
    assert getattr(fn, "_torchdynamo_disable", False) is True
    for other in ("_compute_g_and_beta", "_apply_gated_norm"):
        assert not getattr(getattr(GatedDeltaNet, other), "_torchdynamo_disable", False), other


def _prepare_by_hand(qkv, gate, beta, alpha, b, s, k_heads, v_heads, dk, dv, cp, l2norm):
    """query, key, value, gate, beta, alpha as the gated delta rule wants them, op by op."""
    import torch

    qk_dim, v_dim = k_heads * dk // cp, v_heads * dv // cp
    qk, v = qkv[..., : 2 * qk_dim], qkv[..., 2 * qk_dim :]
    qk = l2norm(qk.reshape(b, s, -1, dk).contiguous())
    q, k = qk[:, :, : k_heads // cp], qk[:, :, k_heads // cp :]
    q = torch.stack([q] * (v_heads // k_heads), dim=3).flatten(2, 3)
    k = torch.stack([k] * (v_heads // k_heads), dim=3).flatten(2, 3)
    return q, k, v.reshape(b, s, -1, dv), gate, beta, alpha


@pytest.mark.parametrize("k_heads, v_heads, cp, batch", [(4, 8, 1, 1), (4, 8, 2, 2), (2, 6, 1, 1), (4, 4, 2, 1)])
def test_prepare_qkv_matches_the_op_by_op_helper_in_value_and_gradient(k_heads, v_heads, cp, batch):
    """The fused-copies adaptation computes what the eager helper did: every output equal and
    contiguous, every input gradient equal (GQA repeat 1, 2, 3; headwise CP split 1 and 2)."""
    need_tree()
    import types

    import torch

    import megatron.core.ssm.gated_delta_net as gdn

    def l2norm(x):
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    dk, dv, s = 8, 16, 12
    layer = types.SimpleNamespace(qk_dim_local_tp=k_heads * dk, v_dim_local_tp=v_heads * dv, key_head_dim=dk,
                                  value_head_dim=dv, use_qk_l2norm=True, num_value_heads=v_heads,
                                  num_key_heads=k_heads)
    g = torch.Generator().manual_seed(k_heads * 10 + v_heads + cp)
    width = (2 * k_heads * dk + v_heads * dv) // cp
    hv = v_heads // cp
    leaves = [torch.randn(batch, s, width, generator=g), torch.randn(batch, s, hv, dv, generator=g),
              torch.randn(batch, s, hv, generator=g), torch.randn(batch, s, hv, generator=g)]
    runs = []
    for fn in ("tree", "hand"):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        if fn == "tree":
            orig, gdn.l2norm = gdn.l2norm, l2norm
            try:
                outs = gdn.GatedDeltaNet._prepare_qkv_for_gated_delta_rule(layer, *xs, batch, s, cp)
            finally:
                gdn.l2norm = orig
        else:
            outs = _prepare_by_hand(*xs, batch, s, k_heads, v_heads, dk, dv, cp, l2norm)
        loss = sum(((i + 1) * o).sum() for i, o in enumerate(outs))
        runs.append((outs, torch.autograd.grad(loss, xs)))
    (tree_out, tree_grad), (hand_out, hand_grad) = runs
    for a, b in zip(tree_out, hand_out):
        assert a.is_contiguous() and a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(tree_grad, hand_grad):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


class _RecordingParam:
    """Stands in for a parameter; records the index object it is sliced with."""

    def __init__(self, shape):
        self.shape = shape
        self.keys = []

    def dim(self):
        return len(self.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, key):
        self.keys.append(key)
        return key


def test_get_parameter_local_cp_indexes_with_a_tuple():
    """Fix (b): ``param[tuple(slices)]``, never a list of slices."""
    need_tree()
    import torch

    from megatron.core.ssm.gated_delta_net import get_parameter_local_cp

    p = _RecordingParam((8, 3))
    get_parameter_local_cp(p, dim=0, cp_group=FakeGroup(2, 1))
    assert p.keys and all(isinstance(k, tuple) for k in p.keys), p.keys
    assert p.keys[0] == (slice(4, 8), slice(None))
    t = torch.arange(24.0).reshape(8, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        part = get_parameter_local_cp(t, dim=0, cp_group=FakeGroup(4, 2))
    assert torch.equal(part, t[4:6])
