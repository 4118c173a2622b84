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
    # registered first, as importlib's recipe does: dataclasses (profile_attr.Event, with postponed
    # annotations) look their module up in sys.modules while the class is being made
    sys.modules[spec.name] = mod
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
    text = (tmp_path / "gdn_layer_summary.md").read_text()
    assert "Headwise split" not in text
    # every merged run is listed with its figures, a missing one as n/a, and the inputs in order
    assert "| 2 | chunkwise | 64K | 90.00 | 90.00 | 90.00 | n/a | n/a |" in text
    assert "Inputs, in merge order" in text and f"`{f}`" in text
    assert text.count("Runs (median") == 1 and text.count("Inputs, in merge order") == 1
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
def test_bench_refuses_runs_that_would_replace_others(argv, message, capsys):
    assert message in _bench_refusal(argv, capsys)


def _bench_refusal(argv, capsys):
    """check_label's refusal: exit status 2 and one stderr line (returned)."""
    bench = _load("gdn_layer")
    with pytest.raises(SystemExit) as exc:
        bench.check_label(bench.parse_args(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2, (argv, exc.value.code, err)
    assert err.startswith("gdn_layer.py: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--seq", "abc"], "--seq 'abc': give positive token counts"),
    (["--seq", "512,-8"], "--seq '512,-8': give positive token counts"),
    (["--seq", "0"], "--seq '0'"),
    (["--seq", ","], "--seq ','"),
    (["--cp", "abc"], "--cp 'abc': give positive CP sizes"),
    (["--cp", "0"], "--cp '0'"),
    (["--cp", "2,-2"], "--cp '2,-2'"),
    (["--modes", ","], "--modes is empty"),
    (["--modes", "headwise,headwise"], "--modes names headwise twice"),
    (["--repeats", "0"], "--repeats 0: must be at least 1"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--samples", "0"], "--samples 0: must be at least 1"),
    (["--hidden", "0"], "--hidden 0: must be at least 1"),
    (["--head-dim", "-1"], "--head-dim -1: must be at least 1"),
    (["--conv-kernel", "0"], "--conv-kernel 0: must be at least 1"),
    (["--out", "/"], "--out / is a directory"),
])
def test_bench_refuses_bad_arguments_with_exit_2_before_any_work(argv, message, capsys):
    # hostile20: these passed check_label and died later (int() traceback, ZeroDivisionError on
    # --cp 0, statistics on --repeats 0, IsADirectoryError after the first timed configuration),
    # and check_label's own refusals exited 1 (SystemExit with a message), not 2
    assert message in _bench_refusal(argv, capsys)


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


def test_report_refuses_to_mix_sbhd_and_thd(tmp_path, report, capsys):
    T = 32768
    sbhd = _write(tmp_path / "sbhd.json", [_run("chunkwise", T, 20.0, 900)])  # no "samples": SBHD
    thd = _write(tmp_path / "thd.json", [{**_run("headwise", T, 19.0, 900), "samples": 8}])
    with pytest.raises(SystemExit) as exc:
        report.main([sbhd, thd, "--outdir", str(tmp_path), "--no-plots"])
    assert exc.value.code == 2 and "mix layouts" in capsys.readouterr().err
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


# ---- bench/profile_attr.py: attribution of one profiled step, on synthetic Kineto events -----

MS = 1_000_000  # Kineto times are ns


@pytest.fixture
def attr():
    return _load("profile_attr")


def _ev(attr, name, kind, start_ms, end_ms, **k):
    return attr.Event(name=name, kind=kind, start=int(round(start_ms * MS)), end=int(round(end_ms * MS)), **k)


def _phases(attr, fwd=(0.0, 10.0), bwd=(20.0, 30.0)):
    return [_ev(attr, "gdn::forward", "user_annotation", *fwd), _ev(attr, "gdn::backward", "user_annotation", *bwd)]


def test_profile_wall_is_busy_plus_idle_and_busy_is_the_union(attr):
    ev = _phases(attr) + [
        _ev(attr, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "kernel", 1.0, 3.0),
        # NCCL on its own stream, overlapping the gemm by 1 ms: counted once in busy
        _ev(attr, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", 2.0, 4.0),
        # the forward's GPU tail runs past the host range: wall ends at the GPU's end (12 ms)
        _ev(attr, "chunk_gated_delta_rule_fwd_kernel_h", "kernel", 9.0, 12.0),
        _ev(attr, "chunk_gated_delta_rule_bwd_kernel_dhu", "kernel", 21.0, 25.0),
    ]
    a = attr.attribute(ev)
    fwd, bwd = a["phases"]["forward"], a["phases"]["backward"]
    assert fwd["wall_ms"] == pytest.approx(12.0) and fwd["busy_ms"] == pytest.approx(6.0)
    assert fwd["idle_ms"] == pytest.approx(6.0) and fwd["kernel_ms"] == pytest.approx(7.0)
    assert bwd["wall_ms"] == pytest.approx(10.0)  # host range 20..30 ms outlasts the kernel
    assert (bwd["busy_ms"], bwd["idle_ms"]) == (pytest.approx(4.0), pytest.approx(6.0))
    for p in (fwd, bwd, a["total"]):
        assert p["wall_ms"] == pytest.approx(p["busy_ms"] + p["idle_ms"], abs=1e-4)
    assert a["total"]["busy_ms"] == pytest.approx(10.0)
    assert a["overlap_ms"] == pytest.approx(1.0)  # kernel ms 11 - busy 10


@pytest.mark.parametrize("name, cat", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all-to-all (SendRecv)"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-gather (FLA CP exchange)"),
    ("triton_poi_fused__to_copy_add_mul_sigmoid_0", "fused elementwise (torch.compile)"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "gemm (in_proj, out_proj)"),
    ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_warpspecialized", "gemm (in_proj, out_proj)"),
    ("causal_conv1d_fwd_kernel", "causal_conv1d (incl. CP halo)"),
    ("l2norm_fwd_kernel", "norms (l2norm, RMSNorm)"),
    ("chunk_gated_delta_rule_fwd_kernel_h", "gated delta rule scan (incl. CP state merge)"),
    ("my_mystery_kernel", "other"),
])
def test_profile_kernel_categories(attr, name, cat):
    assert attr.category(name) == cat


def _scoped_step(attr):
    """A forward with two ``gdn::`` scopes (one holding two nested ones) and a backward node; the
    kernels are launched 1) through an ATen op (``linked``), 2) through a CUDA runtime call
    (``corr``), 3) from nowhere the profiler saw. Returns (events, expected kernel ms by scope)."""
    ev = _phases(attr) + [
        _ev(attr, "gdn::zigzag_to_contiguous_chunks", "user_annotation", 1.0, 3.0, corr=101),
        _ev(attr, "aten::index_select", "cpu_op", 1.2, 1.5, corr=102),
        _ev(attr, "indexSelectLargeIndex", "kernel", 4.0, 5.0, corr=9001, linked=102),
        # gated_delta_rule holds build_cp_context (same start) and l2norm (strictly inside)
        _ev(attr, "gdn::gated_delta_rule", "user_annotation", 5.0, 9.0, corr=110),
        _ev(attr, "gdn::build_cp_context", "user_annotation", 5.0, 6.0, corr=111),
        _ev(attr, "aten::cumsum", "cpu_op", 5.0, 5.2, corr=112),
        _ev(attr, "gdn::l2norm", "user_annotation", 7.0, 8.0, corr=113),
        _ev(attr, "aten::empty", "cpu_op", 7.1, 7.2, corr=114),
        _ev(attr, "aten::add", "cpu_op", 6.5, 6.6, corr=115),
        _ev(attr, "cumsum_kernel", "kernel", 6.0, 6.5, corr=9002, linked=112),
        _ev(attr, "l2norm_fwd_kernel", "kernel", 8.0, 8.25, corr=9003, linked=114),
        _ev(attr, "vectorized_elementwise_kernel", "kernel", 8.5, 8.75, corr=9004, linked=115),
        # backward: launched by a runtime call inside an autograd node, no ATen link
        _ev(attr, "autograd::engine::evaluate_function: FooBackward", "cpu_op", 21.0, 24.0, corr=201),
        _ev(attr, "cudaLaunchKernel", "cuda_runtime", 21.5, 21.6, corr=9100),
        _ev(attr, "chunk_gated_delta_rule_bwd_kernel_dhu", "kernel", 22.0, 23.0, corr=9100),
        # no launch event for this one (the profiler dropped it)
        _ev(attr, "my_mystery_kernel", "kernel", 25.0, 26.0, corr=9999),
    ]
    return ev, {"zigzag_to_contiguous_chunks": 1.0, "build_cp_context": 0.5, "l2norm": 0.25,
                "gated_delta_rule": 0.25, "FooBackward (backward)": 1.0, "unattributed": 1.0}


def test_profile_scopes_follow_the_launch_and_the_innermost_range_wins(attr):
    ev, expected = _scoped_step(attr)
    a = attr.attribute(ev)
    assert a["scope_ms"] == pytest.approx(expected)
    assert a["scope_ms"]["build_cp_context"] == pytest.approx(0.5)  # not its outer gated_delta_rule
    assert a["scope_coverage"] == pytest.approx(3.0 / 4.0)  # 1 ms of 4 ms has no launch
    assert a["scope_coverage"] < 1
    # host ranges: the user annotations' own host time, phases excluded
    assert a["host_ranges_ms"]["build_cp_context"] == pytest.approx(1.0)
    assert "forward" not in a["host_ranges_ms"]


def test_profile_counts_host_syncs_inside_phases_by_scope(attr):
    ev, _ = _scoped_step(attr)
    ev += [
        _ev(attr, "cudaStreamSynchronize", "cuda_runtime", 1.3, 1.4, corr=9200),  # in zigzag scope
        _ev(attr, "cudaStreamSynchronize", "cuda_runtime", 23.0, 23.5, corr=9201),  # in FooBackward
        # outside both phases: before the forward, between the phases (the GPU is idle)
        _ev(attr, "cudaStreamSynchronize", "cuda_runtime", -2.0, -1.0, corr=9202),
        _ev(attr, "cudaStreamSynchronize", "cuda_runtime", 15.0, 15.1, corr=9203),
        # the bench's own torch.cuda.synchronize() right after the forward's host range, while
        # the forward's last kernel still runs: the bench's, not the layer's
        _ev(attr, "cudaDeviceSynchronize", "cuda_runtime", 10.0, 12.0, corr=9204),
        _ev(attr, "tail_kernel", "kernel", 9.0, 12.0, corr=9205),
        _ev(attr, "cudaLaunchKernel", "cuda_runtime", 2.0, 2.1, corr=9206),  # not a sync call
    ]
    a = attr.attribute(ev)
    assert a["phases"]["forward"]["host_syncs"] == 1
    assert a["phases"]["forward"]["host_sync_ms"] == pytest.approx(0.1)
    assert a["phases"]["backward"]["host_syncs"] == 1
    assert a["phases"]["backward"]["host_sync_ms"] == pytest.approx(0.5)
    assert a["total"]["host_syncs"] == 2
    assert a["host_syncs_by_scope"] == {"FooBackward (backward)": 1, "zigzag_to_contiguous_chunks": 1}


def test_profile_refuses_events_without_the_backward_range(attr):
    ev = [e for e in _phases(attr) if e.name != "gdn::backward"]
    with pytest.raises(ValueError, match="gdn::backward"):
        attr.attribute(ev + [_ev(attr, "l2norm_fwd_kernel", "kernel", 1.0, 2.0)])


def test_bench_checks_modes_and_profile_length(capsys):
    bench = _load("gdn_layer")
    assert ("unknown mode(s) nosuch in --modes; pick from headwise, all_gather, chunkwise, "
            "chunkwise_upstream_layout, ideal") in _bench_refusal(["--modes", "headwise,nosuch"], capsys)
    assert "--profile 1234 profiles a length of --seq" in _bench_refusal(
        ["--modes", "chunkwise", "--seq", "32768", "--profile", "1234"], capsys)
    bench.check_label(bench.parse_args(["--modes", "chunkwise,chunkwise_upstream_layout", "--seq", "32768",
                                        "--profile", "32768"]))


def test_upstream_layout_sp_size_is_one_except_for_equality():
    sp = _load("gdn_layer")._UpstreamLayoutSP(1)
    assert not (sp == 1) and sp != 1
    assert 5 * sp == 5 and sp * 4096 == 4096
    assert hash(sp) == hash(1)


def _rank_profile(rank, wall, busy, syncs, cats, overlap, scopes, ranges):
    half = lambda v: round(v / 2, 4)  # noqa: E731
    phase = {"wall_ms": half(wall), "busy_ms": half(busy), "idle_ms": half(wall - busy),
             "host_syncs": syncs, "host_sync_ms": 0.1 * syncs, "kernel_ms": half(busy + overlap)}
    return {"rank": rank, "phases": {"forward": phase, "backward": phase},
            "total": {"wall_ms": wall, "busy_ms": busy, "idle_ms": round(wall - busy, 4),
                      "host_syncs": 2 * syncs, "host_sync_ms": 0.2 * syncs, "kernel_ms": busy + overlap},
            "category_ms": cats, "overlap_ms": overlap, "scope_ms": scopes, "scope_coverage": 0.98,
            "host_syncs_by_scope": {}, "host_ranges_ms": ranges}


def test_report_profile_table_has_the_rows_and_the_difference(tmp_path, report):
    T, a2a, gemm = 32768, "all-to-all (SendRecv)", "gemm (in_proj, out_proj)"
    hw = [_rank_profile(r, 20.0, 18.0, 0, {a2a: 3.0, gemm: 8.0}, 1.0, {"in_proj": 4.0}, {"in_proj": 0.2})
          for r in (0, 1)]
    # chunkwise: rank 1's wall is 10% above rank 0's (shown in brackets), rank 0's within 5% otherwise
    cw = [_rank_profile(r, 16.5 if r else 15.0, 14.0, 1, {a2a: 1.5, gemm: 8.0}, 0.5,
                        {"in_proj": 4.0, "zigzag_to_contiguous_chunks": 0.7},
                        {"build_cp_context": 0.35, "zigzag_to_contiguous_chunks": 0.1,
                         "contiguous_to_zigzag_chunks": 0.05}) for r in (0, 1)]
    doc = {"meta": {}, "runs": [_run("headwise", T, 21.0, 900), _run("chunkwise", T, 16.0, 900)], "errors": [],
           "profiles": [{"cp": 2, "mode": "headwise", "T": T, "samples": 1, "median_ms": 21.0, "ranks": hw},
                        {"cp": 2, "mode": "chunkwise", "T": T, "samples": 1, "median_ms": 16.0, "ranks": cw}]}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    s = report.main([str(f), "--outdir", str(tmp_path), "--no-plots"])
    md = (tmp_path / "gdn_layer_profile.md").read_text()
    assert "## CP=2, T=32K, SBHD b=1 (2 ranks)" in md
    assert "| row | headwise | chunkwise | chunkwise - headwise |" in md
    assert "| CUDA-event median ms (timed runs) | 21.000 | 16.000 | -5.000 |" in md
    assert "| profiled step wall ms | 20.000 | 15.000 [max 16.500] | -5.000 |" in md
    assert "| of which GPU busy | 18.000 | 14.000 | -4.000 |" in md
    assert "| GPU idle (host-bound) | 2.000 | 1.000 [max 2.500] | -1.000 |" in md
    assert "| all-to-all (SendRecv) | 3.000 | 1.500 | -1.500 |" in md
    assert "| gemm (in_proj, out_proj) | 8.000 | 8.000 | +0.000 |" in md
    assert "| minus overlap of streams | 1.000 | 0.500 | -0.500 |" in md
    assert "| host syncs (count) | 0 | 2 | +2 |" in md
    assert "| host ms build_cp_context | n/a | 0.350 | n/a |" in md
    assert "| host ms layout conversion | n/a | 0.150 | n/a |" in md
    assert "| scope coverage | 98.0% | 98.0% |  |" in md
    assert "| 2 |  | zigzag_to_contiguous_chunks 0.700 |" in md
    assert "- **GPU idle (host-bound)**:" in md  # each row's meaning is written out
    table = s["profiles"][0]
    assert (table["cp"], table["T"], table["modes"]) == (2, T, ["headwise", "chunkwise"])
    assert json.loads((tmp_path / "gdn_layer_summary.json").read_text())["profiles"] == s["profiles"]
    assert s["profile_chunkwise"] == []  # the old key is still summarised (empty here)


def test_report_profile_table_without_headwise_has_no_difference(tmp_path, report):
    T = 16384
    pr = _rank_profile(0, 10.0, 9.0, 0, {"other": 9.0}, 0.0, {"unattributed": 9.0}, {})
    doc = {"meta": {}, "runs": [], "errors": [], "profiles": [
        {"cp": 2, "mode": m, "T": T, "samples": 4, "median_ms": 11.0, "ranks": [pr]}
        for m in ("chunkwise_upstream_layout", "chunkwise")]}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    report.main([str(f), "--outdir", str(tmp_path), "--no-plots"])
    md = (tmp_path / "gdn_layer_profile.md").read_text()
    assert "| row | chunkwise | chunkwise_upstream_layout |" in md and "chunkwise - headwise |" not in md
    assert "THD 4 samples" in md


def test_report_profile_with_an_unattributed_or_missing_rank_reports_it(tmp_path, report):
    # hostile20: bench/gdn_layer.py stores {"error": ..., "total": {}} for a rank whose step could
    # not be attributed (and a world may lose a rank's record); report.py died with KeyError
    # 'category_ms' (or IndexError on an empty rank list) instead of writing the tables
    T, gemm = 32768, "gemm (in_proj, out_proj)"
    good = _rank_profile(0, 20.0, 18.0, 0, {gemm: 8.0}, 1.0, {"in_proj": 4.0}, {})
    doc = {"meta": {}, "runs": [_run("headwise", T, 21.0, 900), _run("chunkwise", T, 16.0, 900)], "errors": [],
           "profiles": [
               {"cp": 2, "mode": "headwise", "T": T, "samples": 1, "median_ms": 21.0,
                "ranks": [dict(good), {"rank": 1, "error": "no gdn::backward range among 3 events", "total": {}}]},
               {"cp": 2, "mode": "chunkwise", "T": T, "samples": 1, "median_ms": 16.0,
                "ranks": [{"rank": 0, "error": "boom", "total": {}}, dict(good, rank=1)]},
               {"cp": 2, "mode": "chunkwise_upstream_layout", "T": T, "samples": 1, "median_ms": 17.0,
                "ranks": []}]}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    s = report.main([str(f), "--outdir", str(tmp_path), "--no-plots"])
    md = (tmp_path / "gdn_layer_profile.md").read_text()
    assert "| profiled step wall ms | 20.000 | n/a [max 20.000] | n/a |" in md
    assert "| gemm (in_proj, out_proj) | 8.000 | n/a [max 8.000] | n/a |" in md
    assert "not attributed: headwise rank 1 (no gdn::backward range among 3 events); chunkwise rank 0 " \
           "(boom); chunkwise_upstream_layout: no rank recorded" in md
    assert s["profiles"][0]["not_attributed"] == {
        "headwise": ["rank 1 (no gdn::backward range among 3 events)"], "chunkwise": ["rank 0 (boom)"],
        "chunkwise_upstream_layout": ["no rank recorded"]}


@pytest.mark.parametrize("text, message", [
    ("", "is not JSON"), ("{\"runs\": [", "is not JSON"), ("[1, 2]", "is not a bench/gdn_layer.py result"),
    ("{\"runs\": {}}", "is not a bench/gdn_layer.py result"), (None, "cannot read")])
def test_report_refuses_unreadable_inputs_with_exit_2(tmp_path, report, capsys, text, message):
    # hostile20: an empty, truncated or foreign input file ended in a JSON traceback (exit 1)
    f = tmp_path / "in.json"
    if text is not None:
        f.write_text(text)
    with pytest.raises(SystemExit) as exc:
        report.main([str(f), "--outdir", str(tmp_path), "--no-plots"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "gdn_layer_summary.json").exists()


@pytest.mark.parametrize("trace", [
    [], None, {"traceEvents": None}, {"traceEvents": {}},
    {"traceEvents": [{"ph": "X", "ts": None, "dur": 1.0, "cat": "kernel", "name": "k"}]},
    {"traceEvents": [{"ph": "X", "ts": "inf", "dur": 1.0, "cat": "kernel", "name": "k"}]},
    {"traceEvents": [{"ph": "X", "ts": 1.0, "dur": [], "cat": "kernel", "name": "k"}]},
    {"traceEvents": [{"ph": "X", "ts": 1.0, "dur": 1.0, "cat": "kernel", "name": "k", "args": [1]}]},
    {"traceEvents": [{"ph": "X", "ts": 1.0, "dur": 1.0, "cat": "kernel", "name": "k",
                      "args": {"External id": "x1"}}]},
    {"traceEvents": ["not an event"]},
])
def test_profile_trace_parser_raises_value_error_on_malformed_traces(attr, trace):
    # hostile20: a list, null or mistyped field raised AttributeError/TypeError/OverflowError;
    # bench/gdn_layer.py catches ValueError only there, so one rank would leave the profile's
    # all_gather_object and the other ranks would wait for it
    with pytest.raises(ValueError, match="Chrome trace"):
        attr.events_from_chrome_trace(trace)


@pytest.mark.parametrize("script, holds", [("thd_route", "gdn_context_parallel.py"),
                                           ("wire_bytes", "gated_delta_net.py"),
                                           ("carry_scaling", "gated_delta_net.py")])
def test_cpu_benchmarks_refuse_a_tree_without_megatron_saying_how_to_build_it(tmp_path, capsys, script, holds):
    # hostile20 (thd_route) and the 2026-12-03 README trial (wire_bytes): --tree without the
    # module died in an import traceback (exit 1), or timed whichever megatron PYTHONPATH held
    with pytest.raises(SystemExit) as exc:
        _load(script).main(["--tree", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"holds no megatron/core/ssm/{holds}" in err, err
    assert "make patch" in err or "tools/backport" in err, err  # SystemExit, not an ImportError: no traceback
