"""bench/gdn_model.py's CPU-side logic: argument checks, job plan, sync attribution and summaries."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gdn_model", ROOT / "bench" / "gdn_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


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
    assert names == ["patched-cp1", "patched-cp2", "ideal-p2", "patched-cp4", "ideal-p4"]
    assert [j["timed"] for j in jobs] == [True, False, True, False, True]
    assert jobs[2]["tokens"] == 32768 // 2 and jobs[2]["world"] == 1 and jobs[2]["modes"] == ["ideal"]
    assert skipped == [{"mode": "old_headwise", "why": "no --fla041-site (FLA 0.4.1) given"}]
    jobs, skipped = bench.plan_jobs(bench.parse_args(["--fla041-site", "/x", "--cp", "1,2"]))
    assert [j["name"] for j in jobs] == ["patched-cp1", "base-cp1", "patched-cp2", "base-cp2", "ideal-p2"]
    assert not skipped and jobs[1]["modes"] == ["old_headwise"] and jobs[3]["world"] == 2


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
