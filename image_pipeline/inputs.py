"""Build inputs: the flavours, the paths a build reads, and the preflight that checks them before
Docker (patch against manifest, torch wheel against its lock, pristine tree against manifests/lock.json)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from backport import tree_digest as td
from backport.tree_digest import sha256_file

from .errors import InputError, TreeDrift
from .lock import DEFAULT_FLA, parse_lock, target_for

REPO_ROOT = Path(__file__).resolve().parent.parent

CUDA_BASE_IMAGE = "nvcr.io/nvidia/pytorch:25.12-py3"
CPU_BASE_IMAGE = "gdn-base:bookworm"
#: The cpu flavour's torch wheel (its sha256 is pinned in docker/torch-cpu.lock): where this machine
#: kind keeps it, or ``$GDN_CPU_TORCH_WHEEL`` (``--torch-wheel`` on the command line wins).
CPU_TORCH_WHEEL_NAME = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
CPU_TORCH_WHEEL = Path(os.environ.get("GDN_CPU_TORCH_WHEEL") or f"/opt/wheels/{CPU_TORCH_WHEEL_NAME}")


@dataclass(frozen=True)
class Flavour:
    """A build flavour: which base image and where torch comes from."""

    name: str
    base_image: str
    torch_from: str  # "base" (the base image has torch) or "wheel" (deps/torch-cpu.lock)


FLAVOURS = {
    "cuda": Flavour("cuda", CUDA_BASE_IMAGE, "base"),
    "cpu": Flavour("cpu", CPU_BASE_IMAGE, "wheel"),
}


def flavour_lock(flavour: str, fla: str = DEFAULT_FLA) -> Path:
    """``docker/requirements-<flavour>.lock``: the hash-pinned packages of that flavour's image.

    cpu: resolved for CPython 3.11 on Debian bookworm (glibc 2.36) next to the cpu torch wheel;
    cuda: resolved for CPython 3.12 on the NGC base (Ubuntu 24.04, glibc 2.39), without what that
    base provides (``image_pipeline.lock.BASE_PROVIDED``). Another FLA set than the default
    (``fla``, :data:`image_pipeline.lock.FLA_SETS`) has its own lock,
    ``docker/requirements-cuda-fla052.lock`` for FLA 0.5.2 (``-fla060`` for 0.6.0); a pair without one raises
    :class:`image_pipeline.errors.ImageError` naming those that exist.
    """
    return REPO_ROOT / "docker" / f"requirements-{target_for(flavour, fla).key}.lock"


@dataclass(frozen=True)
class Inputs:
    """Paths the build reads; defaults are the repo's (see docs/contract.md)."""

    tree: Path = REPO_ROOT / "build" / "tree" / "base"
    patch: Path = REPO_ROOT / "patches" / "latest" / "megatron.patch"
    manifest: Path = REPO_ROOT / "patches" / "latest" / "manifest.json"
    tests: Path = REPO_ROOT / "tests" / "image"
    dockerfile: Path = REPO_ROOT / "Dockerfile"
    docker_dir: Path = REPO_ROOT / "docker"
    #: Requirements lock of the flavour (:func:`flavour_lock`); the cpu one by default.
    lock: Path = REPO_ROOT / "docker" / "requirements-cpu.lock"
    torch_lock: Path = REPO_ROOT / "docker" / "torch-cpu.lock"
    torch_wheel: Path = CPU_TORCH_WHEEL
    #: The committed lock of the backport (tree digests: base_tree_sha256, patched_tree_sha256).
    tree_lock: Path = REPO_ROOT / "manifests" / "lock.json"


def tree_digest(parent: Path) -> str:
    """sha256 of ``parent/megatron`` as the lock records it (:func:`backport.tree_digest.tree_digest`)."""
    return td.tree_digest(parent)


TREE_KEYS = ("base_tree_sha256", "patched_tree_sha256", "tree_files")


def read_tree_lock(path: Path) -> dict:
    """The tree fields of ``manifests/lock.json`` (``base_tree_sha256``, ``patched_tree_sha256``,
    ``tree_files``). Raises :class:`InputError` when the lock is missing, not JSON, or has none."""
    try:
        lock = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputError(f"{path} is missing: the build checks the trees against its digests",
                         "Run `tools/backport --upstream 5139086e` (it writes the lock), then `make image`.") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not JSON: {exc}",
                         "Restore it with `git checkout manifests/lock.json`, then `make image`.") from exc
    missing = [k for k in TREE_KEYS if not lock.get(k)]
    if missing:
        raise InputError(f"{path} has no {', '.join(missing)}: it predates the tree digests",
                         "Regenerate it with `tools/backport --upstream 5139086e`, then `make image`.")
    return {k: lock[k] for k in TREE_KEYS}


def check_tree(parent: Path, trees: dict, which: str = "base") -> dict:
    """Check ``parent/megatron`` against the lock's ``which`` tree; raises :class:`TreeDrift`."""
    result = td.check_against_lock(parent, trees, which)
    if not result["ok"]:
        what = "pristine" if which == "base" else "patched"
        raise TreeDrift(f"{td.describe(result, what)} ({parent / 'megatron'})")
    return result


def torch_lock_hashes(text: str) -> dict[str, set[str]]:
    """``{wheel file name: {sha256}}`` from ``docker/torch-cpu.lock``."""
    out: dict[str, set[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip().rstrip("\\").strip()
        if not line or line.startswith("#"):
            continue
        m = re.search(r"file://\S*/([^/\s]+\.whl)", line)
        if m:
            current = m.group(1).replace("%2B", "+")
            out.setdefault(current, set())
        for token in line.split():
            if token.startswith("--hash=sha256:") and current:
                out[current].add(token.split(":", 1)[1])
    return out


@dataclass
class Preflight:
    """What preflight read: digests and pins that become labels and build args."""

    patch_sha256: str
    manifest_sha256: str
    lock_sha256: str
    tree_sha256: str
    patch_name: str
    pins: dict
    lock_pins: dict
    hunks: int
    #: The tree fields of manifests/lock.json (staged as patch/trees.json for the build).
    trees: dict = field(default_factory=dict)


def preflight(inputs: Inputs, flavour: Flavour) -> Preflight:
    """Check the inputs before touching Docker.

    The pristine tree must have the lock's ``base_tree_sha256`` (the patched tree's digest is
    checked inside the build, after the patch is applied).

    Raises:
        InputError: an input is missing or disagrees with another.
        TreeDrift: the pristine tree is not the lock's; names the first differing file.
    """
    missing = [str(p) for p in (inputs.tree / "megatron", inputs.patch, inputs.manifest)
               if not p.exists()]
    if missing:
        raise InputError("build inputs missing: " + ", ".join(missing))
    for p in (inputs.dockerfile, inputs.lock, inputs.tests, inputs.docker_dir):
        if not p.exists():
            raise InputError(f"{p} is missing from the checkout",
                             "Restore it with `git checkout -- <path>`, then `make image`.")
    patch_sha = sha256_file(inputs.patch)
    try:
        manifest = json.loads(inputs.manifest.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{inputs.manifest} is not JSON: {exc}") from exc
    want = manifest.get("patch", {}).get("sha256")
    if want and want != patch_sha:
        raise InputError(
            f"{inputs.patch} (sha256 {patch_sha[:12]}) is not the patch {inputs.manifest} "
            f"describes (sha256 {want[:12]})",
            "Regenerate both with `tools/backport --upstream 5139086e`, then `make image`.")
    lock_pins = {n: e.version for n, e in parse_lock(inputs.lock.read_text(encoding="utf-8")).items()}
    if flavour.torch_from == "wheel":
        wheel = inputs.torch_wheel
        if not wheel.is_file():
            raise InputError(f"cpu torch wheel not found at {wheel}",
                             "Pass --torch-wheel PATH (the file named in docker/torch-cpu.lock).")
        hashes = torch_lock_hashes(inputs.torch_lock.read_text(encoding="utf-8"))
        if wheel.name not in hashes:
            raise InputError(f"{inputs.torch_lock} does not name {wheel.name}",
                             "Use the wheel the lock names, or update docker/torch-cpu.lock.")
        actual = sha256_file(wheel)
        if actual not in hashes[wheel.name]:
            raise InputError(f"{wheel} has sha256 {actual[:12]}, not the one in {inputs.torch_lock}",
                             "Use the exact wheel the lock names (a different build is refused).")
    trees = read_tree_lock(inputs.tree_lock)
    base = check_tree(inputs.tree, trees, "base")
    text = inputs.patch.read_text(encoding="utf-8", errors="replace")
    return Preflight(
        patch_sha256=patch_sha,
        manifest_sha256=sha256_file(inputs.manifest),
        lock_sha256=sha256_file(inputs.lock),
        tree_sha256=base["sha256"],
        patch_name=manifest.get("patch", {}).get("name", inputs.patch.name),
        pins=dict(manifest.get("pins", {})),
        lock_pins=lock_pins,
        hunks=sum(1 for line in text.splitlines() if line.startswith("@@ ")),
        trees=trees,
    )
