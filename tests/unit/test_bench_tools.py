"""bench/report.py (ratios, RFC gates, the headwise split table) and bench/gdn_layer.py's
``--prepare-qkv`` rebinding, on synthetic inputs: no GPU, no Megatron tree."""

import functools
import importlib.util
import json
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(mode, T, ms, alloc, cp=2):
    return {"cp": cp, "mode": mode, "T": T, "median_ms": ms, "min_ms": ms, "p90_ms": ms,
            "tokens_per_s": T / (ms / 1e3), "peak_alloc_mib": alloc, "peak_reserved_mib": alloc}


def _write(path, runs):
    path.write_text(json.dumps({"meta": {}, "runs": runs, "skipped": [], "errors": []}))
    return str(path)


@pytest.fixture
def report():
    return _load("report")


def test_report_ratios_gates_and_later_file_wins(tmp_path, report):
    T = 32768
    first = _write(tmp_path / "a.json", [
        _run("chunkwise", T, 20.0, 900), _run("all_gather", T, 30.0, 1800),
        _run("headwise", T, 10.0, 900), _run("ideal", T, 15.0, 900)])
    # a later file's headwise run replaces the first one of the same (cp, mode, T)
    second = _write(tmp_path / "b.json", [_run("headwise", T, 19.5, 880)])
    s = report.main([first, second, "--outdir", str(tmp_path), "--no-plots"])
    row = next(r for r in s["rows"] if r["cp"] == 2 and r["T"] == T)
    assert row["chunkwise/all_gather throughput"] == 1.5
    assert row["chunkwise/all_gather peak_alloc"] == 0.5
    assert row["chunkwise/headwise throughput"] == round(19.5 / 20.0, 4)
    assert row["chunkwise efficiency vs ideal"] == 0.75
    assert row["gate chunkwise_vs_all_gather"] is True
    # throughput 0.975 passes, memory 900/880 = 1.0227 <= 1.05 passes
    assert row["gate chunkwise_vs_headwise"] is True
    assert "P=4 chunkwise T=32768" in s["not_measured"]
    assert not (tmp_path / "gdn_layer_time.png").exists()  # --no-plots
    md = (tmp_path / "gdn_layer_summary.md").read_text()
    assert "| 2 | 32K | 1.5000 | 0.5000 |" in md
    assert "Headwise split" not in md  # no split runs given


def test_report_headwise_gate_fails_on_throughput(tmp_path, report):
    T = 8192
    f = _write(tmp_path / "a.json", [_run("chunkwise", T, 10.6, 100), _run("headwise", T, 10.0, 100)])
    row = next(r for r in report.main([f, "--outdir", str(tmp_path), "--no-plots"])["rows"]
               if r["cp"] == 2 and r["T"] == T)
    assert row["chunkwise/headwise throughput"] == round(10.0 / 10.6, 4)  # 0.9434 < 0.95
    assert row["gate chunkwise_vs_headwise"] is False


def test_report_split_table_orders_old_upgrade_patch_compiled(tmp_path, report):
    T = 131072
    f = _write(tmp_path / "s.json", [
        _run("old_headwise", T, 80.0, 100), _run("base_fla042", T, 84.0, 100),
        _run("headwise", T, 88.2, 100), _run("headwise_qkv_compiled", T, 84.0, 100)])
    row = next(r for r in report.main([f, "--outdir", str(tmp_path), "--no-plots"])["rows"]
               if r["cp"] == 2 and r["T"] == T)
    assert row["base_fla042/old_headwise time"] == 1.05
    assert row["headwise/base_fla042 time"] == 1.05
    assert row["headwise_qkv_compiled/headwise time"] == round(84.0 / 88.2, 4)
    md = (tmp_path / "gdn_layer_summary.md").read_text()
    assert "| 2 | 128K | 80.00 | 84.00 | 88.20 | 84.00 | 1.1025 | 1.0500 | 1.0500 | 0.9524 |" in md


def test_report_split_table_needs_a_split_run_and_names_unknown_labels(tmp_path, report, capsys):
    T = 65536
    f = _write(tmp_path / "s.json", [
        _run("old_headwise", T, 80.0, 100), _run("headwise", T, 88.0, 100),
        _run("headwise_eager_v2", T, 85.0, 100), {**_run("chunkwise", T, 90.0, 100), "peak_alloc_mib": None}])
    s = report.main([f, "--outdir", str(tmp_path), "--no-plots"])
    row = next(r for r in s["rows"] if r["cp"] == 2 and r["T"] == T)
    assert row["headwise/old_headwise time"] == 1.1
    assert row["chunkwise/headwise peak_alloc"] is None  # a missing figure is n/a, not a crash
    assert "Headwise split" not in (tmp_path / "gdn_layer_summary.md").read_text()
    assert s["not_reported_modes"] == ["headwise_eager_v2"]
    assert "headwise_eager_v2" in capsys.readouterr().err


def test_report_plots_one_line_per_mode(tmp_path, report, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install -e '.[bench]')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = []
    monkeypatch.setattr(plt, "close", lambda fig: labels.append(
        [ln.get_label() for ax in fig.axes for ln in ax.get_lines()]))
    T = 131072
    f = _write(tmp_path / "s.json", [_run(m, T, 80.0, 100) for m in report.PLOTTED])
    report.main([f, "--outdir", str(tmp_path)])
    assert (tmp_path / "gdn_layer_time.png").exists() and (tmp_path / "gdn_layer_memory.png").exists()
    assert labels and all(sorted(ls) == sorted(report.PLOTTED) for ls in labels)


@pytest.fixture
def fake_gdn(monkeypatch):
    """A stand-in ``megatron.core.ssm.gated_delta_net`` whose method is decorated like the
    patched tree's (a functools.wraps wrapper, as ``torch.compiler.disable`` makes)."""
    calls = []

    def raw(self, x):
        return x + 1

    def decorator(tag):  # a functools.wraps wrapper that records its calls
        def decorate(fn):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                calls.append(tag)
                return fn(*a, **k)
            return wrapper
        return decorate

    cls = type("GatedDeltaNet", (), {"_prepare_qkv_for_gated_delta_rule": decorator("decorated")(raw)})
    gdn = types.ModuleType("megatron.core.ssm.gated_delta_net")
    gdn.GatedDeltaNet = cls
    jit = types.ModuleType("megatron.core.jit")
    jit.jit_fuser = decorator("jit_fuser")
    for name in ("megatron", "megatron.core", "megatron.core.ssm"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.ssm.gated_delta_net", gdn)
    monkeypatch.setitem(sys.modules, "megatron.core.jit", jit)
    return cls, raw, calls


@pytest.mark.parametrize("policy, expected_calls", [
    ("tree", ["decorated"]), ("eager", []), ("jit_fuser", ["jit_fuser"])])
def test_prepare_qkv_policy_rebinds_the_method(fake_gdn, policy, expected_calls):
    cls, raw, calls = fake_gdn
    _load("gdn_layer").set_prepare_qkv(policy)
    assert cls()._prepare_qkv_for_gated_delta_rule(1) == 2
    assert calls == expected_calls


def test_prepare_qkv_policy_refuses_an_undecorated_method(fake_gdn):
    cls, raw, _ = fake_gdn
    cls._prepare_qkv_for_gated_delta_rule = raw
    with pytest.raises(ValueError, match="use --prepare-qkv tree"):
        _load("gdn_layer").set_prepare_qkv("eager")


@pytest.mark.parametrize("argv, message", [
    (["--modes", "headwise,ideal", "--label", "old_headwise"], "no ideal"),
    (["--modes", "headwise,chunkwise", "--label", "x"], "exactly one mode"),
    (["--modes", "headwise", "--prepare-qkv", "jit_fuser"], "add --label"),
])
def test_bench_refuses_runs_that_would_replace_others(argv, message):
    bench = _load("gdn_layer")
    with pytest.raises(SystemExit, match=message):
        bench.check_label(bench.parse_args(argv))


def test_bench_accepts_a_labelled_policy_run():
    bench = _load("gdn_layer")
    bench.check_label(bench.parse_args(["--modes", "headwise", "--prepare-qkv", "jit_fuser",
                                        "--label", "headwise_qkv_compiled"]))


@pytest.mark.parametrize("T, P, samples, ok", [
    (65536, 4, 1, True), (65536, 4, 8, True), (65536, 4, 3, False), (64, 4, 16, False), (64, 2, 16, True)])
def test_bench_thd_samples_must_split_into_zigzag_chunks(T, P, samples, ok):
    bench = _load("gdn_layer")
    if ok:
        bench.check_samples(T, P, samples)
    else:
        with pytest.raises(ValueError, match="divides by 2\\*CP"):
            bench.check_samples(T, P, samples)


def test_report_refuses_to_mix_sbhd_and_thd(tmp_path, report):
    T = 32768
    sbhd = _write(tmp_path / "sbhd.json", [_run("chunkwise", T, 20.0, 900)])  # no "samples": SBHD
    thd = _write(tmp_path / "thd.json", [{**_run("headwise", T, 19.0, 900), "samples": 8}])
    with pytest.raises(SystemExit, match="mix layouts"):
        report.main([sbhd, thd, "--outdir", str(tmp_path), "--no-plots"])
    assert report.main([thd, "--outdir", str(tmp_path), "--no-plots"])["samples"] == 8


def test_host_sync_count_counts_sync_warnings_and_restores_the_mode():
    import warnings

    bench = _load("gdn_layer")
    modes = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        synchronize=lambda: None, set_sync_debug_mode=modes.append))

    def step():
        for _ in range(3):  # what torch emits per synchronizing call in "warn" mode
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("an unrelated warning", UserWarning)

    assert bench.count_host_syncs(fake, step) == 3
    assert modes == ["warn", "default"]

    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        bench.count_host_syncs(fake, failing)
    assert modes[-1] == "default"


@pytest.mark.parametrize("argv, message", [
    (["--policies", "tree,nosuch"], "--policies: unknown name 'nosuch'; pick from tree, eager"),
    (["--policies", ","], "--policies: empty"),
    (["--parts", "layer,nosuch"], "--parts: unknown name 'nosuch'; pick from scenarios, helper, layer"),
    (["--seq", "abc"], "--seq 'abc': give positive token counts"),
    (["--seq", "0"], "--seq '0': give positive token counts"),
    (["--seq", "-5"], "--seq '-5'"),
    (["--rounds", "0"], "--rounds 0: must be at least 1"),
])
def test_prepare_qkv_bench_refuses_bad_arguments_before_any_work(argv, message, capsys):
    # hostile19: these ran torch/dist setup first, then died in a traceback deep inside a part
    # (unknown policy, unknown part) or int() (bad --seq), and still exited 0
    with pytest.raises(SystemExit) as exc:
        _load("prepare_qkv").parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_prepare_qkv_bench_accepts_its_documented_arguments():
    args = _load("prepare_qkv").parse_args(["--parts", "layer", "--policies", "tree,eager", "--seq", "65536"])
    assert (args.parts, args.policies, args.seq) == ("layer", "tree,eager", "65536")
