"""The image locks: per-flavour targets, what the CUDA base provides, the closure check, the
committed locks, Megatron-Bridge's declared dependencies (read from the mirror at the pin), and
the cuda and cpu flavours sharing every Dockerfile stage. No network."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from image_pipeline.build import FLA_PIN, TRITON_PIN, build_args, stage_context
from image_pipeline.inputs import CPU_TORCH_WHEEL, FLAVOURS, Inputs, Preflight, flavour_lock
from image_pipeline.lock import (BASE_PROVIDED, SDIST_ONLY, TARGETS, LockEntry, base_provided, parse_lock, parse_report,
                        render_lock, requested_requirements, unmet_requirements)

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
BRIDGE_PIN = "2faedbf6fe3c422835a44b2b360cadcb2a116a54"
MCORE_BASE = "85bced0ae6ab46f61a0fd774074a3273daf6ae02"


def _item(name, version, requires=(), sha="0" * 64):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
            "download_info": {"archive_info": {"hashes": {"sha256": sha}}}}


# --------------------------------------------------------------------------- targets

def test_targets_match_the_bases():
    cpu, cuda = TARGETS["cpu"], TARGETS["cuda"]
    assert (cpu.python, cuda.python) == ("3.11", "3.12")
    assert cpu.platforms[0] == "manylinux_2_36_x86_64" and cuda.platforms[0] == "manylinux_2_39_x86_64"
    assert "manylinux_2_28_x86_64" in cuda.platforms and cuda.platforms[-2:] == ["manylinux2014_x86_64",
                                                                                  "linux_x86_64"]
    assert cuda.environment["python_version"] == "3.12"


@pytest.mark.parametrize("flavour, name, provided", [
    ("cuda", "torch", True), ("cuda", "torchvision", True), ("cuda", "transformer_engine", True),
    ("cuda", "nvidia-cudnn-cu12", True), ("cuda", "nvidia-nccl-cu13", True), ("cuda", "cuda-bindings", True),
    ("cuda", "cuda-pathfinder", False),
    ("cuda", "nvidia-cutlass-dsl-libs-cu13", False),  # a Python package, not the CUDA runtime
    ("cuda", "nvidia-modelopt", False), ("cuda", "nvidia-resiliency-ext", False), ("cuda", "triton", False),
    ("cpu", "torch", True), ("cpu", "torchvision", True),  # UNAVAILABLE: no cpu build on PyPI
    ("cpu", "nvidia-cudnn-cu12", False),
])
def test_what_the_base_provides(flavour, name, provided):
    assert base_provided(flavour, name) is provided


def test_parse_report_leaves_out_the_base_and_local_sdist_wheels():
    report = {"install": [_item("torch", "2.10.0"), _item("Nvidia_CUDNN_cu12", "9.1"),
                          _item("Flash_Linear_Attention", "0.4.2", sha="a" * 64),
                          _item("antlr4-python3-runtime", "4.9.3", sha="b" * 64)]}
    cuda = parse_report(report, "cuda")
    assert sorted(cuda) == ["antlr4-python3-runtime", "flash-linear-attention"]
    assert cuda["flash-linear-attention"].hashes == {"a" * 64}
    assert cuda["antlr4-python3-runtime"].hashes == set()  # the locally built wheel's hash is not PyPI's
    assert "nvidia-cudnn-cu12" in parse_report(report, "cpu")


def test_lock_render_names_target_and_base():
    text = render_lock([LockEntry("b", "1", {"f" * 64}), LockEntry("a", "2", {"e" * 64})], TARGETS["cuda"])
    assert "CPython 3.12" in text and "glibc 2.39" in text and "nvcr.io/nvidia/pytorch:25.12-py3" in text
    assert "torch" in text.split("Not here, because the base brings it:")[1].splitlines()[0]
    assert {n: e.version for n, e in parse_lock(text).items()} == {"a": "2", "b": "1"}


# --------------------------------------------------------------------------- closure check

def test_unmet_requirements_evaluates_markers_extras_and_the_base():
    report = {"install": [
        _item("a", "1.0", ["b>=2", "torch>=2.6", "c; python_version < '3.12'", "d; extra == 'x'",
                           "nvidia-cudnn-cu12==9.10"]),
        _item("b", "2.1", ["e[y]"]),
        _item("e", "1.0", ["f; extra == 'y'"]),
    ]}
    unmet = unmet_requirements(report, TARGETS["cuda"])
    # c is for 3.11 only; d only with [x]; torch and the CUDA runtime are the base's; f is asked via e[y].
    assert unmet == ["e needs f; extra == \"y\" (not in the lock, not in the base)"]
    assert "a needs c; python_version < \"3.12\" (not in the lock, not in the base)" in unmet_requirements(
        report, TARGETS["cpu"])
    with_x = unmet_requirements(report, TARGETS["cuda"], ["a[x]"])
    assert any(line.startswith("a needs d;") for line in with_x)


def test_unmet_requirements_checks_versions_against_lock_and_base():
    report = {"install": [_item("a", "1.0", ["b>=3", "torch>=2.11"]), _item("b", "2.1")]}
    assert unmet_requirements(report, TARGETS["cuda"]) == [
        "a needs b>=3 (the lock has 2.1)", "a needs torch>=2.11 (the base has 2.10.0a0)"]


# --------------------------------------------------------------------------- committed locks

@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_committed_locks_pin_fla_triton_and_bridge_deps(flavour):
    path = flavour_lock(flavour)
    entries = parse_lock(path.read_text())
    assert entries["flash-linear-attention"].version == FLA_PIN
    assert entries["fla-core"].version == FLA_PIN
    assert entries["triton"].version == TRITON_PIN
    for name in ("nvidia-modelopt", "omegaconf", "hydra-core", "datasets", "transformers", "wandb", "mlflow"):
        assert name in entries, f"{name} missing from {path.name}"
    assert all(e.hashes for e in entries.values())
    assert not [n for n in entries if base_provided(flavour, n)], "the lock holds what the base provides"
    for name, version in SDIST_ONLY.items():
        assert entries[name].version == version
    text = path.read_text()
    assert f"CPython {TARGETS[flavour].python}" in text


def test_cuda_lock_has_no_cuda_runtime_and_the_312_only_packages():
    entries = parse_lock(flavour_lock("cuda").read_text())
    assert not [n for n in entries if re.match(r"nvidia-(cudnn|cublas|nccl|cusparse)-cu1\d", n)]
    assert "emerging-optimizers" in entries  # python_version >= "3.12" in requirements.in
    assert "emerging-optimizers" not in parse_lock(flavour_lock("cpu").read_text())


def test_requested_requirements_strip_comments():
    reqs = requested_requirements(DOCKER / "requirements.in")
    assert "flash-linear-attention==0.4.2" in reqs and "openai[aiohttp]" in reqs
    assert not [r for r in reqs if r.startswith("#")]


# --------------------------------------------------------------------------- Bridge's declared deps

def _mirror_file(env: str, default: str, rev: str, path: str) -> str:
    repo = os.environ.get(env) or default
    if not Path(repo).is_dir():
        pytest.skip(f"no mirror at {repo} (set {env})")
    out = subprocess.run(["git", f"--git-dir={repo}", "show", f"{rev}:{path}"], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"{rev[:9]}:{path} not in {repo}: {out.stderr.strip()[:200]}")
    return out.stdout


def _names(reqs) -> set:
    from packaging.requirements import Requirement

    return {re.sub(r"[-_.]+", "-", Requirement(r).name).lower() for r in reqs}


def test_every_dependency_bridge_declares_is_locked_or_named():
    """Bridge's [project].dependencies at the pin, plus megatron-core[dev,mlm] at the MCore base."""
    bridge = tomllib.loads(_mirror_file("MEGATRON_BRIDGE_REPO", "/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo",
                                        BRIDGE_PIN, "pyproject.toml"))
    mcore = tomllib.loads(_mirror_file("MEGATRON_LM_REPO", "/work/.mirror/NVIDIA+Megatron-LM/repo",
                                       MCORE_BASE, "pyproject.toml"))
    declared = _names(bridge["project"]["dependencies"])
    declared |= _names(mcore["project"]["dependencies"])
    for extra in ("dev", "mlm"):
        declared |= _names(mcore["project"]["optional-dependencies"][extra])
    text = (DOCKER / "requirements.in").read_text()
    required = _names(requested_requirements(DOCKER / "requirements.in"))
    named = {re.sub(r"[-_.]+", "-", m).lower() for m in re.findall(r"^# not-locked: ([A-Za-z0-9_.-]+):", text, re.M)}
    assert declared - required - named == set()
    assert named & required <= {"flash-linear-attention"}  # named only to say where it is pinned


def test_both_locks_hold_what_requirements_in_asks():
    required = _names(r.split(";")[0] for r in requested_requirements(DOCKER / "requirements.in"))
    for flavour in ("cpu", "cuda"):
        locked = set(parse_lock(flavour_lock(flavour).read_text()))
        only_312 = {"emerging-optimizers"} if flavour == "cpu" else set()  # python_version >= "3.12"
        missing = required - locked - only_312
        assert not missing, f"{flavour}: {missing}"


# --------------------------------------------------------------------------- shared stages

def test_cuda_and_cpu_share_every_dockerfile_stage(tmp_path):
    """One Dockerfile: the flavours differ only in build args (base, torch source, flavour, lock
    digest) and in deps/ (the flavour's lock, the cpu torch wheel); every other context file,
    and so every instruction of deps/src/image, is the same."""
    base = tmp_path / "tree"
    (base / "megatron" / "core").mkdir(parents=True)
    (base / "megatron" / "core" / "m.py").write_text("X = 1\n")
    trees = {"base_tree_sha256": "a" * 64, "patched_tree_sha256": "b" * 64,
             "tree_files": {"base": {}, "patched_changes": {}}}
    wheel = tmp_path / CPU_TORCH_WHEEL.name
    wheel.write_bytes(b"w")
    # The patch and manifest are synthetic too: a fresh clone has no patches/latest/ (was
    # FileNotFoundError unless tools/backport had written the worktree's outputs).
    patch, manifest = tmp_path / "megatron.patch", tmp_path / "manifest.json"
    patch.write_text("--- a/megatron/core/m.py\n+++ b/megatron/core/m.py\n@@ -1 +1 @@\n-X = 1\n+X = 2\n")
    manifest.write_text("{}\n")
    ctx = {}
    for flavour in ("cpu", "cuda"):
        inputs = Inputs(tree=base, patch=patch, manifest=manifest, lock=flavour_lock(flavour), torch_wheel=wheel)
        ctx[flavour] = stage_context(inputs, FLAVOURS[flavour], tmp_path / f"ctx-{flavour}", trees=trees)

    def files(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    cpu, cuda = files(ctx["cpu"]), files(ctx["cuda"])
    differ = sorted(k for k in set(cpu) | set(cuda) if cpu.get(k) != cuda.get(k))
    assert differ == ["deps/requirements.lock", f"deps/wheels/{wheel.name}"]
    dockerfile = cpu["Dockerfile"].decode()
    assert [line for line in dockerfile.splitlines() if line.startswith("FROM ")] == [
        "FROM ${BASE_IMAGE} AS deps", "FROM ${BASE_IMAGE} AS src", "FROM ${BASE_IMAGE} AS image"]
    pre = Preflight(patch_sha256="p", manifest_sha256="m", lock_sha256="l", tree_sha256="t",
                        patch_name="n", pins={}, lock_pins={}, hunks=1, trees=trees)
    args = {f: build_args(FLAVOURS[f], pre) for f in ("cpu", "cuda")}
    assert sorted(k for k in args["cpu"] if args["cpu"][k] != args["cuda"][k]) == [
        "BASE_IMAGE", "GDN_FLAVOUR", "TORCH_FROM"]


def test_unmet_requirements_checks_requires_python_against_the_target():
    report = {"install": [dict(_item("av", "19.0.2"), metadata={"name": "av", "version": "19.0.2",
                                                                "requires_python": ">=3.12"})]}
    assert unmet_requirements(report, TARGETS["cuda"]) == []
    assert unmet_requirements(report, TARGETS["cpu"]) == [
        "av 19.0.2 requires Python >=3.12 (the target has 3.11)"]
