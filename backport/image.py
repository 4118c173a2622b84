"""Build and gate the training image through docker-py (no docker CLI).

Functions here return data and report progress through an ``on_line`` callback;
``backport.image_cli`` (``tools/image``) prints. Errors are :class:`ImageError`
subclasses, each with an exit code and a hint that says what to do next.

Flow of ``make image`` / ``make gate``::

    preflight()          inputs present, manifest agrees with the patch, disk space
    docker_client()      the engine answers (else: run tools/dockerd-up)
    ensure_base_image()  cpu flavour: debootstrap bookworm + import (once)
    stage_context()      build/image/context-<flavour>/ (tree, patch, suite, locks, wheel)
    build_image()        streamed classic build; a failing step -> BuildStepFailed
    run_gate()           the suite inside the image -> JUnit XML -> report
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import io
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from . import tree_digest as td
from .errors import ImageError
from .image_lock import parse_lock
from .tree_digest import sha256_file

REPO_ROOT = Path(__file__).resolve().parent.parent

FLA_PIN = "0.4.2"
TRITON_PIN = "3.6.0"
CUDA_BASE_IMAGE = "nvcr.io/nvidia/pytorch:25.12-py3"
CPU_BASE_IMAGE = "gdn-base:bookworm"
CPU_TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("GDN_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the Dockerfile needs from a base: python3 (>= 3.10) with venv, and patch.
DEBOOTSTRAP_INCLUDE = ("python3", "python3-venv", "patch", "ca-certificates")
IMAGE_REPO = "gdn-megatron"
LOG_TAIL = 30

Line = Callable[[str], None]


def _quiet(_line: str) -> None:
    pass


# --------------------------------------------------------------------------- errors

class DockerUnavailable(ImageError):
    """No Docker Engine answers (not installed, not started, no permission)."""

    exit_code = 10
    default_hint = "Start one with `sudo tools/dockerd-up`, then run the same command again."


class DiskSpaceError(ImageError):
    """Too little free disk under Docker's root for the build (see :data:`MIN_FREE_GIB`)."""

    exit_code = 11
    default_hint = ("Free space (e.g. remove old images: `tools/image prune`), or lower the "
                    "floor with --min-free-gb, then run the same command again.")


class GateFailed(ImageError):
    """The image's regression suite failed, errored, or ran no test."""

    exit_code = 12
    default_hint = "Fix the failing tests named above, rebuild with `make image`, then `make gate`."


class InputError(ImageError):
    """A build input is missing or disagrees with another (tree, patch, manifest, lock, wheel)."""

    exit_code = 13
    default_hint = "Run `tools/backport --upstream 5139086e` to write the tree and patch, then `make image`."


class TreeDrift(InputError):
    """The pristine or patched tree is not the one ``manifests/lock.json`` records (exit 13).

    Raised before a build (the context's pristine tree), from a build step (``base-tree``,
    ``patched-tree``, or a hunk that applies only at an offset), and by the gate (the digest
    computed inside the image). The message names the first differing file.
    """

    default_hint = ("Rebuild the trees and the patch with `tools/backport --upstream 5139086e` "
                    "(it rewrites build/tree/ and patches/latest/), then `make image`. If the lock is the "
                    "stale one, regenerate it the same way.")


class BaseImageMissing(ImageError):
    """The base image is not local and cannot be pulled (no registry reachable)."""

    exit_code = 14
    default_hint = ("Where a registry is reachable, add --pull (`make image IMAGE_ARGS=--pull`); "
                    "elsewhere load the base first (`docker load`), or build the cpu flavour: "
                    "`make image IMAGE_FLAVOUR=cpu`.")


#: Hint of a pull that failed although --pull was given (the default hint says to add it).
PULL_FAILED_HINT = ("The pull itself failed: check that this machine reaches the registry (for nvcr.io also "
                    "`docker login nvcr.io`) and that the tag exists, then run the same command again; or load "
                    "the base from a file (`docker load -i FILE`), or build the cpu flavour: "
                    "`make image IMAGE_FLAVOUR=cpu`.")


class BuildStepFailed(ImageError):
    """A Dockerfile step failed; carries the step and the tail of its log."""

    exit_code = 9

    def __init__(self, step: str, detail: str, tail: list[str], hint: Optional[str] = None):
        self.step = step
        self.detail = detail
        self.tail = list(tail)
        text = f"image build failed at step {step}: {detail}\n--- last {len(self.tail)} log lines:\n"
        text += "\n".join(f"  | {t}" for t in self.tail)
        super().__init__(text, hint or hint_for_step(step))


def hint_for_step(step: str) -> str:
    """What to do when ``step`` (a script marker such as ``patch-apply``) fails."""
    hints = {
        "deps": "The locked Python packages did not install. If a hash or pin changed, "
                "regenerate the lock with `tools/image lock`, then `make image`.",
        "patch-digest": "The patch in the context is not the one the manifest describes; "
                        "regenerate with `tools/backport --upstream 5139086e`, then `make image`.",
        "patch-apply": "The patch does not apply to the pinned tree with zero fuzz. Regenerate it "
                       "against build/tree/base with `tools/backport --upstream 5139086e`, then `make image`.",
        "leftovers": "The patch left .rej/.orig files; regenerate it with `tools/backport`, then `make image`.",
        "conflict-markers": "Remove the conflict markers from the recipe's output "
                            "(`tools/backport`), then `make image`.",
        "byte-compile": "A patched file has a syntax error; fix the recipe step that writes it, "
                        "re-run `tools/backport`, then `make image`.",
        "capability": "The image cannot run GDN chunkwise CP. Check the pins in "
                      "docker/requirements.in (flash-linear-attention==0.4.2, fla-core==0.4.2, "
                      "triton==3.6.0), run `tools/image lock`, then `make image`.",
    }
    for key, hint in hints.items():
        if step.startswith(key):
            return hint
    return "Read the log tail above, fix its cause, then run `make image` again."


# --------------------------------------------------------------------------- inputs

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


def flavour_lock(flavour: str) -> Path:
    """``docker/requirements-<flavour>.lock``: the hash-pinned packages of that flavour's image.

    cpu: resolved for CPython 3.11 on Debian bookworm (glibc 2.36) next to the cpu torch wheel;
    cuda: resolved for CPython 3.12 on the NGC base (Ubuntu 24.04, glibc 2.39), without what that
    base provides (``backport.image_lock.BASE_PROVIDED``).
    """
    return REPO_ROOT / "docker" / f"requirements-{flavour}.lock"


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


#: GiB the cpu-flavour build needs free under Docker's root, by storage driver.
#: overlay2: `tools/image measure` (base image, cold build and a one-line rebuild) peaked
#: 5.9 GiB above its start (``disk`` in results/pipeline/image-timings.json); twice that.
#: vfs copies the whole root file system into every layer: one cold build with its base image
#: peaked at 16.6 GiB (results/pipeline/image-disk-vfs-build.json), `measure` at 21.3 GiB
#: (results/pipeline/image-timings-vfs.json); the floor covers both.
MIN_FREE_GIB = {"overlay2": 12.0, "vfs": 22.0}
#: The measured peaks behind those floors (GiB), quoted in the error.
MEASURED_PEAK_GIB = {"overlay2": 5.9, "vfs": 16.6}
#: Floor for a driver not measured here.
DEFAULT_MIN_FREE_GIB = 25.0


def min_free_gib(driver: str) -> float:
    """Default disk floor (GiB) for Docker storage ``driver`` (e.g. ``"overlay2"``)."""
    return MIN_FREE_GIB.get(driver, DEFAULT_MIN_FREE_GIB)


def check_disk(path: Path, min_free_gb: Optional[float] = None, driver: str = "vfs") -> float:
    """Free GiB under ``path`` (Docker's root).

    ``min_free_gb`` defaults to :func:`min_free_gib` of ``driver``.
    Raises :class:`DiskSpaceError` when less is free.
    """
    floor = min_free_gib(driver) if min_free_gb is None else min_free_gb
    free = shutil.disk_usage(_existing(path)).free / 2**30
    if free < floor:
        if driver == "vfs":
            raise DiskSpaceError(
                f"only {free:.1f} GiB free under {path}; the build needs about {floor:.0f} GiB under the vfs "
                f"storage driver, which copies every layer in full (a cold build peaked at {MEASURED_PEAK_GIB['vfs']} GiB "
                f"here; under overlay2, build and rebuild together at {MEASURED_PEAK_GIB['overlay2']} GiB, "
                f"floor {min_free_gib('overlay2'):.0f} GiB)",
                hint="Free space (`tools/image prune`), or switch to overlay2: stop dockerd, run "
                     "`sudo tools/dockerd-up` (it picks overlay2 where the kernel mounts overlay), then run "
                     "the same command again. Or lower the floor with --min-free-gb.")
        raise DiskSpaceError(f"only {free:.1f} GiB free under {path}; the build needs about "
                             f"{floor:.0f} GiB (storage driver {driver})")
    return free


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (disk usage of a root not made yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class DiskPeak:
    """Sample used bytes of the file system holding ``path`` in a thread, for ``measure``.

    ``growth_bytes`` / ``peak_growth_bytes``: used bytes at exit / at the highest sample
    (every ``interval_s`` seconds) minus used bytes at entry. Other writers to the same file
    system count too. A sample that fails (the root vanished) is skipped and counted in
    ``failed_samples``.
    """

    def __init__(self, path: Path, interval_s: float = 0.5):
        import threading

        self.path, self.interval_s = _existing(path), interval_s
        self.failed_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start_used = self.peak_used = self.end_used = 0

    def _used(self) -> int:
        return shutil.disk_usage(self.path).used

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak_used = max(self.peak_used, self._used())
            except OSError:
                self.failed_samples += 1

    def __enter__(self) -> "DiskPeak":
        self.start_used = self.peak_used = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end_used = self._used()
        self.peak_used = max(self.peak_used, self.end_used)

    @property
    def growth_bytes(self) -> int:
        return self.end_used - self.start_used

    @property
    def peak_growth_bytes(self) -> int:
        return self.peak_used - self.start_used


def build_args(flavour: Flavour, pre: Preflight, base_image: Optional[str] = None) -> dict[str, str]:
    """Build args of the Dockerfile (they also fill the OCI labels)."""
    return {
        "BASE_IMAGE": base_image or flavour.base_image,
        "TORCH_FROM": flavour.torch_from,
        "GDN_FLAVOUR": flavour.name,
        "FLA_VERSION": FLA_PIN,
        "TRITON_VERSION": TRITON_PIN,
        "PATCH_SHA256": pre.patch_sha256,
        "PATCH_NAME": pre.patch_name,
        "MANIFEST_SHA256": pre.manifest_sha256,
        "LOCK_SHA256": pre.lock_sha256,
        "TREE_SHA256": pre.tree_sha256,
        "PIN_MEGATRON_BRIDGE": str(pre.pins.get("megatron_bridge", "")),
        "PIN_MCORE_BASE": str(pre.pins.get("mcore_base", "")),
        "PIN_UPSTREAM": str(pre.pins.get("upstream", "")),
    }


def expected_labels(args: dict[str, str]) -> dict[str, str]:
    """The OCI labels the Dockerfile writes from ``args`` (checked after a build)."""
    return {
        "org.opencontainers.image.title": "gdn-megatron",
        "org.opencontainers.image.base.name": args["BASE_IMAGE"],
        "org.opencontainers.image.version": args["PATCH_NAME"],
        "io.gdn.flavour": args["GDN_FLAVOUR"],
        "io.gdn.pin.megatron-bridge": args["PIN_MEGATRON_BRIDGE"],
        "io.gdn.pin.mcore-base": args["PIN_MCORE_BASE"],
        "io.gdn.pin.upstream": args["PIN_UPSTREAM"],
        "io.gdn.pin.flash-linear-attention": args["FLA_VERSION"],
        "io.gdn.pin.fla-core": args["FLA_VERSION"],
        "io.gdn.pin.triton": args["TRITON_VERSION"],
        "io.gdn.fla.version": args["FLA_VERSION"],
        "io.gdn.patch.sha256": args["PATCH_SHA256"],
        "io.gdn.manifest.sha256": args["MANIFEST_SHA256"],
        "io.gdn.requirements-lock.sha256": args["LOCK_SHA256"],
        "io.gdn.tree.sha256": args["TREE_SHA256"],
    }


def image_tags(flavour: Flavour, pre: Preflight) -> list[str]:
    """``gdn-megatron:<flavour>`` and ``gdn-megatron:<flavour>-<patch sha12>``."""
    return [f"{IMAGE_REPO}:{flavour.name}", f"{IMAGE_REPO}:{flavour.name}-{pre.patch_sha256[:12]}"]


# --------------------------------------------------------------------------- context

CONTEXT_SCRIPTS = {"app/bin": ("apply-patch.sh", "capability_check.py", "run-suite.sh"),
                   "deps": ("install-deps.sh",)}
#: The one digest implementation, copied into the image (standard library only).
TREE_DIGEST_SCRIPT = Path(td.__file__)


def _copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)


def _link_or_copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def host_ca_bundle() -> Optional[Path]:
    """The CA bundle pip on this host trusts, when one is configured.

    Behind a TLS-inspecting proxy PyPI is reachable only with the proxy's CA; the
    deps stage then uses this bundle (it never reaches the final image, which copies
    only the venv). Order: GDN_BUILD_CA_BUNDLE, PIP_CERT, SSL_CERT_FILE, REQUESTS_CA_BUNDLE.
    """
    for var in ("GDN_BUILD_CA_BUNDLE", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        value = os.environ.get(var)
        if value and Path(value).is_file():
            return Path(value)
    return None


def stage_context(inputs: Inputs, flavour: Flavour, dest: Path, ca_bundle: Optional[Path] = None,
                  trees: Optional[dict] = None) -> Path:
    """Write the build context to ``dest`` (replaced); returns ``dest``.

    Layout (the Dockerfile's header lists it): Dockerfile, deps/ (locks, install
    script, wheels/, optional ca-bundle.crt), tree/megatron/, app/ (tests/image/,
    bin/ with tree_digest.py), patch/ (patch, manifest, trees.json: the lock's tree fields,
    ``trees`` or read from ``inputs.tree_lock``).
    """
    trees = trees if trees is not None else read_tree_lock(inputs.tree_lock)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc", "*.pyo")
    _copy(inputs.dockerfile, dest / "Dockerfile")
    _copy(inputs.lock, dest / "deps" / "requirements.lock")
    _copy(inputs.torch_lock, dest / "deps" / "torch-cpu.lock")
    (dest / "deps" / "wheels").mkdir(parents=True)
    if ca_bundle is not None:
        _copy(ca_bundle, dest / "deps" / "ca-bundle.crt")
    if flavour.torch_from == "wheel":
        _link_or_copy(inputs.torch_wheel, dest / "deps" / "wheels" / inputs.torch_wheel.name)
    for sub, names in CONTEXT_SCRIPTS.items():
        for name in names:
            _copy(inputs.docker_dir / name, dest / sub / name)
    _copy(TREE_DIGEST_SCRIPT, dest / "app" / "bin" / "tree_digest.py")
    shutil.copytree(inputs.tree / "megatron", dest / "tree" / "megatron", symlinks=True, ignore=ignore)
    shutil.copytree(inputs.tests, dest / "app" / "tests" / "image", symlinks=True, ignore=ignore)
    _copy(inputs.patch, dest / "patch" / "megatron.patch")
    _copy(inputs.manifest, dest / "patch" / "manifest.json")
    (dest / "patch" / "trees.json").write_text(json.dumps(trees, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return dest


# --------------------------------------------------------------------------- docker

def docker_client(timeout: int = 600):
    """A docker-py client that answers ``ping``; raises :class:`DockerUnavailable`."""
    try:
        import docker
    except ImportError as exc:
        raise DockerUnavailable("the Python package `docker` (docker-py) is not installed",
                                "Run `pip install 'docker>=7'` (or `pip install -e .[image]`).") from exc
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # DockerException, connection refused, permission denied
        host = os.environ.get("DOCKER_HOST")
        where = host or "unix:///var/run/docker.sock"
        hint = None
        if host and host != "unix:///var/run/docker.sock":
            hint = (f"Start the engine that DOCKER_HOST={host} names, or unset DOCKER_HOST to use the local "
                    "one (`sudo tools/dockerd-up` starts it), then run the same command again.")
        raise DockerUnavailable(f"no Docker Engine answers at {where} ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:200] if str(exc) else ''})", hint) from exc
    return client


def docker_storage(client) -> tuple[Path, str]:
    """(Docker's root directory, storage driver name) as the engine reports them.

    Falls back to ``/var/lib/docker`` and ``"vfs"`` (the larger disk floor) when the engine
    does not say.
    """
    try:
        info = client.info()
    except Exception:
        info = {}
    return Path(info.get("DockerRootDir") or "/var/lib/docker"), str(info.get("Driver") or "vfs")


def image_exists(client, ref: str) -> bool:
    import docker

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def pull_image(client, ref: str, on_line: Line = _quiet) -> None:
    """Pull ``ref`` (streamed); raises :class:`BaseImageMissing` when the registry refuses."""
    repo, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    try:
        for chunk in client.api.pull(repo, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise BaseImageMissing(f"cannot pull {ref}: {chunk['error']}")
            status = chunk.get("status")
            if status and "progress" not in chunk:
                on_line(f"{status} {chunk.get('id', '')}".rstrip())
    except BaseImageMissing:
        raise
    except Exception as exc:  # APIError, connection errors
        raise BaseImageMissing(f"cannot pull {ref}: {exc}") from exc


def ensure_base_image(client, tag: str = CPU_BASE_IMAGE, work: Optional[Path] = None,
                      on_line: Line = _quiet, suite: str = DEBIAN_SUITE,
                      mirror: str = DEBIAN_MIRROR) -> dict:
    """Make the cpu base (debootstrap minbase + python3/venv/patch) unless ``tag`` exists.

    Returns ``{"tag", "created", "seconds"}``. Needs root and debootstrap.
    """
    if image_exists(client, tag):
        return {"tag": tag, "created": False, "seconds": 0.0}
    if shutil.which("debootstrap") is None:
        raise ImageError(f"base image {tag} is missing and debootstrap is not installed",
                         "Run `sudo tools/dockerd-up` (it installs debootstrap), then `make image`.")
    work = work or REPO_ROOT / "build" / "image"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gdn-base-", dir=work) as tmp:
        root = Path(tmp) / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(DEBOOTSTRAP_INCLUDE)}",
               suite, str(root), mirror]
        on_line(f"==> [base-image] {' '.join(cmd)}")
        _run_streamed(cmd, "base-image", on_line)
        tar_path = Path(tmp) / "rootfs.tar"
        on_line(f"==> [base-image] importing {tag}")
        _run_streamed(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tar_path), "."],
                      "base-image", on_line)
        repo, _, version = tag.partition(":")
        client.api.import_image_from_file(
            str(tar_path), repository=repo, tag=version or "latest",
            changes=['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"])
    return {"tag": tag, "created": True, "seconds": round(time.monotonic() - t0, 1)}


def _run_streamed(cmd: list[str], step: str, on_line: Line) -> None:
    tail: deque = deque(maxlen=LOG_TAIL)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8")
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        on_line(line)
    if proc.wait() != 0:
        raise BuildStepFailed(step, f"`{' '.join(cmd[:2])} ...` exited {proc.returncode}", list(tail),
                              "Check that the Debian mirror is reachable and that you are root, "
                              "then run `make image` again.")


# --------------------------------------------------------------------------- build

_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
_MARKER = re.compile(r"^(?:==> |error: )\[([a-z0-9:-]+)\]")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NO_SPACE = re.compile(r"no space left on device", re.I)
_PULL = re.compile(r"pull access denied|manifest unknown|dial tcp|no such host|"
                   r"failed to resolve reference|error pulling image|"
                   r"repository does not exist|Get \"?https?://", re.I)


@dataclass
class StepRecord:
    """One Dockerfile step of a classic build."""

    number: int
    instruction: str
    cached: bool = False
    seconds: float = 0.0
    marker: str = ""


@dataclass
class BuildTracker:
    """Turns the classic builder's JSON stream into steps, a log tail and an error."""

    on_line: Line = _quiet
    steps: list = field(default_factory=list)
    tail: deque = field(default_factory=lambda: deque(maxlen=LOG_TAIL))
    image_id: Optional[str] = None
    error: Optional[str] = None
    _t: float = field(default_factory=time.monotonic)

    def _close_step(self) -> None:
        if self.steps:
            self.steps[-1].seconds = round(time.monotonic() - self._t, 2)
        self._t = time.monotonic()

    def feed(self, chunk: dict) -> None:
        if "stream" in chunk:
            for line in chunk["stream"].splitlines():
                self._line(line.rstrip())
        if "aux" in chunk and isinstance(chunk["aux"], dict) and "ID" in chunk["aux"]:
            self.image_id = chunk["aux"]["ID"]
        if "status" in chunk:  # a pull of the base image
            self._line(f"{chunk['status']} {chunk.get('progress', '') or ''}".rstrip())
        if "error" in chunk or "errorDetail" in chunk:
            detail = chunk.get("errorDetail", {}).get("message") or chunk.get("error", "")
            self.error = detail.strip()
            self._line(f"ERROR: {self.error}")

    def _line(self, line: str) -> None:
        line = _ANSI.sub("", line)
        if not line.strip():
            return
        m = _STEP.match(line)
        if m:
            self._close_step()
            self.steps.append(StepRecord(int(m.group(1)), m.group(3)))
            self.tail.clear()
        elif self.steps:
            if "Using cache" in line:
                self.steps[-1].cached = True
            mk = _MARKER.match(line)
            if mk:
                self.steps[-1].marker = mk.group(1)
        m2 = re.match(r"^Successfully built ([0-9a-f]{12,64})$", line)
        if m2 and not self.image_id:
            self.image_id = m2.group(1)
        self.tail.append(line)
        self.on_line(line)

    def finish(self) -> None:
        self._close_step()

    def failed_step(self) -> str:
        """Name of the failing step: the script's marker, else the Dockerfile instruction."""
        if not self.steps:
            return "context"
        step = self.steps[-1]
        instr = step.instruction
        if step.marker:
            return step.marker
        if instr.startswith("FROM"):
            return f"FROM ({instr[5:].split()[0] if len(instr) > 5 else ''})"
        if "install-deps.sh" in instr:
            return "deps"
        if "apply-patch.sh" in instr:
            return "patch-apply"
        if "capability_check.py" in instr:
            return "capability"
        return f"{step.number} ({instr[:60]})"


#: Steps of docker/apply-patch.sh that compare a tree with the lock (a failure is a TreeDrift).
TREE_STEPS = ("base-tree", "patched-tree")


def classify_build_error(tracker: BuildTracker, base_image: str) -> ImageError:
    """Map a failed build to the right error (disk, base image, or a named step)."""
    text = "\n".join(list(tracker.tail) + [tracker.error or ""])
    step = tracker.failed_step()
    if _NO_SPACE.search(text):
        return DiskSpaceError(f"the image build ran out of disk at step {step}:\n"
                              + "\n".join(f"  | {t}" for t in list(tracker.tail)[-10:]))
    if step.startswith("FROM") or (not tracker.steps and _PULL.search(text)) or (
            tracker.steps and tracker.steps[-1].instruction.startswith("FROM") and _PULL.search(text)):
        return BaseImageMissing(f"base image {base_image} is not on this machine and cannot be "
                                f"pulled: {tracker.error or 'pull failed'}")
    detail = tracker.error or "the step failed"
    own = [t.split("] ", 1)[1] for t in tracker.tail if t.startswith("error: [") and "] " in t]
    if own:  # the script's own message says more than "returned a non-zero code"
        detail = own[-1]
    if step in TREE_STEPS or (step == "patch-apply" and "offset or fuzz" in detail):
        return TreeDrift(f"image build step {step}: {detail}\n--- last {min(10, len(tracker.tail))} log lines:\n"
                         + "\n".join(f"  | {t}" for t in list(tracker.tail)[-10:]))
    if step.startswith("capability"):
        failed = [t for t in tracker.tail if "FAILED" in t]
        if failed:
            detail = "; ".join(f.split("] ", 1)[-1] for f in failed)[:500]
    return BuildStepFailed(step, detail, list(tracker.tail))


def rebuilt_layers(steps: list) -> list:
    """Instructions of ``steps`` (dicts) that ran instead of coming from the cache."""
    return [s["instruction"] for s in steps
            if not s["cached"] and s["number"] > 1 and not s["instruction"].startswith("FROM ")]


@dataclass
class BuildResult:
    """What a build produced."""

    image_id: str
    tags: list
    flavour: str
    seconds: float
    steps: list
    labels: dict
    size_bytes: int
    build_args: dict
    #: The base image step of ``do_build``: ``{"ref", "made", "seconds"}`` (seconds 0 when present).
    base_image: dict = field(default_factory=dict)

    @property
    def rebuilt_steps(self) -> list:
        """Instructions that made a new layer (FROM and the global ARG make none)."""
        return rebuilt_layers(self.steps)

    @property
    def cached_steps(self) -> int:
        return sum(1 for s in self.steps if s["cached"])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cached_steps"] = self.cached_steps
        return d


def build_image(client, context: Path, args: dict[str, str], tags: list[str],
                on_line: Line = _quiet, nocache: bool = False, target: Optional[str] = None) -> BuildResult:
    """Classic build of ``context`` with host networking; raises on any failed step."""
    import docker

    t0 = time.monotonic()
    tracker = BuildTracker(on_line=on_line)
    try:
        stream = client.api.build(path=str(context), tag=tags[0], buildargs=args, decode=True,
                                  network_mode="host", rm=True, forcerm=True, pull=False,
                                  nocache=nocache, target=target)
        for chunk in stream:
            tracker.feed(chunk)
    except docker.errors.APIError as exc:
        tracker.error = str(exc.explanation or exc)
        tracker.finish()
        raise classify_build_error(tracker, args["BASE_IMAGE"]) from exc
    tracker.finish()
    if tracker.error or not tracker.image_id:
        tracker.error = tracker.error or "the build stream ended without an image"
        raise classify_build_error(tracker, args["BASE_IMAGE"])
    image = client.images.get(tracker.image_id)
    for tag in tags[1:]:
        repo, _, version = tag.partition(":")
        image.tag(repo, version)
    image.reload()
    labels = image.labels or {}
    if target in (None, "image"):
        want = expected_labels(args)
        wrong = {k: (labels.get(k), v) for k, v in want.items() if labels.get(k) != v}
        if wrong:
            raise BuildStepFailed("labels", f"labels differ from the inputs: {wrong}", list(tracker.tail))
    return BuildResult(
        image_id=image.id, tags=list(tags), flavour=args["GDN_FLAVOUR"],
        seconds=round(time.monotonic() - t0, 1),
        steps=[asdict(s) for s in tracker.steps], labels=dict(labels),
        size_bytes=int(image.attrs.get("Size", 0)), build_args=dict(args))


# --------------------------------------------------------------------------- gate

def parse_junit(xml_text: str) -> dict:
    """Counts and failing test ids from pytest's JUnit XML (xunit1 or xunit2)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise GateFailed(f"the suite's JUnit XML is unreadable: {exc}") from exc
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failing.append(tid)
        elif "error" in kinds:
            counts["errors"] += 1
            failing.append(tid)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["failing"] = sorted(failing)
    return counts


def gate_verdict(counts: dict, exit_code: int) -> tuple[bool, str]:
    """``(ok, reason)``: refuse any failure or error, and a run with no passed test."""
    if counts["failed"] or counts["errors"]:
        return False, f"{counts['failed']} failed, {counts['errors']} errors"
    if counts["passed"] == 0:
        return False, f"the suite ran no test ({counts['tests']} collected, {counts['skipped']} skipped)"
    if exit_code not in (0,):
        return False, f"pytest exited {exit_code} although the JUnit XML shows no failure"
    return True, f"{counts['passed']} passed, {counts['skipped']} skipped"


def host_has_gpus() -> bool:
    """True when an NVIDIA GPU is visible on the host (nvidia-smi lists one)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, encoding="utf-8", timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def _read_from_container(container, path: str) -> Optional[bytes]:
    import docker

    try:
        bits, _ = container.get_archive(path)
    except docker.errors.NotFound:
        return None
    buf = io.BytesIO(b"".join(bits))
    with tarfile.open(fileobj=buf) as tar:
        member = tar.next()
        if member is None:
            return None
        f = tar.extractfile(member)
        return f.read() if f else None


def junit_cases(xml_text: str) -> dict:
    """``{test id: "passed" | "failed" | "error" | "skipped"}`` from pytest's JUnit XML."""
    out = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        out[f"{case.get('classname', '')}::{case.get('name', '')}"] = outcome
    return dict(sorted(out.items()))


#: Suite modules whose tests the gate report lists one by one under ``checks``.
LISTED_SUITE_MODULES = ("test_image_tree_drift", "test_image_bridge")
#: Trees the gate digests inside the image: lock key -> folder holding megatron/.
IMAGE_TREES = {"base": "/opt/gdn/base", "patched": "/opt/gdn/tree"}


def image_tree_check(client, image_id: str, trees: dict) -> dict:
    """Digest both trees inside the image (its own /opt/gdn/bin/tree_digest.py) and compare
    them with the lock's ``trees`` (:func:`read_tree_lock`).

    Returns ``{"base": result, "patched": result}``, each as :func:`backport.tree_digest.check`
    returns it (``ok``, ``sha256``, ``want``, ``files``, ``first_difference``); a tree the
    script could not digest has ``ok`` False and an ``error``.
    """
    import docker

    script = " && ".join(f"python3 /opt/gdn/bin/tree_digest.py {path} --ids" for path in IMAGE_TREES.values())
    try:
        out = client.containers.run(image_id, ["sh", "-c", script], remove=True, network_mode="host",
                                    stderr=True).decode(errors="replace")
        seen = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    except (docker.errors.ContainerError, ValueError) as exc:
        err = str(exc).splitlines()[-1][:300] if str(exc) else type(exc).__name__
        return {which: {"ok": False, "error": f"tree_digest.py failed in the image: {err}"} for which in IMAGE_TREES}
    results = {}
    ids_by_tree = {"base": trees["tree_files"]["base"], "patched": td.patched_ids(trees["tree_files"])}
    for which, got in zip(IMAGE_TREES, seen):
        want = trees[f"{which}_tree_sha256"]
        first = None if got["sha256"] == want else td.first_difference(ids_by_tree[which], got["ids"])
        results[which] = {"ok": got["sha256"] == want, "sha256": got["sha256"], "want": want,
                          "files": got["files"], "where": IMAGE_TREES[which],
                          "first_difference": list(first) if first else None}
    for which in IMAGE_TREES:
        results.setdefault(which, {"ok": False, "error": "tree_digest.py printed no result"})
    return results


def tree_check_failure(check: dict) -> Optional[str]:
    """One line naming the first tree of :func:`image_tree_check` that is not the lock's, else None."""
    for which, result in check.items():
        if result.get("ok"):
            continue
        what = "pristine" if which == "base" else "patched"
        if "error" in result:
            return f"the image's {what} tree: {result['error']}"
        return f"in the image, {td.describe(result, what)} ({result['where']}/megatron)"
    return None


def run_gate(client, image_ref: str, gpus: Optional[bool] = None, on_line: Line = _quiet,
             pytest_args: Iterable[str] = (), timeout_s: int = 3600,
             environment: Optional[dict] = None, trees: Optional[dict] = None) -> dict:
    """Run the image's suite inside ``image_ref``; returns the report (never raises on test failures).

    First the trees: their digests, computed inside the image, must be the lock's ``trees``
    (:func:`read_tree_lock`; None skips this check and the report says so); a drift refuses the
    gate without running the suite. ``pytest_args`` are appended to the suite's command line and
    ``environment`` to the container's (tests use both to feed deliberately broken runs).
    """
    import docker

    image = client.images.get(image_ref)
    tree_check = image_tree_check(client, image.id, trees) if trees is not None else None
    drift = tree_check_failure(tree_check) if tree_check else None
    if drift:
        on_line(f"error: [tree-digest] {drift}")
        labels = image.labels or {}
        return {"ok": False, "reason": drift, "tree_check": tree_check,
                "image": {"id": image.id, "tags": sorted(image.tags), "flavour": labels.get("io.gdn.flavour")},
                "checks": _tree_checks(tree_check), "suite": {"part": "not run", "passed": 0, "failed": 0,
                                                              "errors": 0, "skipped": 0, "tests": 0,
                                                              "failing": [], "exit_code": None},
                "log_tail": [f"error: [tree-digest] {drift}"]}
    if tree_check:
        for which, result in tree_check.items():
            on_line(f"==> [tree-digest] {which} tree in the image ({result['where']}): sha256 "
                    f"{result['sha256'][:12]}, {result['files']} files, equals the lock's")
    use_gpus = host_has_gpus() if gpus is None else gpus
    device_requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if use_gpus else None
    out_dir = "/tmp/gdn-gate"
    t0 = time.monotonic()
    container = client.containers.create(
        image.id, command=["sh", "/opt/gdn/bin/run-suite.sh", out_dir, *pytest_args],
        network_mode="host", device_requests=device_requests, detach=True,
        environment={"PYTHONUNBUFFERED": "1", **(environment or {})})
    tail: deque = deque(maxlen=LOG_TAIL * 2)
    try:
        container.start()
        buf = ""
        for chunk in container.logs(stream=True, follow=True):
            buf += chunk.decode(errors="replace")
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                tail.append(line)
                on_line(line)
            if time.monotonic() - t0 > timeout_s:
                container.kill()
                break
        if buf:
            tail.append(buf)
            on_line(buf)
        exit_code = int(container.wait(timeout=60).get("StatusCode", -1))
        junit = _read_from_container(container, f"{out_dir}/junit.xml")
        capability = _read_from_container(container, "/opt/gdn/capability.json")
    finally:
        container.remove(force=True)
    seconds = round(time.monotonic() - t0, 1)
    labels = image.labels or {}
    cap = json.loads(capability) if capability else {}
    cases = {}
    if junit is None:
        counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
        ok, reason = False, f"the suite wrote no JUnit XML (pytest exited {exit_code})"
    else:
        counts = parse_junit(junit.decode(errors="replace"))
        ok, reason = gate_verdict(counts, exit_code)
        cases = junit_cases(junit.decode(errors="replace"))
    listed = [{"name": tid, "outcome": outcome} for tid, outcome in cases.items()
              if any(mod in tid for mod in LISTED_SUITE_MODULES)]
    return {
        "ok": ok,
        "reason": reason,
        "tree_check": tree_check if tree_check is not None else "skipped: no lock given",
        "checks": _tree_checks(tree_check) + listed,
        "image": {"id": image.id, "tags": sorted(image.tags), "flavour": labels.get("io.gdn.flavour")},
        "pins": {k[len("io.gdn.pin."):]: v for k, v in sorted(labels.items()) if k.startswith("io.gdn.pin.")},
        "patch_sha256": labels.get("io.gdn.patch.sha256"),
        "manifest_sha256": labels.get("io.gdn.manifest.sha256"),
        "versions": cap.get("versions", {}),
        "python": cap.get("python"),
        "gpus": use_gpus,
        "suite": {"part": "all" if use_gpus else "cpu", "exit_code": exit_code, "seconds": seconds,
                  "extra_args": list(pytest_args), "extra_env": dict(environment or {}), **counts},
        "log_tail": list(tail)[-LOG_TAIL:],
    }


def _tree_checks(tree_check: Optional[dict]) -> list:
    if not tree_check:
        return []
    return [{"name": f"tree-digest::{which} ({result.get('where', IMAGE_TREES[which])}) == lock "
                     f"{which}_tree_sha256", "outcome": "passed" if result.get("ok") else "failed"}
            for which, result in tree_check.items()]


def require_gate_ok(report: dict) -> None:
    """Raise :class:`GateFailed` (log tail included) unless the report passed.

    Raises :class:`TreeDrift` (exit 13) when the image's trees are not the lock's.
    """
    if report["ok"]:
        return
    if isinstance(report.get("tree_check"), dict) and tree_check_failure(report["tree_check"]):
        raise TreeDrift(f"image gate refused {report['image']['id'][:19]}: {report['reason']}")
    s = report["suite"]
    lines = [f"image gate refused {report['image']['id'][:19]}: {report['reason']}"]
    if s.get("failing"):
        lines.append("failing: " + ", ".join(s["failing"][:20]))
    lines.append(f"--- last {len(report['log_tail'])} lines of step suite:")
    lines += [f"  | {t}" for t in report["log_tail"]]
    raise GateFailed("\n".join(lines))


def write_json(path: Path, data: dict) -> Path:
    """The one JSON writer: sorted keys, indent 2, trailing newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- measure

def one_line_change(patch_text: str, note: str = "rebuild probe") -> str:
    """The patch with one added line changed (a comment gets ``note`` appended).

    Picks the first added comment line; without one, appends a comment line to the
    first hunk that creates a file (and fixes its header). The change keeps the
    patch applicable with zero fuzz.
    """
    lines = patch_text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("+") and not line.startswith("+++") and line[1:].lstrip().startswith("#"):
            body = line.rstrip("\n")
            lines[i] = f"{body} ({note})\n"
            return "".join(lines)
    for i, line in enumerate(lines):
        m = re.match(r"^@@ -0,0 \+1,(\d+) @@(.*)$", line.rstrip("\n"))
        if m:
            n = int(m.group(1))
            lines[i] = f"@@ -0,0 +1,{n + 1} @@{m.group(2)}\n"
            j = i + 1 + n
            lines.insert(j, f"+# {note}\n")
            return "".join(lines)
    raise InputError("the patch has no added comment line and no new file to change for the rebuild probe",
                     "Measure with a patch that adds at least one comment line.")
