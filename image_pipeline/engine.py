"""The Docker Engine: the docker-py client, one image command at a time per engine, Docker's root
and storage driver, free disk under it (floors by driver, DiskPeak), and the base image (present,
pulled, or made with debootstrap)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, Optional

from backport import locks
from backport.cache import default_cache_dir

from .errors import BaseImageMissing, BuildStepFailed, DiskSpaceError, DockerUnavailable, ImageError
from .inputs import CPU_BASE_IMAGE, REPO_ROOT

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("GDN_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the Dockerfile needs from a base: python3 (>= 3.10) with venv, and patch.
DEBOOTSTRAP_INCLUDE = ("python3", "python3-venv", "patch", "ca-certificates")
#: Log lines kept for an error or a report (the tail of a failing step or of the suite).
LOG_TAIL = 30

#: Progress callback of every stage: one log line at a time (the CLI prints them).
Line = Callable[[str], None]


def _quiet(_line: str) -> None:
    pass


# --------------------------------------------------------------------------- docker

def engine_lock_path(docker_host: Optional[str] = None) -> Path:
    """The lock file of one Docker Engine: ``<cache>/locks/docker-<sha256(host)[:12]>.lock`` in the
    tool's cache (``$GDN_BACKPORT_CACHE`` or ``~/.cache/gdn-backport``), so that every clone of the
    repository run by the user shares it. ``docker_host``: ``$DOCKER_HOST`` or the default socket."""
    host = docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    key = hashlib.sha256(host.encode("utf-8")).hexdigest()[:12]
    return default_cache_dir() / "locks" / f"docker-{key}.lock"


@contextlib.contextmanager
def engine_lock(say: Line = _quiet) -> Iterator[None]:
    """Hold the engine's lock for one image command (build, gate, measure, prune, base).

    A prune removes dangling images, and an image the legacy builder has made but not yet
    tagged is dangling: a prune during a build deleted the new image ("failed to get digest").
    So image commands run one at a time per engine; a second one waits, saying who holds it.

    Raises:
        BusyError: the lock is held and ``tools/image --no-wait`` was given (exit 15).
    """
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    with locks.hold(engine_lock_path(host), f"the Docker Engine at {host}", say=say):
        yield


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


# --------------------------------------------------------------------------- disk

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


# --------------------------------------------------------------------------- base image

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
