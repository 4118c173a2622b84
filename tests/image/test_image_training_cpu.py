"""The training tier on CPU: a small GDN GPTModel trained under CP with Megatron's own DDP,
distributed optimizer, ``finalize_model_grads`` and ``dist_checkpointing`` (gloo, FLA replaced
by ``fla_emulation``: Megatron's side only; the real kernels run in the GPU job,
``tools/gpu-training``).

The CPU tier of ``training_suite.matrix("cpu")``: CP=1 references (THD, SBHD), CP=4 chunkwise
THD, CP=2 x DP=2 headwise THD, CP=4 all_gather SBHD, a CP=4 checkpoint resumed under
CP=2 x DP=2 headwise, a CP=1 checkpoint resumed under CP=4 chunkwise; 4 steps, save at step 2;
TP=2 x CP=2 chunkwise THD and TP=2 x CP=2 headwise THD with sequence parallelism, 2 steps;
dynamic CP (one CP=4 world, micro-batches on CP 4/2/1 subgroups) chunkwise THD, 2 steps.
Gated at the frozen gates of ``training_suite.GATES`` (docs/training.md). Results go to
``build/training-cpu`` (ignored by git), never to tracked files.
"""

from __future__ import annotations

import json

import pytest
import torch

from _image_env import REPO, need_fla, need_tree

OUT = REPO / "build" / "training-cpu"
_cache = {}


def summary():
    if "s" not in _cache:
        import training_suite as S

        runs = S.matrix("cpu")
        OUT.mkdir(parents=True, exist_ok=True)
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="gdn-training-ckpt-") as work:
            results = S.execute(runs, OUT, Path(work), "cpu", jobs=1, budget=900, log=lambda s: None)
        s = S.summarise(runs, results)
        (OUT / "summary.json").write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
        (OUT / "summary.md").write_text(S.tables({**s, "tier": "cpu", "device": "cpu"}))
        _cache["s"] = s
    return _cache["s"]


def _of(kind):
    need_tree()
    need_fla()
    recs = [c for c in summary()["comparisons"] if c["kind"] == kind]
    assert recs, f"no {kind} records"
    return recs


def _bad(recs):
    return [{k: r.get(k) for k in ("id", "error", "problem", "problems")} for r in recs if not r["passed"]]


def test_every_run_trains_and_takes_its_path_in_every_layer():
    """Each run finished on every rank: finite, the same figures on every rank, the loss fell
    (fresh runs), and every GDN layer took the run's mode's path at every step."""
    recs = _of("run")
    assert not _bad(recs), _bad(recs)
    assert len(recs) == 10


def test_cp_runs_match_the_cp1_reference_at_the_frozen_gates():
    """Per-step loss and grad norm vs CP=1, equal valid-token counts every step, step 1 tight."""
    recs = _of("cp_vs_ref")
    assert {r["id"].split(" vs ")[0] for r in recs} == {
        "cp4/thd/chunkwise", "cp2dp2/thd/headwise", "cp4/sbhd/all_gather",
        "tp2cp2/thd/chunkwise", "tp2cp2sp/thd/headwise", "dynamic/thd/chunkwise"}
    assert not _bad(recs), _bad(recs)
    for r in recs:
        assert all(row["valid_tokens"] == row["ref_valid_tokens"] for row in r["rows"])


def test_tp2_cp2_runs_match_cp1_at_step_1_with_and_without_sequence_parallelism():
    """TP=2 x CP=2 (chunkwise) and TP=2 x CP=2 + SP (headwise) at step 1 within the k = 1 gate
    (1e-5 / 1e-4); problem 6's workaround summed GDN's out_norm gradients over TP without SP
    and was not needed with it; under SP every layer got 128 / (CP*TP) = 32 tokens."""
    import training_suite as S

    gate = S.GATES["cp_vs_ref"][0]
    recs = {r["id"].split(" vs ")[0]: r for r in _of("cp_vs_ref") if r["id"].startswith("tp2cp2")}
    assert set(recs) == {"tp2cp2/thd/chunkwise", "tp2cp2sp/thd/headwise"}
    for r in recs.values():
        row = r["rows"][0]
        assert row["step"] == 1 and row["loss_rel"] <= gate["loss_rel"], row
        assert row["grad_norm_rel"] <= gate["grad_norm_rel"], row
    runs = {c["id"]: c for c in _of("run")}
    assert runs["tp2cp2/thd/chunkwise"]["workarounds"]["gdn_out_norm_grad_over_tp"] is True
    assert runs["tp2cp2sp/thd/headwise"]["workarounds"]["gdn_out_norm_grad_over_tp"] is False
    rec = json.loads(S._run_path(OUT, "tp2cp2sp/thd/headwise").read_text())
    assert rec["spec"]["sequence_parallel"] and rec["paths_all_ranks"]


def test_dynamic_cp_micro_batches_ran_on_cp_4_2_and_1_subgroups():
    """The dynamic-CP run's rank 0 ran micro-batch 0 on CP=4, 1 on CP=2 and 3 on CP=1 at every
    step, each on its subgroup size's path, and no process group was created while training
    (every rank's paths passed: ``test_every_run_trains...``)."""
    _of("run")
    import training_suite as S

    rec = json.loads(S._run_path(OUT, "dynamic/thd/chunkwise").read_text())
    assert rec["paths_all_ranks"] is True
    for p in rec["paths"]:
        assert p["passed"] and p["new_group_calls"] == 0, p
        assert [(m["index"], m["cp"]) for m in p["micro_batches"]] == [(0, 4), (1, 2), (3, 1)]


def test_dynamic_assignments_place_every_micro_batch_once():
    need_tree()
    import training as T

    seen = sorted((i, n) for r in range(4) for i, n, rr in T.dynamic_assignments(r, 4) if rr == 0)
    assert seen == [(0, 4), (1, 2), (2, 2), (3, 1)]
    assert [(i, n, rr) for i, n, rr in T.dynamic_assignments(3, 4)] == [(0, 4, 3), (2, 2, 1)]
    with pytest.raises(ValueError, match="places micro-batches"):
        T.dynamic_assignments(0, 4, ((4, (0,)), (2, (1, 2))))
    with pytest.raises(ValueError, match="subgroups of a CP=4 world"):
        T.dynamic_assignments(0, 4, ((4, (0, 1)), (2, (2, 3))))


def test_resumes_across_cp_sizes_match_the_uninterrupted_run():
    """CP=4 chunkwise saved at step 2 resumes under CP=2 x DP=2 headwise, CP=1 saved resumes
    under CP=4 chunkwise: new processes, the checkpoint's step, then the uninterrupted numbers."""
    recs = _of("resume")
    assert len(recs) == 2
    assert not _bad(recs), _bad(recs)
    for r in recs:
        assert [row["step"] for row in r["rows"]] == [3, 4]


def test_the_resume_meets_base_mcores_shared_adam_step():
    """Problem 4 of docs/training.md is real in the tree under test: after the distributed
    optimizer's load every parameter shared one Adam ``step`` tensor holding the dummy state's
    1 instead of the checkpoint's 2 (the workaround then gave each its own step 2: the resume
    test above passes only with it)."""
    recs = [r for r in _of("run") if r["id"].startswith("resume/")]
    assert len(recs) == 2
    for r in recs:
        assert r["loaded"]["step"] == 2
        assert r["loaded"]["shared_step_tensor"] is True, r["loaded"]
        assert r["loaded"]["step_values_before"] == [1.0], r["loaded"]


def test_headwise_on_an_unsplittable_geometry_fails_at_construction():
    recs = _of("expected_error")
    assert not _bad(recs), recs


def test_packed_micro_batches_have_what_pipelines_make():
    """Several unequal documents padded to multiples of 2*MAX_CP, an empty segment, a padding
    tail; labels only inside documents; the same batch on every call."""
    need_tree()
    import training as T

    lens = set()
    for step in (1, 2, 3):
        for i in range(T.MICRO_BATCHES):
            mb = T.micro_batch(step, i, "thd")
            segs = mb.seq_lens()
            assert all(n % (2 * T.MAX_CP) == 0 for n in segs)
            assert 0 in segs[1:-1], "no empty segment between documents"
            assert mb.valid[-1] == 0 and segs[-1] > 0, "no padding tail"
            assert int(mb.loss_mask.sum()) == sum(v - 1 for v in mb.valid if v)
            assert any(v % (2 * T.MAX_CP) for v in mb.valid if v), "no per-document padding"
            lens.add(tuple(mb.valid))
            assert torch.equal(mb.tokens, T.micro_batch(step, i, "thd").tokens)
    assert len(lens) > 1


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_zigzag_split_matches_the_trees_context_parallel_layout(cp):
    need_tree()
    import training as T

    for i in range(T.MICRO_BATCHES):
        mb = T.micro_batch(1, i, "thd")
        seen = torch.cat([T.rank_indices(mb, cp, r) for r in range(cp)])  # asserts tree == ref
        assert torch.equal(seen.sort().values, torch.arange(T.SEQ))


def test_the_gates_in_force_are_the_ones_frozen_for_the_next_run():
    """``GATES`` holds the second set (docs/training.md, frozen before the second GPU run), the
    first run's set stays as ``GATES_RUN1``; a resume in another topology uses the very bands
    of the CP-vs-reference comparison, in both sets."""
    need_tree()
    import training_suite as S

    def rows(g):
        return [(b["upto"], b["loss_rel"], b["grad_norm_rel"]) for b in g]

    assert rows(S.GATES["cp_vs_ref"]) == [(1, 1e-5, 1e-4), (5, 1e-4, 1e-2), (10, 1e-2, 1.5),
                                          (30, 0.1, 45.0)]
    assert rows(S.GATES_RUN1["cp_vs_ref"]) == [(1, 1e-5, 1e-4), (5, 1e-4, 1e-2), (10, 5e-3, 0.5),
                                               (30, 0.1, 10.0)]
    for g in (S.GATES, S.GATES_RUN1):
        assert g["resume_other"] is g["cp_vs_ref"]
        assert rows(g["resume_same"]) == [(30, 1e-6, 1e-5)]


def test_pack_writes_one_deterministic_archive_of_runs_and_plots(tmp_path):
    """``training_suite.pack``: runs/ and plots/ in one .tgz, sorted, the same bytes for the
    same files whatever their mtimes; the summaries are not in it (they stay at top level)."""
    need_tree()
    import os
    import tarfile

    import training_suite as S

    for rel, text in (("runs/b.json", "{}\n"), ("runs/a.json", "[]\n"), ("plots/x.png", "png"),
                      ("summary.json", "{}\n"), ("summary.md", "# s\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    first = S.pack(tmp_path).read_bytes()
    os.utime(tmp_path / "runs" / "a.json", (1e9, 1e9))
    assert S.pack(tmp_path).read_bytes() == first
    with tarfile.open(tmp_path / S.ARCHIVE) as tar:
        assert tar.getnames() == ["plots/x.png", "runs/a.json", "runs/b.json"]
        assert {m.mtime for m in tar.getmembers()} == {0}
        assert tar.extractfile("runs/a.json").read() == b"[]\n"
    S.pack(tmp_path, remove=True)  # what tools/gpu-training does: only the archive and summaries
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([S.ARCHIVE, "summary.json", "summary.md"])
    with tarfile.open(tmp_path / S.ARCHIVE) as tar:
        assert len(tar.getnames()) == 3


def test_tp_shard_takes_each_ranks_part_of_every_block():
    """``gdn_harness.tp_shard``: a TP rank's shard is its half of every block (GDN's in_proj
    ``[q, k, v, z, beta, alpha]`` is cut block by block, not as one contiguous slice), and the
    ranks' shards put back block by block are the TP=1 tensor."""
    import gdn_harness as H

    full = torch.arange(16.0).reshape(8, 2)
    r0, r1 = (H.tp_shard(full, 0, [2, 2, 4], r, 2) for r in (0, 1))
    assert r0[:, 0].tolist() == [0.0, 4.0, 8.0, 10.0]
    assert r1[:, 0].tolist() == [2.0, 6.0, 12.0, 14.0]
    cols = H.tp_shard(full, 1, [2], 1, 2)
    assert torch.equal(cols, full[:, 1:])
    back = torch.cat([torch.cat([a, b]) for a, b in zip(torch.split(r0, [1, 1, 2]),
                                                          torch.split(r1, [1, 1, 2]))])
    assert torch.equal(back, full)
