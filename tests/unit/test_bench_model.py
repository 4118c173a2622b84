"""bench/gdn_model.py's CPU-side logic: argument checks, job plan, sync attribution and summaries."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_bench_script(name, filename):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_bench_script("bench_gdn_model", "gdn_model.py")


def test_defaults_are_the_issue_geometry_and_matrix(bench):
    a = bench.parse_args(["--out", "/tmp/x"])
    assert (a.hidden, a.key_heads, a.value_heads, a.head_dim, a.conv_kernel) == (4096, 16, 32, 128, 4)
    assert a.layers == [2, 8] and a.cp == [1, 2, 4] and a.layouts == ["thd", "sbhd"]
    assert a.recompute == ["off", "on"] and a.samples == 8
    assert a.modes == ["chunkwise", "headwise", "all_gather", "ideal", "old_headwise"]


@pytest.mark.parametrize("argv, message", [
    (["--modes", "chunkwise,auto"], "unknown modes auto"),
    (["--modes", "headwise,headwise"], "names a value twice"),
    (["--layers", "2,x"], "give layer counts"),
    (["--layers", "0"], "must be positive"),
    (["--layouts", "bshd"], "unknown layouts bshd"),
    (["--recompute", "full"], "unknown recompute settings full"),
    (["--tokens", "1000", "--cp", "4"], "does not split into 2*CP chunks per sample for CP [4]"),
    (["--tokens", "100", "--layouts", "sbhd", "--cp", "4"], "not divisible by 2*CP for CP [4]"),
    (["--repeats", "0"], "--repeats 0: must be at least 1"),
])
def test_bad_arguments_exit_2_naming_the_option(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_must_not_be_a_file(bench, tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text("{}")
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(f)])
    assert "is a file; give a directory" in capsys.readouterr().err


def test_job_plan_times_cp1_counts_cp2_4_and_skips_old_without_fla041(bench):
    jobs, skipped = bench.plan_jobs(bench.parse_args([]))
    names = [j["name"] for j in jobs]
    assert names == ["patched-cp1", "patched-cp1-modes", "patched-cp2", "patched-cp4", "ideal-p2", "ideal-p4"]
    assert [j["timed"] for j in jobs] == [True, False, False, False, True, True]
    assert jobs[0]["modes"] == ["chunkwise"] and jobs[1]["modes"] == ["headwise", "all_gather"]
    ideal = jobs[4]
    assert ideal["tokens"] == 32768 // 2 and ideal["world"] == 1 and ideal["cp"] == 1
    assert ideal["modes"] == ["ideal"] and ideal["ideal_for"] == 2
    assert skipped == [{"mode": "old_headwise", "why": "no --fla041-site (FLA 0.4.1) given"}]
    jobs, skipped = bench.plan_jobs(bench.parse_args(["--fla041-site", "/x", "--cp", "1,2"]))
    assert [j["name"] for j in jobs] == ["patched-cp1", "base-cp1", "patched-cp1-modes", "patched-cp2",
                                         "base-cp2", "ideal-p2"]
    assert not skipped and jobs[1]["modes"] == ["old_headwise"] and jobs[4]["world"] == 2


def test_matrix_alternates_cp1_rounds_counts_once_and_lets_explicit_options_win(bench):
    a = bench.parse_args(["--matrix", "--fla041-site", "/x"])
    assert (a.rounds, a.count_tokens, a.deadline_s, a.warmup, a.repeats) == (2, 8192, 560, 2, 6)
    assert a.no_profile and a.cp == [1, 2, 4] and a.tokens == 32768
    jobs, _ = bench.plan_jobs(a)
    names = [j["name"] for j in jobs]
    assert names[:4] == ["patched-cp1", "base-cp1", "base-cp1-r2", "patched-cp1-r2"]
    assert names[-2:] == ["ideal-p2", "ideal-p4"] and a.timed_layouts == ["thd"]
    assert [j["counts"] for j in jobs if j["round"] == 2] == [False, False]
    assert all(j["counts"] for j in jobs if j["round"] == 1)
    assert {j["tokens"] for j in jobs if not j["timed"]} == {8192}
    assert {j["tokens"] for j in jobs if j["timed"] and j["modes"] != ["ideal"]} == {32768}
    b = bench.parse_args(["--matrix", "--rounds", "3", "--cp", "1", "--repeats", "4"])
    assert (b.rounds, b.cp, b.repeats, b.count_tokens) == (3, [1], 4, 8192)
    assert [j["round"] for j in bench.plan_jobs(b)[0]] == [1, 2, 3, 1]
    assert bench.parse_args([]).count_tokens == 32768  # without --matrix: --tokens


def test_deadline_skips_launches_that_cannot_start_and_fails_the_call(bench, tmp_path, monkeypatch, capsys):
    clock = iter([0.0, 0.0, 540.0, 540.0, 545.0])
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock, 545.0))
    launched = []

    def fake_launch(args, job, part, argv, timeout):
        launched.append((job["name"], timeout))
        return 0
    monkeypatch.setattr(bench, "_launch", fake_launch)
    tree = tmp_path / "tree" / "megatron" / "core" / "ssm"
    tree.mkdir(parents=True)
    (tree / "gated_delta_net.py").write_text("")
    rc = bench.main(["--tree", str(tmp_path / "tree"), "--cp", "1,2", "--modes", "chunkwise",
                     "--deadline-s", "560", "--timeout-s", "240", "--out", str(tmp_path / "o")])
    assert rc == 1
    assert launched == [("patched-cp1", 240.0)]
    import json
    res = json.loads((tmp_path / "o" / "gdn_model.json").read_text())
    assert [s["job"] for s in res["skipped"]] == ["patched-cp2"]
    assert "--deadline-s 560 reached" in res["skipped"][0]["why"]


@pytest.mark.parametrize("frames, site", [
    # innermost frame in megatron wins over torch frames below it
    ([("/r/bench/gdn_model.py", 10), ("/r/build/tree/patched/megatron/core/ssm/gdn_context_parallel.py", 301),
      ("/usr/lib/python3/site-packages/torch/_tensor.py", 40)],
     "megatron/core/ssm/gdn_context_parallel.py:301"),
    # fla deeper than megatron: the innermost one
    ([("/t/megatron/core/ssm/gated_delta_net.py", 500), ("/tmp/gdn-site/fla/ops/utils/index.py", 77),
      ("/x/torch/functional.py", 3)], "fla/ops/utils/index.py:77"),
    # a path with megatron twice: cut at the last /megatron/
    ([("/work/megatron/build/tree/base/megatron/core/ssm/gated_delta_net.py", 12)],
     "megatron/core/ssm/gated_delta_net.py:12"),
    ([("/r/bench/gdn_model.py", 10), ("/r/other/lib.py", 5), ("/x/torch/autograd/__init__.py", 9)],
     "other:lib.py:5"),
    ([("/x/torch/autograd/__init__.py", 9), ("<frozen runpy>", 1)], "unattributed"),
    ([("C:\\site\\fla\\modules\\conv.py", 8)], "fla/modules/conv.py:8"),
])
def test_sync_attribution_names_the_first_megatron_or_fla_frame(bench, frames, site):
    assert bench.attribute_frame(frames) == site


def test_sync_warning_text_and_summary(bench):
    assert bench.is_sync_warning("called a synchronizing CUDA operation")
    assert not bench.is_sync_warning("some other warning")
    recs = [{"site": "a.py:1", "phase": "forward"}, {"site": "b.py:2", "phase": "backward"},
            {"site": "b.py:2", "phase": "forward"}]
    s = bench.summarize_syncs(recs)
    assert s == {"total": 3, "forward": 2, "backward": 1, "sites": {"b.py:2": 2, "a.py:1": 1}}
    assert list(s["sites"]) == ["b.py:2", "a.py:1"]
    assert bench.summarize_syncs([]) == {"total": 0, "forward": 0, "backward": 0, "sites": {}}


def test_growth_per_layer_is_the_slope_between_smallest_and_largest_L(bench):
    def run(mode, L, total, cp=1):
        return {"mode": mode, "cp": cp, "layout": "thd", "recompute": "on", "layers": L,
                "host_syncs": {"total": total}}
    runs = [run("chunkwise", 2, 1), run("chunkwise", 8, 1), run("old_headwise", 2, 92),
            run("old_headwise", 8, 368), run("headwise", 2, 1, cp=2),
            {"mode": "x", "cp": 1, "layout": "thd", "recompute": "on", "layers": 2, "host_syncs": None}]
    g = bench.growth_per_layer(runs)
    assert [(r["mode"], r["per_extra_layer"]) for r in g] == [("chunkwise", 0.0), ("old_headwise", 46.0)]
    assert g[1]["syncs"] == [92, 368] and g[1]["layers"] == [2, 8]


@pytest.fixture(scope="module")
def report():
    return _load_bench_script("bench_model_report", "model_report.py")


def test_report_pairs_cp1_rounds_by_tree_and_keeps_ideal_runs_apart(report):
    def run(tree, mode, rnd, tps, **kw):
        return dict({"tree": tree, "mode": mode, "cp": 1, "layout": "thd", "recompute": "off", "layers": 8,
                     "round": rnd, "tokens_per_s": tps, "timings_valid": True, "host_syncs": None}, **kw)
    runs = [run("patched", "chunkwise", 1, 99.0), run("base", "old_headwise", 1, 100.0),
            run("base", "old_headwise", 2, 100.0), run("patched", "chunkwise", 2, 102.0),
            run("patched", "chunkwise", 3, 500.0)]  # round 3 has no old-image partner: not paired
    (c,) = report.cp1_timings(runs)
    assert [round(x[2], 3) for x in c["rounds"]] == [0.99, 1.02]
    assert c["median_ratio"] == pytest.approx(1.005)
    ideal = [run("patched", "ideal", 1, 1.0, ideal_for_cp=2), run("patched", "ideal", 1, 2.0, ideal_for_cp=4)]
    assert len({report._key(r) for r in ideal}) == 2


def test_report_reads_a_result_line_with_the_before_count(report, bench):
    rec = {"mode": "chunkwise", "cp": 2, "layers": 8, "layout": "thd", "recompute": "on", "tokens_per_s": 5.0,
           "timings_valid": False, "peak_alloc_mib": 7.0,
           "host_syncs": {"total": 1, "forward": 1, "backward": 0, "sites": {"megatron/x.py:3": 1}},
           "host_syncs_finalized": {"total": 0}, "finalize_syncs": 1, "host_syncs_before": {"total": 8}}
    got = report.from_line(bench._line(rec))
    assert got["host_syncs_before"] == {"total": 8} and got["host_syncs_finalized"] == {"total": 0}
    assert got["finalize_syncs"] == 1
    assert got["host_syncs"]["sites"] == {"megatron/x.py:3": 1} and got["timings_valid"] is False


def test_report_reads_the_attached_counts_of_results_before_issue_43(report, bench):
    # results/bench/model holds runs of trees with attach_cu_seqlens_cpu (issues 24-42)
    rec = {"mode": "chunkwise", "cp": 2, "layers": 8, "layout": "thd", "recompute": "on", "tokens_per_s": 5.0,
           "timings_valid": False, "peak_alloc_mib": 7.0,
           "host_syncs": {"total": 1, "forward": 1, "backward": 0, "sites": {}},
           "host_syncs_attached": {"total": 0}, "attach_syncs": 1}
    line = bench._line(rec)
    assert " finalized 0 + finalize 1" in line
    old_line = line.replace(" finalized 0 + finalize 1", " attached 0 + attach 1")
    for text in (line, old_line):
        got = report.from_line(text)
        assert got["host_syncs_finalized"] == {"total": 0} and got["finalize_syncs"] == 1
    table = report.tables([dict(rec, tree="patched", round=1, tokens=8)])
    assert "| patched | chunkwise | 2 | thd | on | 8 | 1 | 8 | 1 (1/0) | 0 | 1 | - |" in table


# ---- hostile-user checks (h-hostile) ---------------------------------------------------


def test_an_abbreviated_matrix_flag_still_gets_the_matrix_defaults(bench):
    # argparse accepts --matr for --matrix: the preset must follow the flag, not its spelling
    a = bench.parse_args(["--matr"])
    assert a.matrix and (a.rounds, a.deadline_s, a.count_tokens) == (2, 560, 8192)


def test_thd_timed_layout_checks_tokens_even_when_layouts_has_no_thd(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--layouts", "sbhd", "--timed-layouts", "thd", "--tokens", "1004", "--cp", "1"])
    assert exc.value.code == 2
    assert "--tokens 1004 as --samples 8 does not split" in capsys.readouterr().err


@pytest.mark.parametrize("timeout_s", [40, 240])
def test_a_short_launch_limit_still_lets_the_workers_start_runs(bench, tmp_path, monkeypatch, timeout_s):
    # stop_at was now + timeout - 45: a limit of 45 s or less meant no run ever started
    seen = []

    def fake_launch(args, job, part, argv, timeout):
        seen.append((job["stop_at"] - bench.time.time(), timeout))
        return 0
    monkeypatch.setattr(bench, "_launch", fake_launch)
    tree = tmp_path / "tree" / "megatron" / "core" / "ssm"
    tree.mkdir(parents=True)
    (tree / "gated_delta_net.py").write_text("")
    bench.main(["--tree", str(tmp_path / "tree"), "--cp", "1", "--modes", "chunkwise",
                "--timeout-s", str(timeout_s), "--out", str(tmp_path / "o")])
    ((ahead, timeout),) = seen
    assert timeout == timeout_s and 0.5 * timeout_s < ahead <= timeout_s - min(45, timeout_s / 4) + 1


import subprocess as _subprocess

_POPEN = _subprocess.Popen  # the tests below patch subprocess.Popen; their stand-ins use this


class _Proc:
    """A stand-in for the torchrun Popen: its own session running ``sleep``; ``wait`` raises
    ``first`` once (KeyboardInterrupt: Ctrl-C on the driver)."""

    def __init__(self, first):
        self.real = _POPEN(["sleep", "60"], start_new_session=True)
        self.pid, self.first = self.real.pid, first

    def wait(self, timeout=None):
        if self.first == "sigterm":  # the driver's host ends it
            self.first = None
            import os
            import signal
            os.kill(os.getpid(), signal.SIGTERM)
            return self.real.wait(timeout)  # interrupted by the handler's SystemExit
        if self.first is not None:
            first, self.first = self.first, None
            raise first
        return self.real.wait(timeout)


def test_ctrl_c_on_the_driver_kills_the_launch_session(bench, tmp_path, monkeypatch):
    # the launch runs in a session of its own: Ctrl-C reaches only the driver, which must not
    # leave torchrun and its ranks running on the GPU
    procs = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: procs.append(_Proc(KeyboardInterrupt())) or procs[-1])
    args = bench.parse_args(["--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        bench._launch(args, {"name": "j", "tree": "patched", "world": 1}, str(tmp_path / "p.json"), [], 5.0)
    assert procs[0].real.wait(timeout=10) is not None


def test_sigterm_on_the_driver_kills_the_launch_session_and_exits_143(bench, tmp_path, monkeypatch):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    procs = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: procs.append(_Proc("sigterm")) or procs[-1])
    args = bench.parse_args(["--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        bench._launch(args, {"name": "j", "tree": "patched", "world": 1}, str(tmp_path / "p.json"), [], 30.0)
    assert exc.value.code == 143
    assert procs[0].real.poll() is not None  # ended, not left running
    assert signal.getsignal(signal.SIGTERM) is before  # the driver's handler only while a launch runs


def test_a_launch_that_exits_as_its_limit_passes_is_not_a_crash(bench, tmp_path, monkeypatch):
    import subprocess

    class Gone:  # exited (and reaped) between the wait's timeout and the kill
        def __init__(self):
            p = _POPEN(["true"], start_new_session=True)
            p.wait()
            self.pid, self.calls = p.pid, 0

        def wait(self, timeout=None):
            self.calls += 1
            if self.calls == 1:
                raise subprocess.TimeoutExpired("torchrun", timeout)
            return 0
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: Gone())
    args = bench.parse_args(["--out", str(tmp_path)])
    assert bench._launch(args, {"name": "j", "tree": "patched", "world": 1}, str(tmp_path / "p.json"), [], 1.0) == 124


@pytest.mark.parametrize("item", ["a.json=--5", "a.json=x", "a.json=", "b.json=1"])
def test_round_offset_rejects_a_bad_count_or_path_naming_it(report, tmp_path, item, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.json").write_text('{"runs": []}')
    with pytest.raises(SystemExit) as exc:
        report.main(["a.json", "--outdir", "o", "--round-offset", item])
    assert exc.value.code == 2 and f"--round-offset {item!r}" in capsys.readouterr().err


def test_round_offset_names_an_input_by_any_spelling_of_its_path(report, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = {"tree": "patched", "mode": "chunkwise", "cp": 1, "layout": "thd", "recompute": "off", "layers": 2,
           "tokens_per_s": 1.0, "timings_valid": True, "host_syncs": None}
    (tmp_path / "a.json").write_text('{"runs": [%s]}' % __import__("json").dumps(run))
    monkeypatch.setattr(report, "plot", lambda runs, path: None)
    seen = {}
    orig = report.load
    monkeypatch.setattr(report, "load", lambda j, l, o=None: seen.setdefault("runs", orig(j, l, o)))
    assert report.main(["a.json", "--outdir", "o", "--round-offset", "./a.json=2"]) in (0, None)
    assert [r["round"] for r in seen["runs"]] == [3]


def test_out_must_not_be_a_dangling_link(bench, tmp_path, capsys):
    (tmp_path / "o").symlink_to(tmp_path / "gone")
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path / "o")])
    assert "is a link to nothing" in capsys.readouterr().err


def test_plot_merges_identical_sync_curves_and_names_every_configuration(report):
    def run(tree, mode, cp, L, total, before=None, layout="thd", rc="off"):
        r = {"tree": tree, "mode": mode, "cp": cp, "layout": layout, "recompute": rc, "layers": L,
             "host_syncs": {"total": total}}
        if before is not None:
            r["host_syncs_before"] = {"total": before}
        return r
    runs = [run("patched", "chunkwise", 1, 2, 2, 2), run("patched", "chunkwise", 1, 8, 1, 8),
            run("patched", "headwise", 4, 2, 2), run("patched", "headwise", 4, 8, 1),
            run("patched", "all_gather", 2, 2, 1, rc="on"), run("patched", "all_gather", 2, 8, 1, rc="on"),
            run("base", "old_headwise", 2, 2, 71), run("base", "old_headwise", 2, 8, 274),
            run("patched", "chunkwise", 2, 2, 0, layout="sbhd"),  # one L only: no curve
            run("patched", "ideal", 1, 2, 2), run("patched", "ideal", 1, 8, 1)]  # ideal: not drawn
    series = report.sync_series(runs)
    assert [(s["ys"], s["before"], s["base"]) for s in series] == [
        ({2: 1, 8: 1}, False, False), ({2: 2, 8: 1}, False, False), ({2: 2, 8: 8}, True, False),
        ({2: 71, 8: 274}, False, True)]
    assert series[1]["label"] == "chunkwise/headwise, CP 1/4, thd, recompute off"
    assert series[2]["label"] == "chunkwise (before issue 24), CP 1, thd, recompute off"
    assert series[3]["label"] == "old image headwise, CP 2, thd, recompute off"
