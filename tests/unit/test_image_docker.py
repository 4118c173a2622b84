"""Image build and gate through a real Docker Engine (docker-py), with deliberately broken inputs.

Every test here skips, saying why, when no engine answers (start one with
`sudo tools/dockerd-up`). They build the cpu flavour on the local Debian base
(`tools/image base` makes it once) and reuse the layer cache of earlier builds.

* a patch with a rejected hunk fails the build at step patch-apply, with the log tail;
* a lock that pins FLA 0.4.1 fails the build at the capability step (slow: the deps
  layer is rebuilt; set GDN_IMAGE_SLOW_TESTS=1);
* a build context whose pristine tree drifted after the preflight fails at step base-tree
  with exit 13, naming the file;
* the gate passes on the built image (its trees' digests, computed inside it, are the lock's),
  and refuses a run that ran no test and a run against the unpatched tree.

They are opt-in: they run when ``GDN_DOCKER_TESTS=1`` (``make test`` and ``.ci/run`` set it;
``make test-unit``, the quick check, does not, and says so in its skip reasons). Each test holds
the Docker Engine's lock, the same one ``tools/image`` takes (:func:`engine_lock`), so a test
never runs beside a build or gate of another clone on the same engine. Each test removes only
the images it tagged (``gdn-megatron-test:*``), by id, without pruning their untagged parents:
those are layers of the shared build cache, possibly in use by another build (removing every new
untagged image once failed a concurrent gate with "unknown parent image ID").
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backport.tree_digest import lock_fields
from image_pipeline.build import IMAGE_REPO, BuildResult, BuildTracker, build_args, build_image, host_ca_bundle, stage_context
from backport import locks
from image_pipeline.engine import docker_client, engine_lock_path, ensure_base_image, image_exists
from image_pipeline.errors import BuildStepFailed, DockerUnavailable, GateFailed, TreeDrift
from image_pipeline.gate import LISTED_SUITE_MODULES, require_gate_ok, run_gate
from image_pipeline.inputs import CPU_BASE_IMAGE, CPU_TORCH_WHEEL, FLAVOURS, Inputs, flavour_lock, preflight
from image_pipeline.lock import parse_lock

REPO = Path(__file__).resolve().parents[2]
TEST_REPO = "gdn-megatron-test"


#: The opt-in switch: the quick check (`make test-unit`) leaves the engine alone.
OPT_IN = "GDN_DOCKER_TESTS"
#: The engine's lock in the user's real cache, read at import: conftest's autouse fixture moves
#: ``$GDN_BACKPORT_CACHE`` to a temporary folder for each test, and a lock there would be
#: nobody else's.
ENGINE_LOCK = engine_lock_path()


@pytest.fixture(scope="module")
def client():
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"Docker tests are opt-in: set {OPT_IN}=1 (`make test` and `.ci/run` do)")
    try:
        c = docker_client(timeout=1800)
    except DockerUnavailable as exc:
        pytest.skip(f"no Docker Engine: {exc.message} (start one with `sudo tools/dockerd-up`)")
    if not image_exists(c, CPU_BASE_IMAGE):
        if os.geteuid() != 0:
            pytest.skip(f"base image {CPU_BASE_IMAGE} is missing; make it with `tools/image base` (root)")
        ensure_base_image(c, CPU_BASE_IMAGE)
    if not CPU_TORCH_WHEEL.is_file():
        pytest.skip(f"the cpu torch wheel {CPU_TORCH_WHEEL} is not on this machine")
    return c


def _tagged_by_tests(client) -> dict:
    """Image id -> its tags, for every image carrying a ``gdn-megatron-test:*`` tag."""
    return {i.id: list(i.tags) for i in client.images.list(name=TEST_REPO)}


def _remove_test_images(client, before: dict) -> list:
    """Remove the images the test tagged since ``before`` (:func:`_tagged_by_tests`), by id,
    keeping their untagged parents (the build cache another build may be using)."""
    import docker

    removed = []
    for image_id, tags in _tagged_by_tests(client).items():
        if before.get(image_id) == tags:
            continue  # was there before this test, with the same tags: not ours
        for tag in tags:
            if tag in before.get(image_id, []):
                continue
            try:
                client.images.remove(tag, noprune=True)
            except docker.errors.ImageNotFound:
                pass
        removed.append(image_id)
    return removed


@pytest.fixture(autouse=True)
def _hold_engine_and_clean_up(request):
    """Hold the engine's lock for the test (the one ``tools/image`` takes: :func:`engine_lock_path`)
    and remove what it tagged."""
    client = request.getfixturevalue("client")
    with locks.hold(ENGINE_LOCK, "the Docker Engine (tests/unit/test_image_docker.py)",
                    say=lambda m: print(m, file=sys.stderr)):
        before = _tagged_by_tests(client)
        yield
        _remove_test_images(client, before)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _synthetic_inputs(tmp_path: Path, patch_text: str, lock: Path | None = None) -> Inputs:
    tree = tmp_path / "tree" / "megatron" / "core"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "mod.py").write_text("def f():\n    # one\n    return 1\n")
    patch = tmp_path / "megatron.patch"
    patch.write_text(patch_text)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"patch": {"name": "synthetic.patch", "sha256": _sha(patch.read_bytes())},
                                    "pins": {}}))
    defaults = Inputs()
    tree_lock = tmp_path / "lock.json"
    try:
        trees = lock_fields(tmp_path / "tree", patch.read_bytes())
    except Exception:  # a patch that does not apply: the lock of the pristine tree alone
        trees = lock_fields(tmp_path / "tree", b"")
    tree_lock.write_text(json.dumps(trees))
    return Inputs(tree=tmp_path / "tree", patch=patch, manifest=manifest,
                      lock=lock or defaults.lock, tree_lock=tree_lock)


def _build(client, inputs: Inputs, tmp_path: Path, tag: str, tamper=None) -> BuildResult:
    fl = FLAVOURS["cpu"]
    pre = preflight(inputs, fl)
    ctx = stage_context(inputs, fl, tmp_path / "ctx", host_ca_bundle(), trees=pre.trees)
    if tamper:
        tamper(ctx)
    lines: list[str] = []
    return build_image(client, ctx, build_args(fl, pre), [f"{TEST_REPO}:{tag}"], on_line=lines.append)


# Synthetic fixture patch (no upstream code), kept under tests/data/.
REJECTED = (Path(__file__).resolve().parents[1] / "data" / "image" / "rejected-hunk.patch").read_text()


def test_build_refuses_a_patch_with_a_rejected_hunk(client, tmp_path):
    inputs = _synthetic_inputs(tmp_path, REJECTED)
    with pytest.raises(BuildStepFailed) as info:
        _build(client, inputs, tmp_path, "rejected")
    err = info.value
    assert err.step == "patch-apply" and err.exit_code == 9
    text = str(err)
    assert "Hunk #1 FAILED" in text and "rejected hunks" in text
    assert "failed at step patch-apply" in text and text.rstrip().endswith(err.hint)
    assert "tools/backport" in err.hint


def test_build_refuses_a_context_whose_tree_drifted(client, tmp_path):
    """The in-build check (apply-patch.sh, step base-tree), behind the preflight's."""
    inputs = _synthetic_inputs(tmp_path, REJECTED.replace("def g", "def f"))

    def tamper(ctx: Path) -> None:
        (ctx / "tree" / "megatron" / "core" / "extra.py").write_text("X = 1\n")

    with pytest.raises(TreeDrift) as info:
        _build(client, inputs, tmp_path, "drift", tamper=tamper)
    assert info.value.exit_code == 13
    assert "first differing file: megatron/core/extra.py (extra)" in str(info.value)


def _fla_041_lock(tmp_path: Path) -> Path:
    """The committed lock with flash-linear-attention/fla-core pinned at 0.4.1 (real hashes)."""
    dest = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "download", "--no-deps", "--quiet",
                    "--only-binary=:all:", "--index-url", img_index(), "--dest", str(dest),
                    "flash-linear-attention==0.4.1", "fla-core==0.4.1"], check=True)
    hashes = {w.name.split("-")[0].replace("_", "-"): _sha(w.read_bytes()) for w in dest.glob("*.whl")}
    text = flavour_lock("cpu").read_text()
    out, skip = [], False
    for line in text.splitlines():
        name = line.split("==")[0]
        if name in ("flash-linear-attention", "fla-core"):
            out.append(f"{name}==0.4.1 \\\n    --hash=sha256:{hashes[name]}")
            skip = True
            continue
        if skip and line.startswith("    --hash"):
            continue
        skip = False
        out.append(line)
    lock = tmp_path / "requirements.lock"
    lock.write_text("\n".join(out) + "\n")
    assert parse_lock(lock.read_text())["fla-core"].version == "0.4.1"
    return lock


def img_index() -> str:
    from image_pipeline.lock import INDEX_URL
    return INDEX_URL


@pytest.mark.skipif(os.environ.get("GDN_IMAGE_SLOW_TESTS") != "1",
                    reason="rebuilds the deps layer (minutes, needs PyPI); set GDN_IMAGE_SLOW_TESTS=1")
def test_build_refuses_a_wrong_fla_pin(client, tmp_path):
    real = Inputs()
    if (real.tree / "megatron").is_dir() and real.patch.is_file():
        inputs = Inputs(lock=_fla_041_lock(tmp_path))
    else:
        good = REJECTED.replace("def g", "def f")
        inputs = _synthetic_inputs(tmp_path, good, lock=_fla_041_lock(tmp_path))
    with pytest.raises(BuildStepFailed) as info:
        _build(client, inputs, tmp_path, "fla041")
    err = info.value
    assert err.step.startswith("capability")
    text = str(err)
    assert "flash-linear-attention==0.4.1 (want 0.4.2)" in text
    assert "fla.ops.cp" in text
    assert "requirements.in" in err.hint


@pytest.fixture(scope="module")
def built_image(client):
    ref = f"{IMAGE_REPO}:cpu"
    if not image_exists(client, ref):
        pytest.skip(f"no {ref} image; build it with `make gate` (or `tools/image build --flavour cpu`)")
    return ref


def _image_trees(client, ref: str) -> dict:
    """The tree fields the image was built with (its /opt/gdn/patch/trees.json)."""
    out = client.containers.run(ref, ["cat", "/opt/gdn/patch/trees.json"], remove=True, network_mode="host")
    return json.loads(out)


#: The gate tests here run the parts of the suite their assertions read, not the whole suite a
#: second time: `make gate` (and .ci/run's gate step) runs all of it in the same image. The report
#: must list both LISTED_SUITE_MODULES; of test_image_bridge, its cheapest test (the Bridge import).
LISTED_ONLY = ["-k", "test_image_tree_drift or test_megatron_bridge_imports_from_the_patched_tree"]
assert all(mod in LISTED_ONLY[1] or mod == "test_image_bridge" for mod in LISTED_SUITE_MODULES)


def test_gate_passes_on_the_image(client, built_image):
    report = run_gate(client, built_image, gpus=False, trees=_image_trees(client, built_image),
                      pytest_args=LISTED_ONLY)
    assert report["ok"], report["reason"]
    assert report["tree_check"]["base"]["ok"] and report["tree_check"]["patched"]["ok"]
    names = [c["name"] for c in report["checks"]]
    assert any("test_image_tree_drift" in n for n in names) and any("test_image_bridge" in n for n in names)
    assert report["suite"]["passed"] > 0 and report["suite"]["failed"] == 0
    assert report["versions"]["flash-linear-attention"] == "0.4.2"
    assert report["versions"]["triton"] == "3.6.0"
    assert report["pins"]["fla-core"] == "0.4.2"
    assert report["patch_sha256"] == client.images.get(built_image).labels["io.gdn.patch.sha256"]


def test_gate_refuses_an_image_whose_tree_is_not_the_locks(client, built_image):
    trees = _image_trees(client, built_image)
    trees["tree_files"]["patched_changes"]["megatron/core/ssm/gated_delta_net.py"] = "0" * 16
    trees["patched_tree_sha256"] = "0" * 64
    report = run_gate(client, built_image, gpus=False, trees=trees)
    assert not report["ok"] and report["suite"]["part"] == "not run"
    assert "first differing file: megatron/core/ssm/gated_delta_net.py (changed)" in report["reason"]
    with pytest.raises(TreeDrift):
        require_gate_ok(report)


def test_gate_refuses_a_run_with_no_test(client, built_image):
    report = run_gate(client, built_image, gpus=False, pytest_args=["-k", "no_test_has_this_name"])
    assert not report["ok"] and "ran no test" in report["reason"]
    with pytest.raises(GateFailed, match="ran no test"):
        require_gate_ok(report)


def test_gate_refuses_the_unpatched_tree(client, built_image):
    # test_image_config reads the contract's names from the patched modules: on the unpatched
    # tree its first test already fails, which is what -x stops at.
    report = run_gate(client, built_image, gpus=False, environment={"GDN_TREE": "/opt/gdn/base"},
                      pytest_args=["-x", "-k", "test_image_config"])
    assert not report["ok"]
    assert report["suite"]["failed"] + report["suite"]["errors"] >= 1
    with pytest.raises(GateFailed) as info:
        require_gate_ok(report)
    assert "step suite" in str(info.value) and "failing:" in str(info.value)


TORCH_BASE = "gdn-torchbase:bookworm"
TORCH_BASE_DOCKERFILE = """\
# Stand-in for the NGC PyTorch base: torch in the system site-packages, and a pip
# constraint file in PIP_CONSTRAINT that contradicts the lock (as NGC's does).
FROM {base}
COPY . /tmp/ctx/
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt
RUN mkdir -p /etc/pip && echo "triton==3.5.0" > /etc/pip/constraint.txt \\
 && python3 -m venv /tmp/bootstrap \\
 && PIP_CONSTRAINT= PIP_CERT=$(ls /tmp/ctx/ca-bundle.crt 2>/dev/null || true) \\
    /tmp/bootstrap/bin/pip install --no-cache-dir --target /usr/local/lib/python3.11/dist-packages \\
    /tmp/ctx/{wheel} \\
 && rm -rf /tmp/bootstrap /tmp/ctx \\
 && python3 -c "import torch; print(torch.__version__)"
"""


def _torch_base(client, tmp_path: Path) -> str:
    if image_exists(client, TORCH_BASE):
        return TORCH_BASE
    ctx = tmp_path / "torchbase"
    ctx.mkdir()
    wheel = CPU_TORCH_WHEEL
    os.link(wheel, ctx / wheel.name) if os.stat(wheel).st_dev == os.stat(ctx).st_dev else \
        __import__("shutil").copy2(wheel, ctx / wheel.name)
    ca = host_ca_bundle()
    if ca:
        (ctx / "ca-bundle.crt").write_bytes(ca.read_bytes())
    (ctx / "Dockerfile").write_text(TORCH_BASE_DOCKERFILE.format(base=CPU_BASE_IMAGE, wheel=wheel.name))
    tracker = BuildTracker()
    for chunk in client.api.build(path=str(ctx), tag=TORCH_BASE, decode=True, network_mode="host",
                                  rm=True, forcerm=True, pull=False):
        tracker.feed(chunk)
    assert not tracker.error, "\n".join(tracker.tail)
    return TORCH_BASE


@pytest.mark.skipif(os.environ.get("GDN_IMAGE_SLOW_TESTS") != "1",
                    reason="builds a torch stand-in base and a full image (minutes); set GDN_IMAGE_SLOW_TESTS=1")
def test_cuda_flavour_path_on_a_torch_base(client, tmp_path):
    """The cuda flavour's path (TORCH_FROM=base, torch from the base's site-packages, the
    base's PIP_CONSTRAINT ignored) on a local stand-in for the NGC base: no CUDA here."""
    real = Inputs()
    if not ((real.tree / "megatron").is_dir() and real.patch.is_file()):
        pytest.skip("needs build/tree/base and patches/latest (run `make patch`)")
    base = _torch_base(client, tmp_path)
    fl = FLAVOURS["cuda"]
    pre = preflight(real, fl)
    ctx = stage_context(real, fl, tmp_path / "ctx", host_ca_bundle(), trees=pre.trees)
    args = build_args(fl, pre, base)
    result = build_image(client, ctx, args, [f"{TEST_REPO}:cuda-path"])
    assert result.labels["io.gdn.flavour"] == "cuda"
    assert result.labels["org.opencontainers.image.base.name"] == base
    out = client.containers.run(result.image_id, ["python", "-c", (
        "import torch, triton, fla, json, pathlib; print(json.dumps({'torch': torch.__file__, "
        "'triton': triton.__version__, 'fla': fla.__version__}))")], remove=True, network_mode="host")
    seen = json.loads(out.decode().strip().splitlines()[-1])
    assert seen["torch"].startswith("/usr/local/lib/python3.11/dist-packages/torch")
    assert seen["triton"] == "3.6.0" and seen["fla"] == "0.4.2"
    report = run_gate(client, result.image_id, gpus=False)
    assert report["ok"], report["reason"]
