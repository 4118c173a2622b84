"""The build: build args, OCI labels and tags, the staged context, the streamed classic build
(BuildTracker; a failure mapped to its error), and the one-line patch change `measure` rebuilds."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from backport import tree_digest as td

from .engine import LOG_TAIL, Line, _quiet
from .errors import BaseImageMissing, BuildStepFailed, DiskSpaceError, ImageError, InputError, TreeDrift
from .inputs import Flavour, Inputs, Preflight, read_tree_lock
from .lock import DEFAULT_FLA, FLA_SETS, target_for

FLA_PIN = DEFAULT_FLA
TRITON_PIN = FLA_SETS[DEFAULT_FLA].triton
IMAGE_REPO = "gdn-megatron"


# --------------------------------------------------------------------------- args, labels, tags

def build_args(flavour: Flavour, pre: Preflight, base_image: Optional[str] = None,
               fla: str = DEFAULT_FLA) -> dict[str, str]:
    """Build args of the Dockerfile (they also fill the OCI labels); ``fla`` picks the FLA set
    (:data:`image_pipeline.lock.FLA_SETS`) whose versions the capability check insists on."""
    return {
        "BASE_IMAGE": base_image or flavour.base_image,
        "TORCH_FROM": flavour.torch_from,
        "GDN_FLAVOUR": flavour.name,
        "FLA_VERSION": fla,
        "TRITON_VERSION": FLA_SETS[fla].triton,
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


def image_tags(flavour: Flavour, pre: Preflight, fla: str = DEFAULT_FLA) -> list[str]:
    """``gdn-megatron:<flavour>`` and ``gdn-megatron:<flavour>-<patch sha12>``; another FLA set
    than the default adds ``-fla<version digits>`` to the flavour (``gdn-megatron:cuda-fla052``)."""
    name = target_for(flavour.name, fla).key
    return [f"{IMAGE_REPO}:{name}", f"{IMAGE_REPO}:{name}-{pre.patch_sha256[:12]}"]


# --------------------------------------------------------------------------- context

CONTEXT_SCRIPTS = {"app/bin": ("apply-patch.sh", "capability_check.py", "run-suite.sh"),
                   "deps": ("install-deps.sh",)}
#: The one digest implementation, copied into the image (standard library only).
TREE_DIGEST_SCRIPT = Path(td.__file__)
#: The design decisions the manifest's reasons cite ("decision N"), shipped beside the manifest.
DECISIONS = Path(__file__).resolve().parent.parent / "docs" / "decisions.md"
#: The walkthrough's examples (docs/train-with-the-image.md), in the image at /opt/gdn/examples.
EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


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
    examples/ from docs/examples, bin/ with tree_digest.py), patch/ (patch, manifest.json, manifest.md when beside it,
    decisions.md from docs/, trees.json: the lock's tree fields, ``trees`` or read from
    ``inputs.tree_lock``).
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
    shutil.copytree(EXAMPLES, dest / "app" / "examples", symlinks=True, ignore=ignore)
    _copy(inputs.patch, dest / "patch" / "megatron.patch")
    _copy(inputs.manifest, dest / "patch" / "manifest.json")
    # For people reading the image: the manifest's Markdown view (beside the JSON, as tools/backport
    # writes it) and the design decisions its reasons cite.
    if inputs.manifest.with_suffix(".md").is_file():
        _copy(inputs.manifest.with_suffix(".md"), dest / "patch" / "manifest.md")
    _copy(DECISIONS, dest / "patch" / "decisions.md")
    (dest / "patch" / "trees.json").write_text(json.dumps(trees, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return dest


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
