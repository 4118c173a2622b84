"""Resolve ``docker/requirements.in`` into the hash-pinned ``docker/requirements-<flavour>.lock``,
and check a lock without installing it.

The image installs its Python packages with ``pip install --require-hashes``. Each flavour has
its own lock, resolved for the Python and C library of its base image (:data:`TARGETS`):

* ``cpu``: CPython 3.11 on Debian bookworm (glibc 2.36), next to the cpu torch wheel, so the
  closure holds torch's own dependencies; torch itself comes from ``docker/torch-cpu.lock``.
* ``cuda``: CPython 3.12 on the NGC PyTorch 25.12 base (Ubuntu 24.04, glibc 2.39), with
  ``torch==2.10.0`` standing in for the base's ``2.10.0a0`` during resolution. What that base
  already provides is left out of the lock (:data:`BASE_PROVIDED`).

How "already provided by the CUDA base" is decided: the packages built against the base's own
torch/CUDA (torch, torchvision, Transformer Engine) and the CUDA runtime wheels that torch on
PyPI pulls in (``nvidia-*-cu12``/``-cu13``, ``cuda-toolkit``), which the base has as system
libraries, are not locked: installing them again would shadow the base's CUDA build. Every
other package is locked; the venv sees the base's site-packages (``--system-site-packages``),
so pip skips a locked package the base already holds at the locked version (installed once) and
installs the locked version into the venv where the base's differs (the lock is what runs).
triton is the one deliberate exception: FLA 0.4.2 needs 3.6.0, so the lock pins it.

The FLA axis (:data:`FLA_SETS`): the default set is FLA 0.4.2 / triton 3.6.0 (the locks above).
``--fla 0.5.2`` (cuda only) resolves FLA 0.5.2 with triton 3.7.1 into
``docker/requirements-cuda-fla052.lock``: FLA 0.5.x refuses its gated backward on Hopper with
triton >= 3.4.0, < 3.7.1 (FLA issue #640), and the base's torch 2.10 declares triton==3.6.0, so
that set locks torch 2.12.1 (which declares triton==3.7.1), torchvision and torch's CUDA runtime
wheels as well; they shadow the base's in the venv (:attr:`Target.own_torch`). The requirement
lines of the FLA axis in requirements.in are replaced by the set's pins (:func:`requirements_for`),
and every other package is held at the default cuda lock's version unless torch 2.12.1 refuses it
(:func:`held_pins`), so the two cuda images differ in the FLA axis and torch's closure only.

Resolution runs pip's resolver (``install --dry-run --report``) on an interpreter of the
target's Python version, because pip evaluates environment markers (``python_version >=
"3.12"``) with the running interpreter, not with ``--python-version``. Packages PyPI has only as
a source archive (:data:`SDIST_ONLY`, pure Python) are resolved through a wheel built locally
from that archive; the lock pins the archive's sha256, and pip builds it in the image.

:func:`check_lock` is what CI runs (``tools/image check-lock``): pip's dry run of the lock for
the target platform with ``--require-hashes`` (every pin exists for that Python and platform,
with a hash the lock lists), then a closure check on pip's report (every dependency each pinned
package declares, markers evaluated for the target, is met by a pin or by :data:`BASE_PROVIDED`).

Needs PyPI; the unit tests run only the pure helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from .errors import ImageError, InputError

INDEX_URL = "https://pypi.org/simple"


#: The FLA version of the default image (the committed locks ``requirements-<flavour>.lock``).
DEFAULT_FLA = "0.4.2"


@dataclass(frozen=True)
class FlaSet:
    """One FLA version of the image and what it is locked with."""

    fla: str
    triton: str
    #: Why this triton (written into the lock's header).
    why: str
    #: The FLA distributions the set pins at ``fla``. FLA 0.6.0's set pins fla-core alone:
    #: flash-linear-attention 0.6.0 (``fla.layers``, ``fla.models``: FLA's Hugging Face model
    #: classes, which neither the patched tree nor Bridge imports) requires transformers>=5.6.2,
    #: and Megatron-Bridge 2faedbf6 requires transformers<=5.6.0, so pip cannot install both.
    packages: tuple = ("flash-linear-attention", "fla-core")


#: The selectable FLA versions (``tools/image lock/check-lock/build --fla``, ``make image FLA=``).
FLA_SETS = {
    "0.4.2": FlaSet("0.4.2", "3.6.0", "triton 3.9 breaks `import fla` 0.4.2; 3.6.0 works"),
    "0.5.2": FlaSet("0.5.2", "3.7.1", "FLA 0.5.x refuses its gated backward on Hopper with triton >= 3.4.0, "
                                      "< 3.7.1: FLA issue #640"),
    "0.6.0": FlaSet("0.6.0", "3.7.1", "FLA 0.6.0 still refuses its gated backward on Hopper with triton >= 3.4.0, "
                                      "< 3.7.1: FLA issue #640", packages=("fla-core",)),
}
#: The requirement names the FLA axis replaces in requirements.in.
FLA_AXIS = ("flash-linear-attention", "fla-core", "triton")


@dataclass(frozen=True)
class Target:
    """A lock's target: Python version, highest manylinux glibc, the torch it resolves next to,
    and the FLA set it holds."""

    flavour: str
    python: str
    glibc: tuple
    torch: str  # a pip requirement for resolution; written to the lock only when own_torch
    base: str
    fla: str = DEFAULT_FLA
    #: True when the lock holds torch, torchvision and torch's CUDA runtime wheels itself (they
    #: shadow the base's in the venv): the FLA set needs a triton the base's torch does not declare.
    own_torch: bool = False

    @property
    def key(self) -> str:
        """``cuda``, ``cpu``, or ``cuda-fla052`` for a non-default FLA set (names the lock file)."""
        if self.fla == DEFAULT_FLA:
            return self.flavour
        return f"{self.flavour}-fla{self.fla.replace('.', '')}"

    @property
    def triton(self) -> str:
        """The triton version the FLA set pins."""
        return FLA_SETS[self.fla].triton

    @property
    def platforms(self) -> list:
        """pip ``--platform`` tags, highest first (pip does not expand a manylinux tag itself)."""
        major, minor = self.glibc
        return ([f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
                + ["manylinux2014_x86_64", "linux_x86_64"])

    @property
    def environment(self) -> dict:
        """PEP 508 marker environment of the target (for the closure check)."""
        return {"python_version": self.python, "python_full_version": f"{self.python}.0",
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                "os_name": "posix", "platform_release": "", "platform_version": "", "extra": ""}


_CUDA_BASE = "nvcr.io/nvidia/pytorch:25.12-py3 (Ubuntu 24.04, glibc 2.39, torch 2.10.0a0)"
#: The default (FLA 0.4.2) target of each flavour.
TARGETS = {
    "cpu": Target("cpu", "3.11", (2, 36), "{cpu_torch_wheel}", "gdn-base:bookworm (Debian 12, glibc 2.36)"),
    "cuda": Target("cuda", "3.12", (2, 39), "torch==2.10.0", _CUDA_BASE),
}
#: Targets of the other FLA sets, by (flavour, fla). torch 2.12.1 is the first torch that declares
#: triton==3.7.1 (2.10.0 and 2.11.0 declare 3.6.0; 2.13 declares 3.7.1 too, 2.14 3.8.0). FLA 0.6.0
#: declares only torch>=2.7.0, triton>=3.3 and keeps the Hopper rule of #640, so it takes the
#: same torch and triton as 0.5.2: the two sets differ in FLA (and transformers) only.
FLA_TARGETS = {
    ("cuda", "0.5.2"): Target("cuda", "3.12", (2, 39), "torch==2.12.1", _CUDA_BASE, fla="0.5.2", own_torch=True),
    ("cuda", "0.6.0"): Target("cuda", "3.12", (2, 39), "torch==2.12.1", _CUDA_BASE, fla="0.6.0", own_torch=True),
}


def target_for(flavour: str, fla: str = DEFAULT_FLA) -> Target:
    """The lock target of ``flavour`` with FLA ``fla``; raises :class:`InputError` (exit 13) for a pair
    that has no lock (the names of those that do, in the message)."""
    if fla == DEFAULT_FLA:
        return TARGETS[flavour]
    if (flavour, fla) in FLA_TARGETS:
        return FLA_TARGETS[(flavour, fla)]
    have = ", ".join([f"{f} (FLA {DEFAULT_FLA})" for f in sorted(TARGETS)]
                     + [f"{f} (FLA {v})" for f, v in sorted(FLA_TARGETS)])
    raise InputError(f"no lock for the {flavour} flavour with FLA {fla}; locks exist for: {have}",
                     f"Pick one of those (FLA {fla} is for the cuda flavour only; the cpu gate image stays on "
                     f"FLA {DEFAULT_FLA}).")

#: What each flavour's base brings (name -> version, or "" where not recorded): never locked;
#: the closure check counts a requirement on one as met. cuda: NGC PyTorch 25.12 release notes
#: (torch 2.10.0a0+b4e4ee81d3, CUDA 13.1); its torchvision and Transformer Engine are built
#: against that torch, so they are the base's too.
BASE_PROVIDED = {
    "cpu": {"torch": "2.13.0"},
    "cuda": {"torch": "2.10.0a0", "torchvision": "", "transformer-engine": "", "transformer-engine-torch": "",
             "transformer-engine-cu12": "", "transformer-engine-cu13": ""},
}
#: CUDA runtime wheels (torch's PyPI dependencies) and the CUDA Python bindings, both tied to a
#: CUDA version: the base has CUDA 13.1 as system libraries, with its own bindings.
_CUDA_RUNTIME = re.compile(r"^(nvidia-[a-z0-9-]+-cu1[0-9]|cuda-toolkit|cuda-bindings|cuda-python)$")
#: Of those, the ones the lock keeps: Python packages, not the CUDA runtime.
_CUDA_KEEP = frozenset({"nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13"})

#: Packages PyPI ships only as a source archive (pure Python): resolved through a locally built
#: wheel, locked with the archive's sha256. hydra-core 1.3.2 / omegaconf 2.3 need antlr4 4.9.*.
SDIST_ONLY = {"antlr4-python3-runtime": "4.9.3"}

_HEADER = """\
# Generated by `tools/image lock --flavour {flavour}{fla_flag}` from docker/requirements.in; do not edit by hand.
# Every package of the closure for the {flavour} image, pinned with ==, with the sha256 of each
# file pip may pick for CPython {python} on linux x86_64 (manylinux up to glibc {glibc}).
# Base: {base}. Not here, because the base brings it: {provided}.
{own_torch}# The Dockerfile installs this file with `pip install --require-hashes`.
"""
_OWN_TORCH_NOTE = """\
# FLA {fla} set: {packages} {fla}, triton {triton}, in place of the FLA
# lines of requirements.in ({why}).
{without}# The base's torch declares another triton, so this lock holds {torch} (it declares
# triton=={triton}), torchvision and torch's CUDA runtime wheels; in the venv they shadow the base's.
# The base's Transformer Engine is built for the base's torch. Every other package is held at
# docker/requirements-{flavour}.lock's version where torch and FLA accept it.
"""


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: Packages a flavour cannot hold at all (name -> why); never locked, and a requirement on one
#: counts as met (the requiring package imports without it, or is named in docs/image-build-and-gate.md).
UNAVAILABLE = {
    "cpu": {"torchvision": "PyPI's torchvision is built against CUDA torch and does not load with the cpu "
                           "torch (torchvision::nms missing), which breaks `import transformers`; the cpu "
                           "build is on download.pytorch.org only"},
    "cuda": {},
}


#: What a target that locks its own torch (:attr:`Target.own_torch`) takes from the base all the same.
_OWN_TORCH_LOCKS = frozenset({"torch", "torchvision"})


def provided_by_base(target) -> dict:
    """:data:`BASE_PROVIDED` of ``target`` (a :class:`Target` or a flavour name), less torch and
    torchvision where the target locks its own."""
    if isinstance(target, str):
        return BASE_PROVIDED[target]
    provided = BASE_PROVIDED[target.flavour]
    if target.own_torch:
        provided = {n: v for n, v in provided.items() if n not in _OWN_TORCH_LOCKS}
    return provided


def base_provided(flavour, name: str) -> bool:
    """True when ``name`` comes with the base image of ``flavour`` (a flavour name or a
    :class:`Target`), or cannot be installed there (:data:`UNAVAILABLE`), and is never locked.

    A target with :attr:`Target.own_torch` locks torch, torchvision and the CUDA runtime wheels.
    """
    target = flavour
    flavour = target if isinstance(target, str) else target.flavour
    name = canonical(name)
    if name in provided_by_base(target) or name in UNAVAILABLE[flavour]:
        return True
    if not isinstance(target, str) and target.own_torch:
        return False
    return flavour == "cuda" and bool(_CUDA_RUNTIME.match(name)) and name not in _CUDA_KEEP


@dataclass
class LockEntry:
    """One pinned package of the lock."""

    name: str
    version: str
    hashes: set[str] = field(default_factory=set)


def parse_report(report: dict, flavour="cpu") -> dict[str, LockEntry]:
    """Pins from a ``pip install --dry-run --report`` document, keyed by canonical name.

    Leaves out what the base of ``flavour`` (a flavour name or a :class:`Target`) provides
    (:func:`base_provided`).
    """
    entries: dict[str, LockEntry] = {}
    for item in report.get("install", []):
        meta = item["metadata"]
        name = canonical(meta["name"])
        if base_provided(flavour, name):
            continue
        entry = entries.setdefault(name, LockEntry(name, meta["version"]))
        digest = item.get("download_info", {}).get("archive_info", {}).get("hashes", {})
        if "sha256" in digest and name not in SDIST_ONLY:  # a locally built wheel's hash is not PyPI's
            entry.hashes.add(digest["sha256"])
    return entries


def render_lock(entries: Iterable[LockEntry], target: Optional[Target] = None) -> str:
    """The lock text: sorted by name, hashes sorted, one continuation line per hash."""
    target = target or TARGETS["cpu"]
    provided = sorted(provided_by_base(target))
    provided += [f"{n} (cannot be installed: {why})" for n, why in sorted(UNAVAILABLE[target.flavour].items())]
    if target.flavour == "cuda" and not target.own_torch:
        provided.append("the CUDA runtime wheels (nvidia-*-cu12/-cu13) and bindings (cuda-bindings)")
    own = ""
    if target.own_torch:
        fla_set = FLA_SETS[target.fla]
        without = "" if "flash-linear-attention" in fla_set.packages else (
            "# Without flash-linear-attention (FLA's model classes, imported by neither the tree nor Bridge):\n"
            f"# flash-linear-attention {target.fla} requires transformers>=5.6.2, Megatron-Bridge <=5.6.0.\n")
        own = _OWN_TORCH_NOTE.format(fla=target.fla, triton=fla_set.triton, why=fla_set.why, torch=target.torch,
                                     flavour=target.flavour, packages=" and ".join(fla_set.packages),
                                     without=without)
    fla_flag = "" if target.fla == DEFAULT_FLA else f" --fla {target.fla}"
    out = [_HEADER.format(flavour=target.flavour, fla_flag=fla_flag, python=target.python,
                          glibc=".".join(map(str, target.glibc)), base=target.base, provided=", ".join(provided),
                          own_torch=own)]
    for entry in sorted(entries, key=lambda e: e.name):
        if not entry.hashes:
            raise ImageError(f"lock: no hash for {entry.name}=={entry.version}",
                             "Re-run `tools/image lock`; PyPI must list a file for it.")
        lines = [f"{entry.name}=={entry.version}"]
        lines += [f"--hash=sha256:{h}" for h in sorted(entry.hashes)]
        out.append(" \\\n    ".join(lines) + "\n")
    return "".join(out)


_LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def parse_lock(text: str) -> dict[str, LockEntry]:
    """Read a lock written by :func:`render_lock` (or any ``--hash`` requirements file)."""
    entries: dict[str, LockEntry] = {}
    current: LockEntry | None = None
    for raw in text.splitlines():
        line = raw.strip().rstrip("\\").strip()
        if not line or line.startswith("#"):
            continue
        match = _LOCK_LINE.match(line)
        if match:
            current = LockEntry(canonical(match.group(1)), match.group(2))
            entries[current.name] = current
            line = line[match.end():].strip()
        for token in line.split():
            if token.startswith("--hash=sha256:") and current is not None:
                current.hashes.add(token.split(":", 1)[1])
    return entries


# --------------------------------------------------------------------------- pip

def find_python(version: str) -> str:
    """An interpreter of CPython ``version`` (``GDN_PYTHON_<major>_<minor>``, ``pythonX.Y`` on PATH,
    or a pyenv version). Raises :class:`ImageError` when none is found."""
    env = os.environ.get(f"GDN_PYTHON_{version.replace('.', '_')}")
    if env:
        return env
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    if found:
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob(f"{version}.*"), reverse=True):
        if (candidate / "bin" / "python").exists():
            return str(candidate / "bin" / "python")
    raise ImageError(f"lock: no CPython {version} interpreter found (pip evaluates environment markers with the "
                     "interpreter it runs on)",
                     f"Install python{version}, or point GDN_PYTHON_{version.replace('.', '_')} at one, "
                     "then run the same command again.")


def _pip(python: str, args: list[str]) -> str:
    cmd = [python, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    result = subprocess.run(cmd, capture_output=True, encoding="utf-8")
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
        raise ImageError(f"lock: `pip {args[0]}` failed:\n{tail}",
                         "Check that PyPI is reachable and the pins exist for the target, then run the "
                         "same command again.")
    return result.stdout


def _target_flags(target: Target, only_binary: bool = True) -> list[str]:
    flags = ["--implementation", "cp", "--python-version", target.python, "--index-url", INDEX_URL]
    if only_binary:
        flags.insert(0, "--only-binary=:all:")
    for platform in target.platforms:
        flags += ["--platform", platform]
    return flags


def _sdist_wheels(python: str, work: Path) -> Path:
    """Build a wheel of each :data:`SDIST_ONLY` package into ``work/sdist-wheels`` (resolution only)."""
    dest = work / "sdist-wheels"
    dest.mkdir(parents=True, exist_ok=True)
    _pip(python, ["wheel", "--no-deps", "--quiet", "--index-url", INDEX_URL, "-w", str(dest),
                  *[f"{n}=={v}" for n, v in sorted(SDIST_ONLY.items())]])
    return dest


def requirements_for(requirements_in: Path, target: Target) -> list[str]:
    """The requirement lines ``target`` resolves: those of ``requirements_in`` (comments dropped),
    with the lines of the FLA axis (:data:`FLA_AXIS`) replaced by the target's FLA set."""
    lines = requested_requirements(requirements_in)
    if target.fla == DEFAULT_FLA:
        return lines
    from packaging.requirements import Requirement

    kept = [line for line in lines if canonical(Requirement(line).name) not in FLA_AXIS]
    fla_set = FLA_SETS[target.fla]
    return kept + [f"{name}=={fla_set.fla}" for name in fla_set.packages] + [f"triton=={fla_set.triton}"]


def held_pins(default_lock: dict[str, LockEntry], target: Target, torch_requires: Iterable[str]) -> list[str]:
    """``name==version`` constraints that hold a non-default FLA set's lock at the default lock's
    versions: every pin of ``default_lock`` but the FLA axis, torch, torchvision, what the
    default target takes from the base, and a pin that the target's torch or its FLA set does not
    accept (``torch_requires``: the ``Requires-Dist`` of torch, flash-linear-attention and fla-core,
    markers evaluated for the target; e.g. FLA 0.6.0's ``transformers>=5.6.2`` releases the default
    lock's transformers 5.6.0)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    refused: dict[str, list] = {}
    for text in torch_requires:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate(target.environment):
            continue
        refused.setdefault(canonical(req.name), []).append(req.specifier)
    default = TARGETS[target.flavour]
    out = []
    for name, entry in sorted(default_lock.items()):
        if name in FLA_AXIS or name in _OWN_TORCH_LOCKS or base_provided(default, name):
            continue
        if any(not spec.contains(Version(entry.version), prereleases=True) for spec in refused.get(name, [])):
            continue
        out.append(f"{name}=={entry.version}")
    return out


def _torch_requires(python: str, target: Target, work: Path) -> list[str]:
    """``Requires-Dist`` of the target's torch and of its FLA set's two packages (pip's metadata
    of them, nothing installed): what :func:`held_pins` must not hold against."""
    report = work / "torch-report.json"
    fla_set = FLA_SETS[target.fla]
    _pip(python, ["install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report", str(report),
                  "--target", str(work / "torch-target"), *_target_flags(target), target.torch,
                  *[f"{name}=={fla_set.fla}" for name in fla_set.packages]])
    items = json.loads(report.read_text(encoding="utf-8")).get("install", [])
    return [text for item in items for text in item["metadata"].get("requires_dist") or []]


def resolve(requirements_in: Path, target: Target, work: Path, torch_wheel: Optional[Path] = None) -> dict:
    """Resolve the inputs for ``target`` on an interpreter of its Python; returns the entries.

    A non-default FLA set is resolved with the default lock of its flavour as constraints
    (:func:`held_pins`), so the two images differ in the FLA axis and torch's closure only.
    """
    python = find_python(target.python)
    torch = str(torch_wheel) if target.flavour == "cpu" else target.torch
    report = work / "report.json"
    reqs = work / "requirements.txt"
    reqs.write_text("".join(f"{line}\n" for line in requirements_for(requirements_in, target)), encoding="utf-8")
    constraints = []
    if target.fla != DEFAULT_FLA:
        default_lock = requirements_in.parent / f"requirements-{TARGETS[target.flavour].key}.lock"
        held = held_pins(parse_lock(default_lock.read_text(encoding="utf-8")), target,
                         _torch_requires(python, target, work))
        (work / "held.txt").write_text("".join(f"{line}\n" for line in held), encoding="utf-8")
        constraints = ["-c", str(work / "held.txt")]
    _pip(python, ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                  "--target", str(work / "target"), "--find-links", str(_sdist_wheels(python, work)),
                  *_target_flags(target), "-r", str(reqs), *constraints, torch])
    return parse_report(json.loads(report.read_text(encoding="utf-8")), target)


def download_hashes(entries: dict[str, LockEntry], target: Target, work: Path) -> None:
    """Download every pinned file for the target and record the sha256 of its bytes."""
    python = find_python(target.python)
    pins = work / "pins.txt"
    pins.write_text("".join(f"{e.name}=={e.version}\n" for e in entries.values() if e.name not in SDIST_ONLY),
                    encoding="utf-8")
    index_hashes = {name: set(e.hashes) for name, e in entries.items()}
    for entry in entries.values():
        entry.hashes.clear()
    dest = work / f"files-{target.flavour}"
    _pip(python, ["download", "--no-deps", "--quiet", "--dest", str(dest), *_target_flags(target), "-r", str(pins)])
    sdists = [f"{n}=={entries[n].version}" for n in SDIST_ONLY if n in entries]
    if sdists:
        _pip(python, ["download", "--no-deps", "--no-binary=:all:", "--quiet", "--dest", str(dest),
                      "--index-url", INDEX_URL, *sdists])
    for path in sorted(dest.iterdir()):
        name = canonical(re.split(r"-\d", path.name, 1)[0])
        if name not in entries:
            raise ImageError(f"lock: pip downloaded {path.name}, which is not pinned",
                             "Report this; the resolver and the download disagree.")
        entries[name].hashes.add(hashlib.sha256(path.read_bytes()).hexdigest())
    for name, expected in index_hashes.items():
        if expected and not expected & entries[name].hashes:
            raise ImageError(f"lock: downloaded {name} does not match the index's sha256",
                             "Re-run `tools/image lock`; a mismatch twice means a bad mirror.")
    missing = sorted(n for n, e in entries.items() if not e.hashes)
    if missing:
        raise ImageError(f"lock: nothing downloaded for {', '.join(missing)}",
                         "Pin a version that ships a file for the target Python and platform.")


def write_lock(requirements_in: Path, target: Target, lock_path: Path,
               torch_wheel: Optional[Path] = None) -> dict[str, LockEntry]:
    """Resolve, download, hash and write ``lock_path`` for ``target``; returns the entries."""
    with tempfile.TemporaryDirectory(prefix="gdn-lock-") as tmp:
        work = Path(tmp)
        entries = resolve(requirements_in, target, work, torch_wheel)
        download_hashes(entries, target, work)
    lock_path.write_text(render_lock(entries.values(), target), encoding="utf-8")
    return entries


# --------------------------------------------------------------------------- check

def unmet_requirements(report: dict, target: Target, requested: Iterable[str] = ()) -> list[str]:
    """Dependencies declared by the packages of a pip report that nothing in it (or the base) meets.

    ``report``: pip's ``--report`` of a ``--no-deps`` dry run of the lock. Each package's
    ``Requires-Dist`` is evaluated with the target's marker environment, with the extras that
    ``requested`` (requirement strings, e.g. from requirements.in) or other packages ask of it.

    Also checks each package's ``Requires-Python`` against the target's Python.

    Returns:
        ``"<package> needs <requirement> (<what is there>)"`` (or ``"... requires Python ..."``)
        lines, sorted; empty when the lock is a closed set for the target.
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    from packaging.specifiers import SpecifierSet

    have = {canonical(i["metadata"]["name"]): i["metadata"] for i in report.get("install", [])}
    provided = provided_by_base(target)
    problems: set[str] = set()
    for name, meta in have.items():
        wants = meta.get("requires_python")
        if wants and not SpecifierSet(wants).contains(f"{target.python}.0", prereleases=True):
            problems.add(f"{name} {meta['version']} requires Python {wants} (the target has {target.python})")
    extras: dict[str, set] = {}
    for text in requested:
        req = Requirement(text)
        extras.setdefault(canonical(req.name), set()).update(req.extras)
    changed = True
    while changed:  # extras asked by a package's own requirements can enable more requirements
        changed = False
        for name, meta in have.items():
            for text in meta.get("requires_dist") or []:
                req = Requirement(text)
                asked = extras.get(name, set()) | {""}
                env = dict(target.environment)
                if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in asked):
                    continue
                dep = canonical(req.name)
                before = len(extras.get(dep, set()))
                extras.setdefault(dep, set()).update(req.extras)
                changed |= len(extras[dep]) != before
                if dep in have:
                    if not req.specifier.contains(Version(have[dep]["version"]), prereleases=True):
                        problems.add(f"{name} needs {req} (the lock has {have[dep]['version']})")
                elif base_provided(target, dep):
                    version = provided.get(dep, "")
                    if version and not req.specifier.contains(Version(version), prereleases=True):
                        problems.add(f"{name} needs {req} (the base has {version})")
                else:
                    problems.add(f"{name} needs {req} (not in the lock, not in the base)")
    return sorted(problems)


def requested_requirements(requirements_in: Path) -> list[str]:
    """The requirement lines of ``requirements_in`` (comments and blank lines dropped)."""
    out = []
    for raw in requirements_in.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def refuse_not_a_lock(lock_path: Path) -> dict[str, LockEntry]:
    """The pins of ``lock_path`` when it is a hash-pinned requirements lock (every pin
    ``name==version`` with at least one ``--hash=sha256:``); checked before pip runs, so that a
    wrong file is named as such and never blamed on PyPI.

    Raises:
        InputError: the file cannot be read as text, holds no pin, or a pin has no hash (exit 13).
    """
    hint = ("Pass --lock a requirements lock (docker/requirements-<flavour>[-fla052].lock, written by "
            "`tools/image lock`), or leave --lock out to check the flavour's own.")
    try:
        entries = parse_lock(lock_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{lock_path} is not a requirements lock: it cannot be read as text ({exc})", hint=hint) from exc
    if not entries:
        raise InputError(f"{lock_path} is not a requirements lock: it holds no `name==version --hash=sha256:...` pin",
                         hint=hint)
    bare = sorted(name for name, e in entries.items() if not e.hashes)
    if bare:
        raise InputError(f"{lock_path} is not a requirements lock: {len(bare)} pins have no --hash "
                         f"({', '.join(bare[:3])}{' ...' if len(bare) > 3 else ''})", hint=hint)
    return entries


def _dry_run(lock_path: Path, target: Target, python: str) -> dict:
    """pip's report of a ``--no-deps --require-hashes`` dry run of ``lock_path`` for ``target``."""
    with tempfile.TemporaryDirectory(prefix="gdn-lock-check-") as tmp:
        report = Path(tmp) / "report.json"
        # --ignore-requires-python: pip checks Requires-Python against the interpreter it runs on,
        # not --python-version; unmet_requirements checks it against the target instead.
        _pip(python, ["install", "--dry-run", "--ignore-installed", "--no-deps", "--require-hashes", "--quiet",
                      "--ignore-requires-python",
                      "--report", str(report), "--target", str(Path(tmp) / "target"),
                      *_target_flags(target, only_binary=False), "-r", str(lock_path)])
        return json.loads(report.read_text(encoding="utf-8"))


def _verify(data: dict, lock_path: Path, target: Target, requirements_in: Optional[Path], **extra) -> dict:
    """The closure and FLA-set checks of :func:`check_lock` on pip's report ``data``."""
    requested = requirements_for(requirements_in, target) if requirements_in else []
    unmet = unmet_requirements(data, target, requested)
    pins = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in data.get("install", [])}
    fla_set = FLA_SETS[target.fla]
    wants = [(name, target.fla if name in fla_set.packages else None) for name in FLA_AXIS if name != "triton"]
    wrong = [f"{name}=={pins.get(name)} (the FLA {target.fla} set " + (f"pins {want})" if want else "leaves it out)")
             for name, want in wants + [("triton", target.triton)] if pins.get(name) != want]
    if wrong:
        raise ImageError(f"lock {lock_path} does not hold the FLA {target.fla} set: {', '.join(wrong)}",
                         f"Regenerate it with `tools/image lock --flavour {target.flavour} --fla {target.fla}`, "
                         "then check again.")
    result = {"flavour": target.flavour, "fla": target.fla, "triton": target.triton,
              "packages": len(data.get("install", [])), "python": target.python,
              "platforms": f"{target.platforms[0]} .. {target.platforms[-1]}", "unmet": unmet, **extra}
    if unmet:
        raise ImageError(f"lock {lock_path} is not a closed set for {target.flavour} (CPython {target.python}):\n"
                         + "\n".join(f"  {u}" for u in unmet),
                         f"Regenerate it with `tools/image lock --flavour {target.flavour} --fla {target.fla}`, "
                         "then check again.")
    return result


def check_lock(lock_path: Path, target: Target, requirements_in: Optional[Path] = None,
               python: Optional[str] = None) -> dict:
    """Prove that ``lock_path`` installs for ``target`` without installing it (CI).

    1. pip's dry run, ``--no-deps --require-hashes`` for the target's Python and platform: every
       pin has a file for it whose sha256 the lock lists.
    2. :func:`unmet_requirements` on pip's report: the lock plus the base is a closed set; the
       lock holds the target's FLA set (flash-linear-attention, fla-core, triton).

    Returns ``{"flavour", "fla", "triton", "packages", "python", "platforms", "unmet"}``; raises
    :class:`ImageError` when pip refuses the lock, a requirement is unmet or the FLA set differs.
    """
    refuse_not_a_lock(lock_path)
    return _verify(_dry_run(lock_path, target, python or sys.executable), lock_path, target, requirements_in)


def check_locks(checks: list[tuple[Path, Target]], requirements_in: Optional[Path] = None,
                python: Optional[str] = None) -> list[dict]:
    """:func:`check_lock` for several locks of one Python and platform (the cuda FLA sets), with
    one full dry run: the first lock's; each other lock dry-runs only its pins that no lock
    before it holds identically (same version, same hashes: the 0.6.0 lock takes torch's closure
    from the 0.5.2 lock's run), and its closure check reads the earlier reports for the rest. pip's result for an identical pin on the same target is the same,
    so this proves what separate runs would, downloading the shared files once.

    Returns one result per lock (with ``"shared"``: pins taken from the first report).
    """
    python = python or sys.executable
    for path, _target in checks:
        refuse_not_a_lock(path)
    (first_path, first), rest = checks[0], checks[1:]
    for _path, target in rest:
        if (target.python, target.platforms) != (first.python, first.platforms):
            raise ImageError(f"check-lock: {target.key} and {first.key} have other Pythons or platforms",
                             "Check them one at a time (`tools/image check-lock --flavour F --fla V`).")
    first_data = _dry_run(first_path, first, python)
    results = [_verify(first_data, first_path, first, requirements_in, shared=0)]
    # pins already dry-run (by name, version and hashes) -> pip's report item for them
    known = {}

    def remember(lock, items):
        for item in items:
            entry = lock.get(canonical(item["metadata"]["name"]))
            if entry is not None:
                known[(entry.name, entry.version, frozenset(entry.hashes))] = item

    remember(parse_lock(first_path.read_text(encoding="utf-8")), first_data.get("install", []))
    for path, target in rest:
        lock = parse_lock(path.read_text(encoding="utf-8"))
        key = {n: (e.name, e.version, frozenset(e.hashes)) for n, e in lock.items()}
        shared = {n for n in lock if key[n] in known}
        own = [e for n, e in lock.items() if n not in shared]
        items = [known[key[n]] for n in sorted(shared)]
        if own:
            with tempfile.TemporaryDirectory(prefix="gdn-lock-own-") as tmp:
                own_path = Path(tmp) / path.name
                own_path.write_text(render_lock(own, target), encoding="utf-8")
                own_items = _dry_run(own_path, target, python).get("install", [])
            remember(lock, own_items)
            items += own_items
        results.append(_verify({"install": items}, path, target, requirements_in, shared=len(shared)))
    return results
