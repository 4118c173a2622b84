"""The walkthrough (docs/train-with-the-image.md) on CPU: its torchrun commands, read from the page
itself, run the same example script (docs/examples/train_gdn_cp.py; /opt/gdn/examples in the image)
in gloo worlds of 2 and 4 ranks, with FLA's kernels replaced by the CPU stand-ins
(``walkthrough_cpu_entry.py``), and print the log lines the page shows: the CP=2 chunkwise job and
its GDN-path line, headwise refused at CP=4 with ``LinearCPError`` (ranks exit 2), the resume at CP=4
of the CP=2 checkpoint. The GPU run of the same commands (NCCL, the real FLA kernels) is not part of
this suite. About 1-3 minutes on 2 cores (three torchrun launches)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _image_env import GDN_TREE, need_fla, need_torch, need_tree
from _world import LOOPBACK_ENV, free_port

HERE = Path(__file__).resolve().parent
ENTRY = HERE / "walkthrough_cpu_entry.py"
PAGE_CANDIDATES = (HERE.parents[1] / "docs" / "train-with-the-image.md",)


def _page_commands() -> dict:
    """The page's torchrun lines by section (``cp2``, ``headwise``, ``resume``), or {} without the page
    (the image holds the examples, not docs/: the commands below are then the page's, as committed)."""
    page = next((p for p in PAGE_CANDIDATES if p.is_file()), None)
    if page is None:
        return {}
    lines = [ln.strip() for ln in page.read_text(encoding="utf-8").splitlines()
             if ln.strip().startswith("torchrun ") and "train_gdn_cp.py" in ln]
    pick = {"cp2": lambda ln: "--save" in ln, "headwise": lambda ln: "--mode headwise" in ln,
            "resume": lambda ln: "--load" in ln}
    return {key: next(ln for ln in lines if test(ln)) for key, test in pick.items()}


COMMITTED = {
    "cp2": "torchrun --nproc-per-node 2 /opt/gdn/examples/train_gdn_cp.py --cp 2 --mode chunkwise --steps 20 --save /work/ckpt-cp2",
    "headwise": "torchrun --nproc-per-node 4 /opt/gdn/examples/train_gdn_cp.py --cp 4 --mode headwise",
    "resume": "torchrun --nproc-per-node 4 /opt/gdn/examples/train_gdn_cp.py --cp 4 --mode chunkwise --steps 10 --load /work/ckpt-cp2",
}


def test_the_page_still_has_these_commands():
    found = _page_commands()
    if not found:
        pytest.skip("docs/train-with-the-image.md is not here (the image holds the examples only)")
    assert found == COMMITTED


def run_doc_command(cmd: str, work: Path, steps: int | None = None) -> subprocess.CompletedProcess:
    """Run one of the page's torchrun lines on CPU: the example through the CPU entry, /work mapped to
    ``work``, ``--steps`` shortened to ``steps`` (the page trains 20 / 10 steps; 2 / 1 prove the same)."""
    need_torch()
    need_tree()
    need_fla()
    words = shlex.split(cmd.replace("/work/", f"{work}/"))
    assert words[0] == "torchrun" and words[3].endswith("train_gdn_cp.py"), cmd
    nproc, args = words[2], words[4:]
    if steps is not None and "--steps" in args:
        args[args.index("--steps") + 1] = str(steps)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=str(GDN_TREE), **LOOPBACK_ENV, OMP_NUM_THREADS="1")
    return subprocess.run([*torchrun, str(ENTRY), *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)


def _log(res) -> list[str]:
    return [ln for ln in res.stdout.splitlines() if ln.startswith("[train_gdn_cp]")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("walkthrough")


@pytest.fixture(scope="module")
def cp2(work):
    return run_doc_command(COMMITTED["cp2"], work, steps=2)


def test_cp2_chunkwise_job_logs_the_chunkwise_path(cp2, work):
    assert cp2.returncode == 0, cp2.stderr[-3000:]
    log = _log(cp2)
    assert log[0] == "[train_gdn_cp] world 2 = TP 1 x CP 2 x DP 1; linear_cp_mode=chunkwise; backend gloo; device cpu"
    assert re.fullmatch(r"\[train_gdn_cp\] step 1/2 loss \d+\.\d{4}", log[1])
    assert log[2] == ("[train_gdn_cp] GDN path: chunkwise on 2 of 2 GDN layers (CP group of 2 ranks); "
                      "FLA build_cp_context 2x, headwise all-to-all 0x, all_gather 0x")
    assert log[-1] == f"[train_gdn_cp] saved {work}/ckpt-cp2/checkpoint.pt at step 2"


def test_headwise_at_cp4_is_refused_before_any_collective(work):
    res = run_doc_command(COMMITTED["headwise"], work)
    assert res.returncode != 0
    log = _log(res)
    assert log[-1] == ("[train_gdn_cp] error: LinearCPError: linear_num_key_heads=2 is not divisible by TP*CP=1*4, "
                       "which linear_cp_mode='headwise' needs. Use linear_cp_mode='chunkwise' or "
                       "linear_cp_mode='all_gather' (they need heads % TP == 0), or change TP/CP.")
    assert "exitcode  : 2" in res.stdout + res.stderr  # the ranks' own status, under torchrun's 1


def test_resume_at_cp4_from_the_cp2_checkpoint(cp2, work):
    assert cp2.returncode == 0
    res = run_doc_command(COMMITTED["resume"], work, steps=1)
    assert res.returncode == 0, res.stderr[-3000:]
    log = _log(res)
    assert f"[train_gdn_cp] resumed from {work}/ckpt-cp2 at step 2 (saved at CP 2, chunkwise; now CP 4, chunkwise)" in log
    assert ("[train_gdn_cp] GDN path: chunkwise on 2 of 2 GDN layers (CP group of 4 ranks); "
            "FLA build_cp_context 2x, headwise all-to-all 0x, all_gather 0x") in log
    assert any(re.fullmatch(r"\[train_gdn_cp\] step 3/3 loss \d+\.\d{4}", ln) for ln in log)
