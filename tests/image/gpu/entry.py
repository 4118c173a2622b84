"""GPU suite entry point, one job per invocation (see ``tools/gpu-suite``).

    torchrun --standalone --nproc-per-node 4 tests/image/gpu/entry.py kernels --out K.json
    torchrun --standalone --nproc-per-node 4 tests/image/gpu/entry.py module  --out M.json
    torchrun ... entry.py oldnew-dump --label new --dump-dir D --out N.json   # per tree
    python tests/image/gpu/entry.py oldnew-compare --dump-dir D --out O.json

    torchrun ... entry.py extra --select '^tp2cp2/' --out E.json   # tests/image/gpu/module_extra.py
    torchrun ... entry.py oracle [--label old] --out R.json   # tests/image/kernel_oracle.py

Megatron comes from the tree first on ``PYTHONPATH`` (the job records which). Ranks share
the host's GPUs round-robin; NCCL when each rank has its own GPU, gloo (with the FLA 0.4.2
all-gather shim of ``tests/image/fla_gloo.py``) when two ranks share one
(``tests/image/gpu/placement.py``); the job JSON says which. Each rank appends its records to ``<out>.rank<r>.jsonl`` as they are
made, so a job that dies still leaves what it finished; rank 0 writes the whole job's JSON
at the end: ``{"job", "tree", "fla", "torch", "autotune", "elapsed_s", "records": [...]}``.
``--emulate`` runs the same job on CPU/gloo with FLA replaced (a dry run of the harness).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


class Journal(list):
    """A list of records that also appends each record to a JSONL file."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def _write(self, recs):
        with open(self.path, "a") as f:
            for r in recs:
                f.write(json.dumps(r, default=str) + "\n")

    def append(self, r):
        super().append(r)
        self._write([r])

    def extend(self, rs):
        rs = list(rs)
        super().extend(rs)
        self._write(rs)


def _env_info():
    import torch

    info = {"torch": torch.__version__}
    try:
        import fla

        info["fla"] = fla.__version__
        info["fla_file"] = fla.__file__
    except Exception as exc:  # noqa: BLE001
        info["fla"] = f"unavailable: {exc!r}"
    try:
        import megatron.core.ssm.gated_delta_net as gdn

        info["tree"] = str(Path(gdn.__file__).resolve().parents[3])
    except Exception as exc:  # noqa: BLE001
        info["tree"] = f"unavailable: {exc!r}"
    return info


def _init(emulate, want_fla_shim=True):
    """Join the job's process group. Returns rank, world, device and what was chosen:
    ``{"backend", "ranks_per_gpu", "gloo_shim"}``."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if emulate:
        from _world import install_cpu_device_shim

        install_cpu_device_shim()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        return rank, world, torch.device("cpu"), {"backend": "gloo", "ranks_per_gpu": None,
                                                   "gloo_shim": "n/a (emulated)"}
    from placement import place

    local = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    p = place(local, local_world, torch.cuda.device_count(), os.environ.get("GDN_SUITE_BACKEND"))
    torch.cuda.set_device(p.device)
    device = torch.device("cuda", p.device)
    kw = {"device_id": device} if p.backend == "nccl" else {}
    dist.init_process_group(p.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600 if p.shared else 240), **kw)
    shim = False
    if p.backend == "gloo" and want_fla_shim:
        import fla_gloo

        shim = fla_gloo.install()
    return rank, world, device, {"backend": p.backend, "ranks_per_gpu": p.ranks_per_gpu,
                                 "gloo_shim": shim}


def _memory(device) -> dict:
    """This rank's GPU memory in MiB: PyTorch's peak reservation and what the device reports
    for the process (context, kernels' local memory and PyTorch together), where visible."""
    import subprocess

    import torch

    if device.type != "cuda":
        return {"pid": os.getpid()}
    rec = {"pid": os.getpid(), "torch_max_reserved_mib": torch.cuda.max_memory_reserved(device) >> 20}
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
        for line in out.splitlines():
            pid, used = (v.strip() for v in line.split(","))
            if pid == str(os.getpid()):
                rec["process_used_mib"] = int(used)
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return rec


def _emulated_kernels():
    from types import SimpleNamespace

    import fla_emulation as E

    return SimpleNamespace(build_cp_context=E.build_cp_context, causal_conv1d=E.causal_conv1d,
                           chunk_gated_delta_rule=E.chunk_gated_delta_rule)


def main(argv=None):
    ap = argparse.ArgumentParser(description="GDN CP GPU suite job")
    ap.add_argument("job", choices=["kernels", "module", "extra", "oracle", "oldnew-dump",
                                    "oldnew-compare"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--select", default=None, help="regex on record ids")
    ap.add_argument("--label", choices=["old", "new"],
                    help="oldnew-dump: which tree; oracle: old = the base tree's FLA 0.4.1, probe only")
    ap.add_argument("--dump-dir")
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--warmup-set", choices=["module", "module-a", "module-b", "module-c", "module-d"],
                    default="module",
                    help="which compile warm-up list the module job uses")
    args = ap.parse_args(argv)
    t0 = time.time()

    if args.job == "oldnew-compare":
        import torch

        import oldnew

        d = Path(args.dump_dir)
        n = len(list(d.glob("new-rank*.pt")))
        old = [torch.load(d / f"old-rank{r}.pt", weights_only=False) for r in range(n)]
        new = [torch.load(d / f"new-rank{r}.pt", weights_only=False) for r in range(n)]
        meta = {lab: json.loads((d / f"{lab}-meta.json").read_text()) for lab in ("old", "new")}
        records = oldnew.compare(old, new)
        Path(args.out).write_text(json.dumps(
            {"job": "oldnew-compare", "trees": meta, "elapsed_s": time.time() - t0,
             "records": records}, indent=1, default=str))
        return 0

    import torch
    import torch.distributed as dist

    from autotune_policy import install

    policy = "n/a (emulated)" if args.emulate else install()
    # FLA 0.4.1 (the base tree: old-vs-new dump, oracle probe) has no fla.ops.cp: no shim to install.
    rank, world, device, placed = _init(args.emulate, want_fla_shim=args.label != "old")
    info = {**_env_info(), **placed}
    select = (lambda rid: re.search(args.select, rid) is not None) if args.select else None
    log = lambda s: print(f"{time.time() - t0:7.1f}s {s}", flush=True)  # noqa: E731
    journal_path = f"{args.out}.rank{rank}.jsonl"
    if os.path.exists(journal_path):
        os.remove(journal_path)
    records = Journal(journal_path)
    phases = {}

    if args.job == "kernels":
        import kernel_matrix

        kernels = _emulated_kernels() if args.emulate else None
        if not args.emulate and not args.no_warmup:
            import warmup

            warmup.run(warmup.KERNEL_ITEMS, rank, world, device, log)
            dist.barrier()
            phases["warmup_s"] = time.time() - t0
        quiet = lambda s: None  # noqa: E731
        records.extend(kernel_matrix.run_kernels(rank, world, device, kernels=kernels,
                                                 select=select, log=log if rank == 0 else quiet))
    elif args.job == "module":
        import module_matrix

        if not args.emulate and not args.no_warmup:
            import warmup

            items = warmup.SETS[args.warmup_set]
            warmup.run(items, rank, world, device, log)
            dist.barrier()
            phases["warmup_s"] = time.time() - t0
        module_matrix.run_matrix(rank, world, device, emulate=args.emulate, select=select,
                                 log=log if rank == 0 else (lambda s: None), records=records)
    elif args.job == "extra":
        import module_extra

        module_extra.run_extra(rank, world, device, emulate=args.emulate, select=select,
                               log=log if rank == 0 else (lambda s: None), records=records)
    elif args.job == "oracle":
        import kernel_oracle

        kernels = _emulated_kernels() if args.emulate else None
        records.extend(kernel_oracle.run_oracle(
            rank, world, device,
            chunk_gated_delta_rule=kernels.chunk_gated_delta_rule if kernels else None,
            gating="probe" if args.label == "old" else "gate", select=select, log=log))
    elif args.job == "oldnew-dump":
        import oldnew

        if not args.emulate and not args.no_warmup:
            import warmup

            warmup.run(warmup.OLDNEW_ITEMS, rank, world, device, log)
            dist.barrier()
            phases["warmup_s"] = time.time() - t0

        res = oldnew.dump(rank, world, device, patched=args.label == "new", emulate=args.emulate)
        d = Path(args.dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        torch.save(res, d / f"{args.label}-rank{rank}.pt")
        if rank == 0:
            (d / f"{args.label}-meta.json").write_text(json.dumps({**info, "autotune": policy}))
        records.append({"id": f"oldnew-dump/{args.label}", "kind": "dump", "rank": rank,
                        "passed": True, "entries": sorted(res)})

    gathered = [None] * world
    dist.all_gather_object(gathered, list(records))
    memory = [None] * world
    dist.all_gather_object(memory, _memory(device))
    if rank == 0:
        flat = [r for part in gathered for r in part]
        Path(args.out).write_text(json.dumps(
            {"job": args.job, **info, "autotune": policy, "world": world,
             "elapsed_s": time.time() - t0, "phases": phases, "memory": memory, "records": flat},
            indent=1, default=str))
        bad = sum(not r["passed"] for r in flat)
        log(f"{args.job}: {len(flat)} records, {bad} failed")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
