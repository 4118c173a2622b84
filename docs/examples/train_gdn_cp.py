"""Train a small Gated DeltaNet language model under context parallelism with the patched tree.

The walkthrough's example (docs/train-with-the-image.md). Plain Megatron-Core, no Megatron-Bridge:
``parallel_state`` (TP 1, CP ``--cp``, DP the rest of the world), a ``GPTModel`` whose layers are
``TransformerLayer``s with ``GatedDeltaNet`` as the token mixer (local linears and torch norms: no
Transformer Engine needed), zigzag CP split of every sequence with ``get_batch_on_this_cp_rank``,
gradients summed over DP x CP, torch AdamW. Launch it with torchrun, one rank per GPU:

    torchrun --nproc-per-node 2 docs/examples/train_gdn_cp.py --cp 2 --mode chunkwise --steps 20

It logs, on rank 0, the layout, the loss per step and, after the first step, which GDN path ran and
the calls that prove it (counted around the patched tree's own functions):

    [train_gdn_cp] world 2 = TP 1 x CP 2 x DP 1; linear_cp_mode=chunkwise; backend nccl; device cuda
    [train_gdn_cp] GDN path: chunkwise on 2 of 2 GDN layers (CP group of 2 ranks); FLA build_cp_context 2x, headwise all-to-all 0x, all_gather 0x

and exits 1 when the path that ran is not the one asked for. ``--save DIR`` writes a checkpoint at
the end and ``--load DIR`` resumes from one, at any CP size (TP 1: every rank holds the whole model,
so the same state loads at CP 1, 2 or 4; the data of step N is the same at every CP size).
A geometry the mode cannot split (``--mode headwise --cp 4`` with the default 2 key heads) exits 2
with Megatron's ``LinearCPError`` before any collective.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

PREFIX = "[train_gdn_cp]"
VOCAB = 64


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (divides the world size)")
    p.add_argument("--mode", default="chunkwise", help="linear_cp_mode: headwise, chunkwise or all_gather")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps to run (after a --load: more steps)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (divisible by 2 x CP)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--key-heads", type=int, default=2, help="linear_num_key_heads (headwise needs it divisible by CP)")
    p.add_argument("--value-heads", type=int, default=4, help="linear_num_value_heads")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: nccl on GPUs (one rank per GPU), gloo on CPU; gloo on GPUs lets ranks share one "
                        "(a check, not a training setup: FLA's CP all-gather then needs a gloo-compatible output view)")
    p.add_argument("--save", metavar="DIR", help="write DIR/checkpoint.pt after the last step (rank 0)")
    p.add_argument("--load", metavar="DIR", help="resume from DIR/checkpoint.pt (written at any CP size)")
    return p.parse_args(argv)


def log(msg: str) -> None:
    """Print ``msg`` on rank 0 (stdout, flushed)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{PREFIX} {msg}", flush=True)


def make_config(args, device):
    """The ``TransformerConfig``: every layer GDN, ``linear_cp_mode`` and CP size from the command line."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden, num_attention_heads=4,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=1, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=args.key_heads, linear_num_value_heads=args.value_heads,
        linear_cp_mode=args.mode, context_parallel_size=args.cp,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,  # init_weights
        normalization="RMSNorm", layernorm_epsilon=1e-6,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, transformer_impl="local",
    )


def layer_spec(num_layers: int):
    """Every layer: torch RMSNorm, ``GatedDeltaNet`` (local tensor-parallel linears), local MLP."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=gdn, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm, mlp=get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=None),
        mlp_bda=get_bias_dropout_add))
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=WrappedTorchNorm)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from a generator seeded by ``seed``, in name order: the same weights on every
    rank and device (Megatron's own initialisation forks the CUDA RNG tracker, which a CPU run lacks)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                val = torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen))
            elif name.endswith("dt_bias") or "norm" in name:
                val = torch.ones(p.shape)
            else:
                val = 0.02 * torch.randn(p.shape, generator=gen)
            p.copy_(val.to(p.dtype))


@contextlib.contextmanager
def count_gdn_paths(counts: dict, plans: dict):
    """Count the calls that only one GDN path makes, around the patched tree's own functions:
    ``plan_linear_cp`` (the plan each GDN forward resolves: ``plans[id(plan)]``), FLA's
    ``build_cp_context`` (chunkwise), the headwise all-to-all ``tensor_a2a_cp2hp`` and the all_gather
    path's ``gather_zigzag_sequence``."""
    import megatron.core.ssm.gated_delta_net as gdn
    import megatron.core.ssm.gdn_context_parallel as gcp

    def counted(module, name, on_call=None):
        orig = getattr(module, name)
        counts[name] = 0

        def wrapper(*a, **k):
            counts[name] += 1
            out = orig(*a, **k)
            if on_call is not None:
                on_call(out)
            return out

        return mock.patch.object(module, name, wrapper)

    def record_plan(plan):
        plans.setdefault("seen", []).append(plan)

    with contextlib.ExitStack() as stack:
        stack.enter_context(counted(gcp, "plan_linear_cp", record_plan))
        stack.enter_context(counted(gdn, "build_cp_context"))
        stack.enter_context(counted(gdn, "tensor_a2a_cp2hp"))
        stack.enter_context(counted(gcp, "gather_zigzag_sequence"))
        yield


def path_report(counts: dict, plans: dict, num_layers: int) -> tuple[str, str]:
    """(the path that ran, the log line proving it) from one step's counts."""
    seen = plans.get("seen", [])
    ran = {("chunkwise" if p.chunkwise else "headwise" if p.headwise else "all_gather" if p.all_gather
            else "no CP (size 1)") for p in seen}
    path = ran.pop() if len(ran) == 1 else f"mixed {sorted(ran)}"
    size = seen[0].size if seen else 0
    layers = min(len(seen), num_layers)
    line = (f"GDN path: {path} on {layers} of {num_layers} GDN layers (CP group of {size} ranks); "
            f"FLA build_cp_context {counts['build_cp_context']}x, headwise all-to-all {counts['tensor_a2a_cp2hp']}x, "
            f"all_gather {counts['gather_zigzag_sequence']}x")
    return path, line


def batch(step: int, dp_rank: int, seq: int, device) -> dict:
    """The global sequence of ``step`` for DP rank ``dp_rank`` (the same at every CP size): an
    arithmetic token stream the model can learn (``start + stride * i mod VOCAB``)."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    start, stride = (int(x) for x in torch.randint(1, VOCAB, (2,), generator=gen))
    tokens = (start + stride * torch.arange(seq + 1)) % VOCAB
    return {"tokens": tokens[:-1].view(1, -1).to(device), "labels": tokens[1:].view(1, -1).to(device),
            "position_ids": torch.arange(seq).view(1, -1).to(device)}


def main(argv=None) -> int:
    """Train; return the exit status (0 ok, 1 the GDN path asked for did not run, 2 a refused setting)."""
    args = parse_args(argv)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.ssm.gdn_context_parallel import LinearCPError
    from megatron.core.utils import get_batch_on_this_cp_rank

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = dist.get_backend() if dist.is_initialized() else args.backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda and backend == "nccl" and world > torch.cuda.device_count():
        print(f"error: {world} ranks but {torch.cuda.device_count()} GPUs; NCCL needs one GPU per rank.\n"
              f"hint: torchrun --nproc-per-node {torch.cuda.device_count()} (and a --cp that divides it).",
              file=sys.stderr)
        return 2
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if args.seq % (2 * args.cp):
        log(f"error: --seq {args.seq} is not divisible by 2 x CP = {2 * args.cp} (each rank takes two zigzag chunks)")
        return 2
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=args.cp)
    log(f"world {dist.get_world_size()} = TP 1 x CP {args.cp} x DP {ps.get_data_parallel_world_size()}; "
        f"linear_cp_mode={args.mode}; backend {dist.get_backend()}; device {device.type}")
    try:
        config = make_config(args, device)
    except LinearCPError as exc:  # raised by the patched tree before any collective
        log(f"error: LinearCPError: {exc}")
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        return 2

    counts: dict = {}
    plans: dict = {}
    status = 0
    with count_gdn_paths(counts, plans):
        if use_cuda:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        model = GPTModel(config, layer_spec(args.layers), vocab_size=VOCAB, max_sequence_length=args.seq,
                         position_embedding_type="none", share_embeddings_and_output_weights=False)
        init_weights(model, args.seed)
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        first = 1
        if args.load:
            ckpt = torch.load(os.path.join(args.load, "checkpoint.pt"), map_location=device, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            first = ckpt["step"] + 1
            log(f"resumed from {args.load} at step {ckpt['step']} (saved at CP {ckpt['cp']}, {ckpt['mode']}; "
                f"now CP {args.cp}, {args.mode})")
        grad_group = ps.get_data_parallel_group(with_context_parallel=True)
        last = first + args.steps - 1
        for step in range(first, last + 1):
            b = get_batch_on_this_cp_rank(batch(step, ps.get_data_parallel_rank(), args.seq, device))
            per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            total = torch.tensor(float(args.seq * ps.get_data_parallel_world_size()), device=device)
            loss = per_token.sum() / total  # this rank's share of the global mean
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=grad_group)  # sum over DP x CP: the global mean's gradient
            opt.step()
            reported = loss.detach().clone()
            dist.all_reduce(reported, group=grad_group)
            log(f"step {step}/{last} loss {reported.item():.4f}")
            if step == first:
                path, line = path_report(counts, plans, args.layers)
                log(line)
                want = args.mode if args.cp > 1 else "no CP (size 1)"
                if path != want:
                    log(f"error: linear_cp_mode={args.mode} at CP {args.cp} should run the {want} path, "
                        f"but {path} ran")
                    status = 1
        if args.save and dist.get_rank() == 0:
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": last, "cp": args.cp,
                        "mode": args.mode}, os.path.join(args.save, "checkpoint.pt"))
            log(f"saved {os.path.join(args.save, 'checkpoint.pt')} at step {last}")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
