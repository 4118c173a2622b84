"""Image engine logic without Docker: context staging, labels, preflight, report parsing,
build-stream tracking and error mapping, the lock helpers, the patch/capability scripts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from backport.errors import PipelineError
from backport.tree_digest import lock_fields
from image_pipeline import cli as image_cli
from image_pipeline.build import (FLA_PIN, TREE_DIGEST_SCRIPT, BuildTracker, build_args, classify_build_error, expected_labels,
                         host_ca_bundle, image_tags, one_line_change, rebuilt_layers, stage_context)
from image_pipeline.engine import (DiskPeak, check_disk, docker_client, docker_storage, ensure_base_image, min_free_gib,
                          pull_image)
from image_pipeline.errors import (BaseImageMissing, BuildStepFailed, DiskSpaceError, DockerUnavailable, GateFailed,
                          ImageError, InputError)
from image_pipeline.gate import gate_verdict, parse_junit, require_gate_ok, write_json
from image_pipeline.inputs import (CPU_BASE_IMAGE, CPU_TORCH_WHEEL, FLAVOURS, Inputs, preflight, read_tree_lock,
                          torch_lock_hashes, tree_digest)
from image_pipeline.lock import LockEntry, parse_lock, parse_report, render_lock

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
sys.path.insert(0, str(DOCKER))
import capability_check  # noqa: E402

BASE_PY = "def f():\n    # one\n    return 1\n"
# Synthetic fixture patch (no upstream code), kept under tests/data/.
GOOD_PATCH = (Path(__file__).resolve().parents[1] / "data" / "image" / "good.patch").read_text()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def inputs(tmp_path) -> Inputs:
    """A small but complete set of build inputs in tmp_path."""
    tree = tmp_path / "tree"
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "megatron" / "core" / "mod.py").write_text(BASE_PY)
    (tree / "megatron" / "core" / "__pycache__").mkdir()
    (tree / "megatron" / "core" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"x")
    patch = tmp_path / "megatron.patch"
    patch.write_text(GOOD_PATCH)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({
        "pins": {"megatron_bridge": "b" * 40, "mcore_base": "c" * 40, "upstream": "d" * 40},
        "patch": {"name": "20260101-ccccccccc.patch", "sha256": _sha(patch.read_bytes())}}))
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_x.py").write_text("def test_x():\n    pass\n")
    (tests / ".pytest_cache").mkdir()
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    torch_lock = tmp_path / "torch-cpu.lock"
    torch_lock.write_text(f"torch @ file:///opt/gdn/deps/wheels/{wheel.name} \\\n"
                          f"    --hash=sha256:{_sha(wheel.read_bytes())}\n")
    tree_lock = tmp_path / "lock.json"
    tree_lock.write_text(json.dumps(lock_fields(tree, patch.read_bytes())))
    return Inputs(tree=tree, patch=patch, manifest=manifest, tests=tests,
                      torch_lock=torch_lock, torch_wheel=wheel, tree_lock=tree_lock)


# --------------------------------------------------------------------------- preflight / labels

def test_preflight_reads_digests_and_pins(inputs):
    pre = preflight(inputs, FLAVOURS["cpu"])
    assert pre.patch_sha256 == _sha(inputs.patch.read_bytes())
    assert pre.manifest_sha256 == _sha(inputs.manifest.read_bytes())
    assert pre.lock_sha256 == _sha(inputs.lock.read_bytes())
    assert pre.patch_name == "20260101-ccccccccc.patch"
    assert pre.pins["upstream"] == "d" * 40
    assert pre.hunks == 2
    assert pre.lock_pins["flash-linear-attention"] == FLA_PIN


def test_tree_digest_ignores_caches_and_sees_content(inputs):
    root = inputs.tree / "megatron"
    before = tree_digest(inputs.tree)
    (root / "core" / "__pycache__" / "other.pyc").write_bytes(b"y")
    assert tree_digest(inputs.tree) == before
    (root / "core" / "mod.py").write_text(BASE_PY + "# x\n")
    assert tree_digest(inputs.tree) != before


@pytest.mark.parametrize("breakage, words", [
    ("no_tree", "build inputs missing"),
    ("no_patch", "build inputs missing"),
    ("manifest_mismatch", "is not the patch"),
    ("manifest_not_json", "is not JSON"),
    ("wrong_wheel", "not the one in"),
    ("no_wheel", "wheel not found"),
])
def test_preflight_refuses_bad_inputs(inputs, breakage, words):
    if breakage == "no_tree":
        shutil.rmtree(inputs.tree / "megatron")
    elif breakage == "no_patch":
        inputs.patch.unlink()
    elif breakage == "manifest_mismatch":
        inputs.patch.write_text(GOOD_PATCH + "\n")
    elif breakage == "manifest_not_json":
        inputs.manifest.write_text("{")
    elif breakage == "wrong_wheel":
        inputs.torch_wheel.write_bytes(b"another build")
    elif breakage == "no_wheel":
        inputs.torch_wheel.unlink()
    with pytest.raises(InputError, match=words) as info:
        preflight(inputs, FLAVOURS["cpu"])
    assert info.value.exit_code == 13 and info.value.hint


def test_cuda_preflight_needs_no_wheel(inputs):
    inputs.torch_wheel.unlink()
    assert preflight(inputs, FLAVOURS["cuda"]).hunks == 2


def test_build_args_fill_every_label(inputs):
    pre = preflight(inputs, FLAVOURS["cpu"])
    args = build_args(FLAVOURS["cpu"], pre)
    assert args["BASE_IMAGE"] == CPU_BASE_IMAGE and args["TORCH_FROM"] == "wheel"
    labels = expected_labels(args)
    assert labels["io.gdn.patch.sha256"] == pre.patch_sha256
    assert labels["io.gdn.manifest.sha256"] == pre.manifest_sha256
    assert labels["io.gdn.pin.flash-linear-attention"] == "0.4.2"
    assert labels["io.gdn.pin.fla-core"] == "0.4.2"
    assert labels["io.gdn.pin.triton"] == "3.6.0"
    assert labels["io.gdn.pin.mcore-base"] == "c" * 40
    assert all(v for v in labels.values())
    cuda = build_args(FLAVOURS["cuda"], pre)
    assert cuda["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:") and cuda["TORCH_FROM"] == "base"
    assert build_args(FLAVOURS["cuda"], pre, "my/base:1")["BASE_IMAGE"] == "my/base:1"


def test_every_label_and_build_arg_is_in_the_dockerfile(inputs):
    text = (REPO / "Dockerfile").read_text()
    pre = preflight(inputs, FLAVOURS["cpu"])
    args = build_args(FLAVOURS["cpu"], pre)
    for name in args:
        assert f"{name}" in text, name
    for label in expected_labels(args):
        assert f"{label}=" in text, label


def test_dockerfile_orders_layers_deps_tree_then_patch():
    lines = [l for l in (REPO / "Dockerfile").read_text().splitlines() if l and not l.startswith("#")]
    idx = {key: next(i for i, l in enumerate(lines) if key in l) for key in (
        "install-deps.sh", "COPY tree/", "COPY patch/", "apply-patch.sh", "COPY --from=deps",
        "COPY --from=src", "capability_check.py", "LABEL org.opencontainers")}
    assert idx["install-deps.sh"] < idx["COPY tree/"] < idx["COPY patch/"] < idx["apply-patch.sh"]
    assert idx["COPY --from=deps"] < idx["COPY --from=src"] < idx["capability_check.py"] < idx["LABEL org.opencontainers"]
    assert "git clone" not in "\n".join(lines)
    deps_label = next(i for i, l in enumerate(lines) if 'io.gdn.stage="deps"' in l)
    assert idx["install-deps.sh"] < deps_label < next(i for i, l in enumerate(lines) if "AS src" in l)


def test_image_tags(inputs):
    pre = preflight(inputs, FLAVOURS["cpu"])
    assert image_tags(FLAVOURS["cpu"], pre) == [
        "gdn-megatron:cpu", f"gdn-megatron:cpu-{pre.patch_sha256[:12]}"]


# --------------------------------------------------------------------------- context

def test_stage_context_layout(inputs, tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    ctx = stage_context(inputs, FLAVOURS["cpu"], tmp_path / "ctx", ca_bundle=ca)
    files = sorted(p.relative_to(ctx).as_posix() for p in ctx.rglob("*") if p.is_file())
    assert files == sorted([
        "Dockerfile", "deps/requirements.lock", "deps/torch-cpu.lock", "deps/install-deps.sh",
        f"deps/wheels/{inputs.torch_wheel.name}", "deps/ca-bundle.crt",
        "app/bin/apply-patch.sh", "app/bin/capability_check.py", "app/bin/run-suite.sh",
        "app/bin/tree_digest.py", "app/tests/image/test_x.py", "tree/megatron/core/mod.py",
        "patch/megatron.patch", "patch/manifest.json", "patch/trees.json", "patch/decisions.md",
        *(f"app/examples/{p.name}" for p in (REPO / "docs" / "examples").glob("*.py"))])
    trees = json.loads((ctx / "patch" / "trees.json").read_text())
    assert (ctx / "patch" / "decisions.md").read_bytes() == (REPO / "docs" / "decisions.md").read_bytes()
    # the manifest's Markdown view travels beside the JSON when tools/backport wrote one
    inputs.manifest.with_suffix(".md").write_text("# manifest\n")
    ctx = stage_context(inputs, FLAVOURS["cpu"], tmp_path / "ctx", ca_bundle=ca)
    assert (ctx / "patch" / "manifest.md").read_text() == "# manifest\n"
    assert trees == read_tree_lock(inputs.tree_lock)
    assert (ctx / "patch" / "megatron.patch").read_bytes() == inputs.patch.read_bytes()


def test_stage_context_cuda_has_no_wheel_and_replaces_old_context(inputs, tmp_path):
    dest = tmp_path / "ctx"
    stage_context(inputs, FLAVOURS["cpu"], dest)
    stage_context(inputs, FLAVOURS["cuda"], dest)
    assert list((dest / "deps" / "wheels").iterdir()) == []
    assert not (dest / "deps" / "ca-bundle.crt").exists()


def test_host_ca_bundle_order(tmp_path, monkeypatch):
    a, b = tmp_path / "a.crt", tmp_path / "b.crt"
    a.write_text("a")
    b.write_text("b")
    for var in ("GDN_BUILD_CA_BUNDLE", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(var, raising=False)
    assert host_ca_bundle() is None
    monkeypatch.setenv("SSL_CERT_FILE", str(b))
    assert host_ca_bundle() == b
    monkeypatch.setenv("GDN_BUILD_CA_BUNDLE", str(a))
    assert host_ca_bundle() == a


# --------------------------------------------------------------------------- disk

def test_check_disk_refuses_below_floor(tmp_path):
    assert check_disk(tmp_path / "not" / "yet", 0.0) > 0
    with pytest.raises(DiskSpaceError, match="GiB free") as info:
        check_disk(tmp_path, 10**9)
    assert info.value.exit_code == 11 and "prune" in info.value.hint


def test_check_disk_default_floor_follows_storage_driver(tmp_path, monkeypatch):
    # Pretend the disk holds exactly 18 GiB free: enough for overlay2's floor, not for vfs's.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(100 * 2**30, 82 * 2**30, 18 * 2**30))
    assert min_free_gib("overlay2") < 18 < min_free_gib("vfs")
    assert check_disk(tmp_path, driver="overlay2") == pytest.approx(18.0)
    with pytest.raises(DiskSpaceError, match=r"needs about 22 GiB under the vfs storage driver") as info:
        check_disk(tmp_path, driver="vfs")
    assert "a cold build peaked at 16.6 GiB" in info.value.message and "floor 12 GiB" in info.value.message
    assert info.value.exit_code == 11
    assert "`sudo tools/dockerd-up`" in info.value.hint and "run the same command again" in info.value.hint
    # An unknown driver gets the larger floor; an explicit floor wins over the driver's.
    with pytest.raises(DiskSpaceError, match="storage driver btrfs"):
        check_disk(tmp_path, driver="btrfs")
    assert check_disk(tmp_path, 17.5, driver="vfs") == pytest.approx(18.0)


def test_docker_storage_reads_engine_info_and_falls_back():
    class Engine:
        def __init__(self, info):
            self._info = info

        def info(self):
            if isinstance(self._info, Exception):
                raise self._info
            return self._info

    assert docker_storage(Engine({"DockerRootDir": "/data/docker", "Driver": "overlay2"})) == (
        Path("/data/docker"), "overlay2")
    # No answer, or no driver named: the default root and the driver with the larger floor.
    assert docker_storage(Engine(RuntimeError("gone"))) == (Path("/var/lib/docker"), "vfs")
    assert docker_storage(Engine({"DockerRootDir": "/d"})) == (Path("/d"), "vfs")


def test_disk_peak_reports_growth_and_peak(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    readings = [100, 180, 260, 140]  # entry, samples..., then it stays at the last one

    def disk_usage(_p):
        value = readings.pop(0) if len(readings) > 1 else readings[0]
        if value == 180:
            raise FileNotFoundError("root vanished for one sample")
        return usage(1000, value, 0)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with DiskPeak(tmp_path / "not" / "made" / "yet", interval_s=0.001) as disk:
        deadline = time.monotonic() + 10
        while disk.peak_used < 260 and time.monotonic() < deadline:  # the sampler saw the top
            time.sleep(0.001)
    assert disk.path == tmp_path
    assert disk.growth_bytes == 40 and disk.peak_growth_bytes == 160 and disk.failed_samples == 1


# --------------------------------------------------------------------------- build stream

def _stream(*lines, error=None, image_id=None):
    chunks = [{"stream": line + "\n"} for line in lines]
    if image_id:
        chunks.append({"aux": {"ID": image_id}})
    if error:
        chunks.append({"errorDetail": {"message": error}, "error": error})
    return chunks


def _track(chunks):
    seen = []
    tracker = BuildTracker(on_line=seen.append)
    for c in chunks:
        tracker.feed(c)
    tracker.finish()
    return tracker, seen


def test_tracker_records_steps_cache_and_image():
    tracker, seen = _track(_stream(
        "Step 1/3 : FROM gdn-base:bookworm AS deps", " ---> 1234",
        "Step 2/3 : COPY deps/ /opt/gdn/deps/", " ---> Using cache", " ---> abcd",
        "Step 3/3 : RUN sh /opt/gdn/bin/apply-patch.sh", "==> [patch-apply] patch -p1",
        "Successfully built 0123456789ab", image_id="sha256:" + "f" * 64))
    assert [s.number for s in tracker.steps] == [1, 2, 3]
    assert [s.cached for s in tracker.steps] == [False, True, False]
    assert tracker.steps[2].marker == "patch-apply"
    assert tracker.image_id == "sha256:" + "f" * 64
    assert "==> [patch-apply] patch -p1" in seen


def test_tracker_strips_terminal_colours():
    tracker, seen = _track(_stream("Step 1/1 : RUN x", "\x1b[91mERROR: boom\x1b[0m"))
    assert "ERROR: boom" in seen and not any("\x1b" in s for s in seen)


def test_rejected_hunk_maps_to_patch_apply_with_tail():
    tracker, _ = _track(_stream(
        "Step 11/19 : RUN sh /opt/gdn/bin/apply-patch.sh",
        "==> [patch-apply] patch -p1 --fuzz=0 --batch --forward (2 hunks)",
        "patching file megatron/core/mod.py", "Hunk #1 FAILED at 1.",
        "error: [patch-apply] the patch does not apply with zero fuzz to the pristine tree (a hunk was rejected)",
        error="The command '/bin/sh -c sh /opt/gdn/bin/apply-patch.sh' returned a non-zero code: 1"))
    err = classify_build_error(tracker, "gdn-base:bookworm")
    assert isinstance(err, BuildStepFailed) and err.exit_code == 9
    assert err.step == "patch-apply"
    text = str(err)
    assert "failed at step patch-apply: the patch does not apply with zero fuzz" in text
    assert "Hunk #1 FAILED at 1." in text
    assert "tools/backport" in err.hint and text.rstrip().endswith(err.hint)


def test_capability_failure_names_the_checks():
    tracker, _ = _track(_stream(
        "Step 18/19 : RUN python /opt/gdn/bin/capability_check.py --fla-version 0.4.2",
        "==> [capability:versions] FAILED: AssertionError: wrong versions installed: flash-linear-attention==0.4.1 (want 0.4.2)",
        "==> [capability:fla-cp] FAILED: ModuleNotFoundError: No module named 'fla.ops.cp'",
        "error: [capability] failed: versions, fla-cp", error="returned a non-zero code: 1"))
    err = classify_build_error(tracker, "b")
    assert err.step.startswith("capability")
    assert "flash-linear-attention==0.4.1" in err.detail and "fla.ops.cp" in err.detail
    assert "requirements.in" in err.hint


@pytest.mark.parametrize("instruction, expected", [
    ('RUN sh /opt/gdn/deps/install-deps.sh "${TORCH_FROM}"', "deps"),
    ("RUN python /opt/gdn/bin/capability_check.py", "capability"),
    ("COPY tree/ /opt/gdn/base/", "7 (COPY tree/ /opt/gdn/base/)"),
])
def test_failed_step_falls_back_to_the_instruction(instruction, expected):
    tracker, _ = _track(_stream(f"Step 7/19 : {instruction}", error="boom"))
    assert tracker.failed_step() == expected


def test_no_space_maps_to_disk_error():
    tracker, _ = _track(_stream("Step 16/19 : COPY --from=deps /opt/gdn/venv /opt/gdn/venv",
                                error="write /var/lib/docker/vfs/dir/x: no space left on device"))
    err = classify_build_error(tracker, "b")
    assert isinstance(err, DiskSpaceError) and "step 16" in str(err)


def test_missing_base_maps_to_base_image_error():
    tracker, _ = _track(_stream("Step 2/19 : FROM ${BASE_IMAGE} AS deps",
                                error='Get "https://nvcr.io/v2/": dial tcp: lookup nvcr.io: no such host'))
    err = classify_build_error(tracker, "nvcr.io/nvidia/pytorch:25.12-py3")
    assert isinstance(err, BaseImageMissing) and err.exit_code == 14
    assert "nvcr.io/nvidia/pytorch:25.12-py3" in str(err) and "FLAVOUR=cpu" in err.hint


# --------------------------------------------------------------------------- gate report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
<testcase classname="test_a" name="test_ok"/>
<testcase classname="test_a" name="test_ok2"/>
<testcase classname="test_a" name="test_bad"><failure message="x">tb</failure></testcase>
<testcase classname="test_b" name="test_err"><error message="y">tb</error></testcase>
<testcase classname="test_b" name="test_gpu"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts():
    counts = parse_junit(JUNIT)
    assert {k: counts[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 5, "passed": 2, "failed": 1, "errors": 1, "skipped": 1}
    assert counts["failing"] == ["test_a::test_bad", "test_b::test_err"]


def test_parse_junit_refuses_garbage():
    with pytest.raises(GateFailed, match="unreadable"):
        parse_junit("<testsuites")


@pytest.mark.parametrize("counts, code, ok, words", [
    (dict(tests=3, passed=3, failed=0, errors=0, skipped=0), 0, True, "3 passed"),
    (dict(tests=3, passed=2, failed=1, errors=0, skipped=0), 1, False, "1 failed"),
    (dict(tests=3, passed=2, failed=0, errors=1, skipped=0), 1, False, "1 errors"),
    (dict(tests=0, passed=0, failed=0, errors=0, skipped=0), 5, False, "ran no test"),
    (dict(tests=4, passed=0, failed=0, errors=0, skipped=4), 0, False, "ran no test"),
    (dict(tests=2, passed=2, failed=0, errors=0, skipped=0), 3, False, "pytest exited 3"),
])
def test_gate_verdict(counts, code, ok, words):
    verdict, reason = gate_verdict(counts, code)
    assert verdict is ok and words in reason


def test_require_gate_ok_shows_tail_and_hint():
    report = {"ok": False, "reason": "1 failed, 0 errors", "image": {"id": "sha256:" + "a" * 64},
              "suite": {"failing": ["t::x"]}, "log_tail": ["FAILED t::x - AssertionError", "1 failed"]}
    with pytest.raises(GateFailed) as info:
        require_gate_ok(report)
    text = str(info.value)
    assert "t::x" in text and "| 1 failed" in text and "step suite" in text
    assert info.value.exit_code == 12 and text.rstrip().endswith(info.value.hint)
    require_gate_ok({"ok": True})


def test_write_json_is_canonical(tmp_path):
    path = write_json(tmp_path / "x" / "r.json", {"b": 1, "a": [2]})
    assert path.read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'


# --------------------------------------------------------------------------- errors and CLI

def test_error_classes_have_distinct_codes_and_hints():
    classes = [BuildStepFailed, DockerUnavailable, DiskSpaceError, GateFailed,
               InputError, BaseImageMissing]
    codes = [c.exit_code for c in classes]
    assert len(set(codes)) == len(codes)
    assert all(issubclass(c, ImageError) and issubclass(c, PipelineError) for c in classes)
    assert "tools/dockerd-up" in DockerUnavailable.default_hint


def test_docker_unavailable_without_engine(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(DockerUnavailable, match="no Docker Engine answers") as info:
        docker_client(timeout=2)
    # DOCKER_HOST names another engine than the one tools/dockerd-up starts: the hint says so.
    assert "Start the engine that DOCKER_HOST=unix:///nonexistent/docker.sock names" in info.value.hint
    assert "unset DOCKER_HOST" in info.value.hint and "sudo tools/dockerd-up" in info.value.hint


def test_cli_maps_errors_to_exit_codes(monkeypatch, capsys, inputs):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SystemExit) as info:
        image_cli.main(["build", "--flavour", "cuda", "--tree", str(inputs.tree), "--patch", str(inputs.patch),
                        "--manifest", str(inputs.manifest), "--lock", str(inputs.lock),
                        "--tree-lock", str(inputs.tree_lock)])
    assert info.value.code == 10
    err = capsys.readouterr().err
    assert "no Docker Engine answers" in err and "hint: Start the engine that DOCKER_HOST=" in err


def test_cli_refuses_missing_inputs_before_docker(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        image_cli.main(["build", "--tree", str(tmp_path / "none")])
    assert info.value.code == 13
    assert "tools/backport --upstream 5139086e" in capsys.readouterr().err


def test_check_lock_of_a_missing_lock_names_the_lock_not_pypi(capsys, monkeypatch, tmp_path):
    """A missing lock file is the culprit, not the network: exit 13, the path, the command that makes it."""
    monkeypatch.setattr(image_cli, "flavour_lock", lambda flavour, fla=None: tmp_path / "requirements-cuda-fla052.lock")
    with pytest.raises(SystemExit) as info:
        image_cli.main(["check-lock", "--flavour", "cuda", "--fla", "0.5.2"])
    err = capsys.readouterr().err
    assert info.value.code == 13
    first = err.splitlines()[0]
    assert "lock for FLA 0.5.2 is missing" in first and "requirements-cuda-fla052.lock" in first
    assert "tools/image lock --flavour cuda --fla 0.5.2" in err and "PyPI is reachable" not in err


def test_cli_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        image_cli.main(["build", "--flavour", "tpu"])
    assert info.value.code == 2


# --------------------------------------------------------------------------- lock

def test_committed_torch_lock_names_the_cpu_wheel():
    hashes = torch_lock_hashes((DOCKER / "torch-cpu.lock").read_text())
    assert list(hashes) == [CPU_TORCH_WHEEL.name]
    assert hashes[CPU_TORCH_WHEEL.name] == {
        "6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"}


def test_lock_render_parse_roundtrip():
    entries = [LockEntry("b-pkg", "1.0", {"2" * 64, "1" * 64}), LockEntry("a", "2", {"3" * 64})]
    text = render_lock(entries)
    assert text.index("a==2") < text.index("b-pkg==1.0")
    back = parse_lock(text)
    assert back["b-pkg"].hashes == {"1" * 64, "2" * 64} and back["a"].version == "2"
    with pytest.raises(ImageError, match="no hash"):
        render_lock([LockEntry("c", "1")])


def test_parse_report_skips_torch_and_normalises_names():
    report = {"install": [
        {"metadata": {"name": "torch", "version": "2.13.0+cpu"}, "download_info": {}},
        {"metadata": {"name": "Fla_Core", "version": "0.4.2"},
         "download_info": {"archive_info": {"hashes": {"sha256": "a" * 64}}}}]}
    entries = parse_report(report)
    assert list(entries) == ["fla-core"] and entries["fla-core"].hashes == {"a" * 64}


# --------------------------------------------------------------------------- one-line change

def _apply(tree: Path, patch_text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--forward", "--dry-run"],
                          cwd=tree, input=patch_text, text=True, capture_output=True)


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_one_line_change_keeps_the_patch_applicable(inputs):
    changed = one_line_change(GOOD_PATCH)
    diff = [(a, b) for a, b in zip(GOOD_PATCH.splitlines(), changed.splitlines()) if a != b]
    assert diff == [("+    # added comment", "+    # added comment (rebuild probe)")]
    assert _apply(inputs.tree, changed).returncode == 0


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_one_line_change_without_comment_extends_a_new_file(inputs):
    text = GOOD_PATCH.replace("+    # added comment\n", "+    x = 0\n")
    changed = one_line_change(text)
    assert "@@ -0,0 +1,3 @@" in changed and "+# rebuild probe\n" in changed
    assert _apply(inputs.tree, changed).returncode == 0
    with pytest.raises(InputError):
        one_line_change("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")


# --------------------------------------------------------------------------- scripts

def test_patched_modules():
    assert capability_check.patched_modules(GOOD_PATCH + "--- a/megatron/core/__init__.py\n"
                                            "+++ b/megatron/core/__init__.py\n"
                                            "--- a/README.md\n+++ b/README.md\n") == [
        "megatron.core", "megatron.core.mod", "megatron.core.new_mod"]


def _run_apply(tmp_path: Path, patch_text: str, manifest_sha: str | None = None):
    root = tmp_path / "gdn"
    (root / "base" / "megatron" / "core").mkdir(parents=True)
    (root / "base" / "megatron" / "core" / "mod.py").write_text(BASE_PY)
    (root / "patch").mkdir()
    (root / "patch" / "megatron.patch").write_text(patch_text)
    (root / "bin").mkdir()
    shutil.copy2(TREE_DIGEST_SCRIPT, root / "bin" / "tree_digest.py")
    # The lock made with this patch; a patch that does not apply gets the good patch's lock
    # (the same pristine digest), so the apply step is what refuses it.
    try:
        trees = lock_fields(root / "base", patch_text.encode())
    except PipelineError:
        trees = lock_fields(root / "base", GOOD_PATCH.encode())
    (root / "patch" / "trees.json").write_text(json.dumps(trees))
    sha = manifest_sha if manifest_sha is not None else _sha(patch_text.encode())
    (root / "patch" / "manifest.json").write_text(json.dumps({"patch": {"sha256": sha}}))
    env = dict(os.environ, GDN_ROOT=str(root), TMPDIR=str(tmp_path))
    result = subprocess.run(["sh", str(DOCKER / "apply-patch.sh")], env=env, capture_output=True, text=True)
    return result, root


needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")


@needs_patch
def test_apply_patch_script_applies_and_compiles(tmp_path):
    result, root = _run_apply(tmp_path, GOOD_PATCH)
    assert result.returncode == 0, result.stderr
    assert "# added comment" in (root / "tree" / "megatron" / "core" / "mod.py").read_text()
    assert (root / "tree" / "megatron" / "core" / "new_mod.py").exists()
    assert list((root / "tree").rglob("*.pyc"))
    assert (root / "base" / "megatron" / "core" / "mod.py").read_text() == BASE_PY


@needs_patch
@pytest.mark.parametrize("case, step, words", [
    ("rejected", "patch-apply", "Hunk #1 FAILED"),
    ("fuzz", "patch-apply", "FAILED"),
    ("reversed", "patch-apply", "Reversed (or previously applied) patch detected"),
    ("markers", "conflict-markers", "<<<<<<< ours"),
    ("syntax", "byte-compile", "do not compile"),
    ("digest", "patch-digest", "differs from the sha256 in manifest.json"),
])
def test_apply_patch_script_refuses(tmp_path, case, step, words):
    digest = None
    if case == "rejected":
        text = GOOD_PATCH.replace(" def f():\n     # one\n", " def g():\n     # one\n")
    elif case == "fuzz":  # only the first context line differs: fuzz 1 would take it
        text = GOOD_PATCH.replace(" def f():\n", " def f(x):\n")
    elif case == "reversed":  # the pristine tree already holds what this patch adds
        text = ("--- a/megatron/core/mod.py\n+++ b/megatron/core/mod.py\n@@ -1,2 +1,3 @@\n def f():\n"
                "+    # one\n     return 1\n")
    elif case == "markers":
        text = GOOD_PATCH.replace("+Y = 2\n", "+<<<<<<< ours\n")
    elif case == "syntax":
        text = GOOD_PATCH.replace("+Y = 2\n", "+Y = (\n")
    else:
        text, digest = GOOD_PATCH, "0" * 64
    result, _ = _run_apply(tmp_path, text, digest)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert f"error: [{step}]" in out, out
    assert words in out, out


# --------------------------------------------------------------------------- fake engine

class _FakeAPI:
    def __init__(self, chunks):
        self.chunks = chunks
        self.calls = []

    def pull(self, repo, tag=None, stream=False, decode=False):
        self.calls.append((repo, tag))
        return iter(self.chunks)


class _FakeImages:
    def __init__(self, present):
        self.present = present

    def get(self, ref):
        import docker

        if ref not in self.present:
            raise docker.errors.ImageNotFound(ref)
        return ref


class _FakeClient:
    def __init__(self, present=(), chunks=()):
        self.images = _FakeImages(set(present))
        self.api = _FakeAPI(list(chunks))


def test_pull_refusal_maps_to_base_image_missing():
    client = _FakeClient(chunks=[{"status": "Pulling from nvidia/pytorch"},
                                 {"error": "dial tcp: lookup nvcr.io: no such host"}])
    with pytest.raises(BaseImageMissing, match="cannot pull nvcr.io/nvidia/pytorch:25.12-py3"):
        pull_image(client, "nvcr.io/nvidia/pytorch:25.12-py3")
    assert client.api.calls == [("nvcr.io/nvidia/pytorch", "25.12-py3")]


def test_ensure_base_image_is_a_no_op_when_present():
    made = ensure_base_image(_FakeClient(present=[CPU_BASE_IMAGE]))
    assert made == {"tag": CPU_BASE_IMAGE, "created": False, "seconds": 0.0}


def test_ensure_base_image_needs_debootstrap(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ImageError, match="debootstrap is not installed") as info:
        ensure_base_image(_FakeClient())
    assert "tools/dockerd-up" in info.value.hint


def test_rebuilt_layers_skip_from_and_global_arg():
    steps = [{"number": 1, "instruction": "ARG BASE_IMAGE=x", "cached": False},
             {"number": 2, "instruction": "FROM ${BASE_IMAGE} AS deps", "cached": False},
             {"number": 3, "instruction": "COPY deps/ /opt/gdn/deps/", "cached": True},
             {"number": 4, "instruction": "COPY patch/ /opt/gdn/patch/", "cached": False}]
    assert rebuilt_layers(steps) == ["COPY patch/ /opt/gdn/patch/"]


def test_pull_failure_with_pull_given_does_not_say_add_pull(monkeypatch, capsys, inputs):
    class _Client:
        images = _FakeImages(set())
        api = _FakeAPI([{"error": "dial tcp: lookup nvcr.io: no such host"}])

        def info(self):
            return {"DockerRootDir": str(inputs.tree), "Driver": "overlay2"}

    monkeypatch.setattr(image_cli, "docker_client", lambda *a, **k: _Client())
    args = ["build", "--flavour", "cuda", "--tree", str(inputs.tree), "--patch", str(inputs.patch),
            "--manifest", str(inputs.manifest), "--lock", str(inputs.lock), "--tree-lock", str(inputs.tree_lock),
            "--min-free-gb", "0"]
    with pytest.raises(SystemExit) as info:
        image_cli.main(args)  # without --pull: the hint says to add it
    assert info.value.code == 14 and "add --pull" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        image_cli.main(args + ["--pull"])
    err = capsys.readouterr().err
    assert info.value.code == 14
    assert "cannot pull nvcr.io/nvidia/pytorch:25.12-py3" in err
    assert "add --pull" not in err and "The pull itself failed" in err and "docker load" in err


# ------------------------------------------------------------------ one image command per engine

class _FakePruneClient:
    def __init__(self):
        self.calls = []

    @property
    def containers(self):
        return self

    @property
    def images(self):
        return self

    def prune(self, filters=None):
        self.calls.append(filters)
        return {"SpaceReclaimed": 0}


def test_an_image_command_waits_for_the_engine_lock_and_no_wait_refuses_with_15(monkeypatch, capsys):
    """A prune while a build holds the engine must not run (it would delete the untagged new
    image): with --no-wait it exits 15 naming the engine, before talking to Docker."""
    import filelock

    from image_pipeline.engine import engine_lock_path

    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/gdn-test-docker.sock")
    monkeypatch.setattr(image_cli, "docker_client", lambda *a, **k: pytest.fail("Docker contacted under a busy lock"))
    path = engine_lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    held = filelock.FileLock(str(path), thread_local=False)
    held.acquire()
    try:
        with pytest.raises(SystemExit) as exc:
            image_cli.main(["--no-wait", "prune"])
    finally:
        held.release()
    assert exc.value.code == 15
    err = capsys.readouterr().err
    assert "the Docker Engine at unix:///tmp/gdn-test-docker.sock is in use by another run" in err
    assert "hint:" in err


def test_an_image_command_releases_the_engine_lock(monkeypatch):
    import filelock

    from image_pipeline.engine import engine_lock_path

    fake = _FakePruneClient()
    monkeypatch.setattr(image_cli, "docker_client", lambda *a, **k: fake)
    image_cli.cli.main(args=["prune"], standalone_mode=False)
    assert len(fake.calls) == 2  # containers, then dangling images
    lock = filelock.FileLock(str(engine_lock_path()), thread_local=False)
    lock.acquire(blocking=False)  # free again
    lock.release()


def test_engine_lock_is_per_engine_and_in_the_tool_cache(monkeypatch, tmp_path):
    from image_pipeline.engine import engine_lock_path

    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(tmp_path))
    a, b = engine_lock_path("unix:///var/run/docker.sock"), engine_lock_path("tcp://10.0.0.2:2376")
    assert a != b and a.parent == b.parent == tmp_path / "locks"


@pytest.mark.parametrize("cache", ["a-file", "a-file/sub"])
def test_a_cache_that_is_a_file_is_one_line_and_exit_1_not_a_traceback(monkeypatch, capsys, tmp_path, cache):
    """GDN_BACKPORT_CACHE naming a file (or a folder under one): the engine lock cannot be made;
    was a NotADirectoryError traceback. Now exit 1 (a system failure), one error line, a hint
    that names the cache, before Docker is contacted."""
    (tmp_path / "a-file").write_text("not a folder\n")
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(tmp_path / cache))
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/gdn-test-docker.sock")
    monkeypatch.setattr(image_cli, "docker_client", lambda *a, **k: pytest.fail("Docker contacted without the lock"))
    with pytest.raises(SystemExit) as exc:
        image_cli.main(["--no-wait", "prune"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("error: cannot take the lock for the Docker Engine") and "Not a directory" in lines[0]
    assert lines[-1].startswith("hint: ") and "GDN_BACKPORT_CACHE" in err


def test_an_unexpected_error_in_an_image_command_is_one_line_and_exit_1(monkeypatch, capsys):
    """Any exception that is not a PipelineError ends as error + hint lines and exit 1 (was a traceback)."""
    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(image_cli, "docker_client", boom)
    with pytest.raises(SystemExit) as exc:
        image_cli.main(["prune"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "second line" not in err
    assert "error: tools/image prune failed: unexpected RuntimeError: boom" in err and "hint: " in err


def test_docker_tests_remove_only_the_images_they_tagged():
    """The Docker tests' teardown removes its own tagged images by tag, never pruning parents,
    and leaves untagged images (another build's layers) and images tagged before it alone."""
    from types import SimpleNamespace

    from test_image_docker import TEST_REPO, _remove_test_images, _tagged_by_tests

    class Images:
        def __init__(self):
            self.items = [SimpleNamespace(id="sha256:old", tags=[f"{TEST_REPO}:kept"])]
            self.removed = []

        def list(self, name=None, all=False):
            assert name == TEST_REPO and not all  # tagged images of the test repo only
            return [i for i in self.items if i.tags]

        def remove(self, ref, noprune=False, force=False):
            assert noprune and not force, "a parent layer may be another build's"
            self.removed.append(ref)

    client = SimpleNamespace(images=Images())
    before = _tagged_by_tests(client)
    client.images.items += [SimpleNamespace(id="sha256:new", tags=[f"{TEST_REPO}:rejected"]),
                            SimpleNamespace(id="sha256:layer", tags=[])]  # a concurrent build's
    assert _remove_test_images(client, before) == ["sha256:new"]
    assert client.images.removed == [f"{TEST_REPO}:rejected"]


def test_docker_tests_are_opt_in_and_make_test_opts_in():
    """`make test-unit` leaves the engine alone; `make test` opts in and prints skip reasons."""
    from test_image_docker import OPT_IN

    makefile = (REPO / "Makefile").read_text()
    test_recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    unit_recipe = makefile.split("\ntest-unit: ", 1)[1].split("\n\n", 1)[0]
    assert f"{OPT_IN}=1" in test_recipe and OPT_IN not in unit_recipe
    assert "-rs" in unit_recipe


def test_image_hints_name_the_command_that_failed():
    """A failed `make gate` is not told to run `make image` (which builds the cuda flavour)."""
    from image_pipeline.cli import rerun_command, retarget_hint
    from image_pipeline.errors import GateFailed, hint_for_step

    in_make = {"MAKELEVEL": "1"}
    gate = ["gate", "--flavour", "cpu", "--report", "build/ci/gate-report.json"]
    assert rerun_command(gate, in_make) == "make gate"
    assert rerun_command(gate, {}) == "tools/image " + " ".join(gate)
    for hint in (GateFailed.default_hint, hint_for_step("patch-apply"), hint_for_step("x")):
        text = retarget_hint(hint, gate, in_make)
        assert "make image" not in text and "`make gate`" in text
    assert "`make image`" in retarget_hint(hint_for_step("x"), ["build", "--flavour", "cuda"], in_make)


def test_a_failed_make_target_prints_and_records_the_tools_exit_code(tmp_path):
    """make exits 2 for any failure; the Makefile prints the tool's own code and writes it to
    TOOL_RC_FILE, which .ci/run exits with."""
    rc_file = tmp_path / "rc"
    proc = subprocess.run(["make", "-o", ".venv/.installed", f"TOOL_RC_FILE={rc_file}",
                           "PY=sh -c 'exit 12' --", "gate"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "make gate: the tool exited 12" in proc.stderr
    assert rc_file.read_text().strip() == "12"
    ci = (REPO / ".ci" / "run").read_text()
    assert 'export TOOL_RC_FILE=' in ci and 'exit "$rc"' in ci


def test_docs_quote_the_recorded_gate():
    """docs/image-build-and-gate.md's figure of the suite in the image is the committed gate report's."""
    import re

    suite = json.loads((REPO / "results" / "pipeline" / "gate-report.json").read_text())["suite"]
    text = " ".join((REPO / "docs" / "image-build-and-gate.md").read_text().split())
    m = re.search(r"suite inside the image, as last recorded: (\d+) passed in (\d+) s", text)
    assert m, "docs/image-build-and-gate.md lost its gate figure"
    assert (int(m.group(1)), int(m.group(2))) == (suite["passed"], round(suite["seconds"]))
