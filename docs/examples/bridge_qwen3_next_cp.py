"""Megatron-Bridge: the Qwen3-Next recipe with the GDN CP mode and CP size overridden.

The walkthrough's Bridge example (docs/train-with-the-image.md), for the cuda image (Bridge's recipes
need Python >= 3.12 and Transformer Engine). Bridge's model providers are ``TransformerConfig``s, so the
patch's one setting, ``linear_cp_mode``, is set on ``cfg.model`` beside ``context_parallel_size``; the
recipe's other settings (TP, PP, EP, mock data unless ``cfg.dataset`` names data) stay:

    torchrun --nproc-per-node 8 bridge_qwen3_next_cp.py --cp 2 --mode chunkwise

A headwise geometry that does not split (Qwen3-Next has 16 key heads: headwise needs 16 % (TP*CP) == 0)
fails with ``LinearCPError`` when Bridge finalises the model config (``ConfigContainer.validate``),
before the model is built: use chunkwise or all_gather there.
"""

from __future__ import annotations

import argparse


def make_config(cp: int = 2, mode: str = "chunkwise"):
    """The recipe's ``ConfigContainer`` with ``linear_cp_mode`` and the CP size overridden."""
    from megatron.bridge.recipes.qwen.qwen3_next import qwen3_next_80b_a3b_pretrain_config

    cfg = qwen3_next_80b_a3b_pretrain_config()
    cfg.model.context_parallel_size = cp
    cfg.model.linear_cp_mode = mode  # headwise (default), chunkwise or all_gather
    return cfg


def main(argv=None) -> None:
    """Parse ``--cp`` and ``--mode`` and run Bridge's ``pretrain`` with the GPT forward step."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--mode", default="chunkwise")
    args = p.parse_args(argv)
    pretrain(make_config(args.cp, args.mode), forward_step)


if __name__ == "__main__":
    main()
