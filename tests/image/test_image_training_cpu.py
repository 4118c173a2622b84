"""The training tier on CPU: a small GDN GPTModel trained under CP with Megatron's own DDP,
distributed optimizer, ``finalize_model_grads`` and ``dist_checkpointing`` (gloo, FLA replaced
by ``fla_emulation``: Megatron's side only; the real kernels run in the GPU job,
``tools/gpu-training``).

The CPU tier of ``training_suite.matrix("cpu")``: CP=1 references (THD, SBHD), CP=4 chunkwise
THD, CP=2 x DP=2 headwise THD, CP=4 all_gather SBHD, a CP=4 checkpoint resumed under
CP=2 x DP=2 headwise, a CP=1 checkpoint resumed under CP=4 chunkwise; 4 steps, save at step 2;
TP=2 x CP=2 chunkwise THD and TP=2 x CP=2 headwise THD with sequence parallelism, 2 steps;
dynamic CP (one CP=4 world, micro-batches on CP 4/2/1 subgroups) chunkwise THD, 2 steps; the
upgrade path (``training_suite.upgrade_runs``: a base-tree CP=1 checkpoint resumed by the patched
tree at CP=1 and CP=4 chunkwise, a patched CP=1 checkpoint resumed by the base tree).
Gated at the frozen gates of ``training_suite.GATES`` (docs/training-tier-tests.md). Results go to
``build/training-cpu`` (ignored by git), never to tracked files.
"""

from __future__ import annotations

import json

import pytest
import torch

from _image_env import HAVE_BASE_TREE, REPO, need_base_tree, need_fla, need_tree

OUT = REPO / "build" / "training-cpu"
_cache = {}


def summary():
    if "s" not in _cache:
        import training_suite as S

        runs = S.matrix("cpu")
        if not HAVE_BASE_TREE:  # the upgrade tests skip, naming the missing tree
            runs = [r for r in runs if not r["spec"].name.startswith("upgrade/")]
        OUT.mkdir(parents=True, exist_ok=True)
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="gdn-training-ckpt-") as work:
            results = S.execute(runs, OUT, Path(work), "cpu", jobs=1, budget=900, log=lambda s: None)
        _cache["results"] = results
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
    assert len(recs) == (15 if HAVE_BASE_TREE else 10)


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
    """Problem 4 of docs/training-tier-tests.md is real in the tree under test: after the distributed
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


UPGRADE_RESUMES = ("upgrade/base-cp1->patched-cp1", "upgrade/base-cp1->patched-cp4-chunkwise",
                   "upgrade/patched-cp1->base-cp1")


def test_upgrade_checkpoints_resume_across_the_base_and_patched_trees():
    """Issue 25: a base-tree CP=1 checkpoint resumed by the patched tree (CP=1, CP=4 chunkwise),
    a patched CP=1 checkpoint resumed by the base tree, and the two trees' CP=1 runs from step 0;
    each at its frozen gate (``upgrade_cpu``: the same stand-in kernels on both trees, measured
    bit for bit, and so asserted here; ``cp_vs_ref`` for the CP=4 resume)."""
    need_base_tree()
    recs = {r["id"]: r for r in _of("upgrade")}
    assert set(recs) == {
        "upgrade/base-cp1/ref vs upgrade/patched-cp1/ref",
        "upgrade/base-cp1->patched-cp1 vs upgrade/base-cp1/ref",
        "upgrade/base-cp1->patched-cp4-chunkwise vs upgrade/base-cp1/ref",
        "upgrade/patched-cp1->base-cp1 vs upgrade/patched-cp1/ref"}, sorted(recs)
    assert not _bad(recs.values()), _bad(recs.values())
    for rid, r in recs.items():
        resumed = "->" in rid
        assert [row["step"] for row in r["rows"]] == ([3, 4] if resumed else [1, 2, 3, 4]), rid
        assert all(row["valid_tokens"] == row["ref_valid_tokens"] for row in r["rows"]), rid
        assert sorted(r["trees"]) == ["base", "patched"], rid
        if "cp4" not in rid:
            assert r["gate"] == "upgrade_cpu", rid
            assert r["max_loss_rel"] == 0.0 and r["max_grad_norm_rel"] == 0.0, (rid, r["rows"])
        else:
            assert r["gate"] == "cp_vs_ref", rid


def test_upgrade_runs_import_the_tree_they_name_and_take_its_path():
    """Each upgrade run's processes imported its own tree's GDN (never both in one process),
    and every layer at every step took that tree's path: the base tree through its headwise
    all-to-alls (identities at CP=1) and without any of the patch's names."""
    need_base_tree()
    _of("upgrade")
    import training as T
    import training_suite as S

    results = _cache["results"]
    names = [n for n in results if n.startswith("upgrade/")]
    assert len(names) == 5, names
    for n in names:
        rec = results[n]
        tree = rec["spec"]["tree"]
        assert rec["imported"]["megatron"].startswith(str(S.TREE_DIRS[tree]) + "/"), (n, rec["imported"])
        for p in rec["paths"]:
            assert p["passed"], (n, p)
            want = sorted(T.BASE_TREE_LACKS) if tree == "base" else []
            assert p["tree"]["absent"] == want, (n, p["tree"])
        if tree == "base":
            layers = rec["paths"][0]["layers"]
            assert layers and all(v["passed"] for v in layers.values()), (n, layers)
    assert sum(results[n]["spec"]["tree"] == "base" for n in names) == 2


def test_the_base_tree_meets_the_shared_adam_step_too():
    """Problem 4 of docs/training-tier-tests.md is base MCore's, not our patch's: the base tree's resume of
    a patched checkpoint finds the same shared Adam ``step`` tensor holding 1."""
    need_base_tree()
    _of("upgrade")
    for n in UPGRADE_RESUMES:
        loaded = _cache["results"][n]["loaded"]
        assert loaded["step"] == 2, (n, loaded)
        assert loaded["shared_step_tensor"] is True, (n, loaded)
        assert loaded["step_values_before"] == [1.0], (n, loaded)


def test_thd_noempty_is_the_thd_batch_without_its_empty_segment():
    """The upgrade runs' layout: the same documents, padding and tail as ``thd``, the empty
    segment left out (FLA 0.4.1's prepare_chunk_indices mis-maps chunks after one)."""
    need_tree()
    import training as T

    for step in (1, 3):
        for i in range(T.MICRO_BATCHES):
            a, b = T.micro_batch(step, i, "thd"), T.micro_batch(step, i, "thd_noempty")
            assert 0 not in b.seq_lens()
            assert [n for n in a.seq_lens() if n] == b.seq_lens()
            assert [v for v, n in zip(a.valid, a.seq_lens()) if n] == b.valid
            for f in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(getattr(a, f), getattr(b, f)), f
    with pytest.raises(ValueError, match="unknown layout"):
        T.micro_batch(1, 0, "bshd")


def test_config_for_the_base_tree_drops_only_what_the_patch_adds():
    """``config_kwargs_for_tree``: the base tree's config may lack ``linear_cp_mode`` and
    nothing else; base runs are CP=1; the patched tree must accept every field."""
    need_tree()
    import dataclasses

    import training as T

    @dataclasses.dataclass
    class Old:
        num_layers: int = 1
        hidden_size: int = 8

    kw = {"num_layers": 2, "hidden_size": 8, "linear_cp_mode": "chunkwise"}
    base = T.RunSpec("b", tree="base")
    assert T.config_kwargs_for_tree(kw, base, Old) == {"num_layers": 2, "hidden_size": 8}
    with pytest.raises(ValueError, match=r"run b: .*\['ffn_hidden_size'\], which our patch"):
        T.config_kwargs_for_tree({**kw, "ffn_hidden_size": 3}, base, Old)
    with pytest.raises(ValueError, match="base-tree runs are CP=1"):
        T.config_kwargs_for_tree(kw, T.RunSpec("b4", cp=4, tree="base"), Old)
    with pytest.raises(ValueError, match="patched tree's TransformerConfig lacks"):
        T.config_kwargs_for_tree(kw, T.RunSpec("p"), Old)
    with pytest.raises(ValueError, match="unknown tree 'old'"):
        T.config_kwargs_for_tree(kw, T.RunSpec("x", tree="old"), Old)


def test_base_tree_processes_get_the_base_tree_and_fla041_first(tmp_path, monkeypatch):
    """What tools/gpu-training sets up on the GPU host, on CPU: the environment ``tree_env``
    gives a base-tree run's process leads with the base tree and ``$GDN_BASE_SITE`` (FLA 0.4.1)
    and drops the patched tree and ``$GDN_PATCHED_SITE`` (FLA 0.4.2), so that process imports
    the base tree's megatron and the 0.4.1 FLA, never both FLAs. Stand-in FLA packages that
    only carry a version prove which site won; ``check_fla_for_tree`` names a mismatch."""
    need_base_tree()
    import os
    import subprocess
    import sys

    import training as T
    import training_suite as S

    sites = {}
    for v in ("0.4.1", "0.4.2"):
        d = tmp_path / f"fla{v.replace('.', '')}"
        (d / "fla").mkdir(parents=True)
        (d / "fla" / "__init__.py").write_text(f"__version__ = {v!r}\n")
        sites[v] = str(d)
    monkeypatch.setenv("GDN_BASE_SITE", sites["0.4.1"])
    monkeypatch.setenv("GDN_PATCHED_SITE", sites["0.4.2"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(S.TREE_DIRS["patched"]), sites["0.4.2"], "/elsewhere"]))
    probe = ("import fla, megatron.core.ssm as m, os; "
             "print(fla.__version__); print(os.path.realpath(m.__file__))")
    for tree, fla_v in (("base", "0.4.1"), ("patched", "0.4.2")):
        env = S.tree_env(tree)
        parts = env["PYTHONPATH"].split(os.pathsep)
        assert parts[:2] == [str(S.TREE_DIRS[tree]), sites[fla_v]], parts
        assert parts[2:] == ["/elsewhere"], parts
        assert env["GDN_TREE"] == str(S.TREE_DIRS[tree])
        got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120, cwd=str(tmp_path))
        assert got.returncode == 0, got.stderr[-2000:]
        version, path = got.stdout.split()
        assert version == fla_v and path.startswith(str(S.TREE_DIRS[tree]) + "/"), (tree, got.stdout)
    import types

    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.4.2"))
    with pytest.raises(RuntimeError, match=r"run b \(tree base\) needs FLA 0.4.1, imports 0.4.2"):
        S.check_fla_for_tree(T.RunSpec("b", tree="base"))
    assert S.check_fla_for_tree(T.RunSpec("p")) == "0.4.2"


def test_the_gates_in_force_are_the_ones_frozen_for_the_next_run():
    """``GATES`` holds the second set (docs/training-tier-tests.md, frozen before the second GPU run), the
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


# ---- hostile-user checks of pack and --select (h-hostile) -----------------------------


def _results_dir(root):
    for rel, text in (("runs/b.json", "{}\n"), ("runs/a.json", "[]\n"), ("plots/x.png", "png"),
                      ("summary.json", "{}\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_pack_again_after_remove_keeps_the_archive(tmp_path):
    """A second ``pack`` (tools/gpu-training run twice, or by hand) after ``--remove`` found no
    folders and wrote an empty archive over the full one: the folders not on disk keep their
    members from the archive there, so packing is idempotent."""
    need_tree()
    import tarfile

    import training_suite as S

    first = S.pack(_results_dir(tmp_path), remove=True).read_bytes()
    assert S.pack(tmp_path).read_bytes() == first
    assert S.pack(tmp_path, remove=True).read_bytes() == first
    # only plots/ on disk again (a `plot` after unpacking runs/ elsewhere): runs/ stays packed
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "y.png").write_text("png2")
    with tarfile.open(S.pack(tmp_path)) as tar:
        assert tar.getnames() == ["plots/y.png", "runs/a.json", "runs/b.json"]


def test_pack_with_nothing_to_pack_is_an_error_naming_the_dir(tmp_path, capsys):
    need_tree()
    import training_suite as S

    with pytest.raises(FileNotFoundError, match="no runs/ or plots/"):
        S.pack(tmp_path)
    assert not (tmp_path / S.ARCHIVE).exists()
    f = tmp_path / "file"
    f.write_text("")
    for out in (tmp_path, f, tmp_path / "missing"):
        assert S.main(["pack", "--out", str(out)]) == 2
        assert str(out) in capsys.readouterr().err


def test_a_pack_that_fails_midway_leaves_the_archive_and_no_temporary(tmp_path, monkeypatch):
    """Atomic: the archive is replaced whole or not at all, and a failed or killed pack leaves
    no temporary behind (a device host returns at most 8 files); two packs at once write
    temporaries of their own."""
    need_tree()
    import gzip

    import training_suite as S

    before = S.pack(_results_dir(tmp_path)).read_bytes()
    (tmp_path / "runs" / "c.json").write_text("{}\n")

    def boom(self, data):
        raise OSError("disk full")
    monkeypatch.setattr(gzip.GzipFile, "write", boom)
    with pytest.raises(OSError, match="disk full"):
        S.pack(tmp_path)
    assert (tmp_path / S.ARCHIVE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([S.ARCHIVE, "plots", "runs", "summary.json"])


def test_two_packs_at_once_use_temporaries_of_their_own(tmp_path, monkeypatch):
    need_tree()
    import os

    import training_suite as S

    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(str(src))
        return real(src, dst)
    monkeypatch.setattr(S.os, "replace", spy)
    monkeypatch.setattr(S.Path, "replace", lambda self, dst: spy(self, dst))
    S.pack(_results_dir(tmp_path))
    S.pack(tmp_path)
    assert len(seen) == 2 and seen[0] != seen[1]
    assert os.stat(tmp_path / S.ARCHIVE).st_mode & 0o777 == 0o644


@pytest.mark.parametrize("select, message", [("nomatch_xyz", "matches no run"),
                                             ("(", "not a regular expression")])
def test_a_select_that_matches_nothing_or_is_no_regex_exits_2(tmp_path, select, message, capsys):
    """``--select`` (GDN_TRAINING_SELECT) with a typo ran nothing and passed (exit 0)."""
    need_tree()
    import training_suite as S

    for cmd in ("list", "run", "summarise"):
        assert S.main([cmd, "--out", str(tmp_path), "--tier", "cpu", "--device", "cpu",
                       "--select", select]) == 2
        err = capsys.readouterr().err
        assert message in err and repr(select) in err
    assert not (tmp_path / "summary.json").exists()
