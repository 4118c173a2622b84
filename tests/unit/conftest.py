"""Fixtures of the engine unit tests: throwaway fake upstream repositories, recipes, env.

Every repository is built with a fixed identity and fixed dates under ``TZ=UTC``, so its
commit SHAs are the same on every run (``test_engine_sources`` checks that). Nothing here
touches the network: sources are local paths.

The fixtures are opt-in (no autouse) so that the other suites sharing this directory are
not affected; engine test modules use ``pytestmark = pytest.mark.usefixtures("engine_env")``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

DATA = Path(__file__).resolve().parent / "data"


def default_signals() -> None:
    """``preexec_fn`` of every child a test sends a signal to: SIGINT and SIGTERM at their default
    disposition, whatever the test run inherited (``nohup``, ``&`` in a non-interactive shell and
    ``trap "" INT`` start it with SIGINT ignored, and a child inherits an ignored disposition: the
    tool, honouring it, would never see the test's ^C)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
#: ``--python`` for runs that must run every check (a lock is written only then): see data/stub_python
STUB_PYTHON = str(DATA / "stub_python")

GIT_ENV = {
    "GIT_AUTHOR_NAME": "A U Thor", "GIT_AUTHOR_EMAIL": "author@example.com",
    "GIT_COMMITTER_NAME": "C O Mitter", "GIT_COMMITTER_EMAIL": "committer@example.com",
    "GIT_AUTHOR_DATE": "2005-04-07T22:13:13Z", "GIT_COMMITTER_DATE": "2005-04-07T22:13:13Z",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "TZ": "UTC",
}
IDENT_TIME = "1112911993 +0000"  # 2005-04-07T22:13:13Z


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    """Run git in ``cwd`` with the fixed identity and dates; return stdout."""
    env = {**os.environ, **GIT_ENV}
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, input=input)
    return proc.stdout.decode()


def write_files(root: Path, files: dict[str, str | None]) -> None:
    """Write (or, for None, delete) ``path -> text`` under ``root``."""
    for rel, text in files.items():
        path = root / rel
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def commit(root: Path, files: dict[str, str | None], message: str) -> str:
    """Write ``files``, commit everything, return the full SHA."""
    write_files(root, files)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD").strip()


def init_repo(root: Path) -> Path:
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    return root


def git_diff(tmp: Path, before: dict[str, str], after: dict[str, str | None]) -> str:
    """A ``git diff`` (a/ b/ prefixes) taking the files ``before`` to ``after``."""
    repo = init_repo(tmp)
    commit(repo, before, "before")
    write_files(repo, after)
    git(repo, "add", "-A")
    return git(repo, "diff", "--cached", "--no-color", "--full-index", "--src-prefix=a/", "--dst-prefix=b/")


def commit_sha(tree: str, parent: str, message: str) -> tuple[str, bytes]:
    """(SHA, raw body) of a commit object with the fixed identity (computed, not written)."""
    body = (f"tree {tree}\nparent {parent}\n"
            f"author A U Thor <author@example.com> {IDENT_TIME}\n"
            f"committer C O Mitter <committer@example.com> {IDENT_TIME}\n\n{message}\n").encode()
    return hashlib.sha1(b"commit %d\0" % len(body) + body).hexdigest(), body


# --- contents of the fake Megatron-LM ------------------------------------------------------

def _utils(prefix: str = "", alpha: str = "value += 1", omega: str = "return total") -> str:
    filler = "".join(f"\n\ndef helper_{i}():\n    return {i}\n" for i in range(4))
    return (
        '"""Utility stand-ins (test data)."""\n'
        + prefix
        + "\n\ndef alpha():\n    value = 0\n    " + alpha + "\n    value *= 2\n    return value\n"
        + filler
        + "\n\ndef omega(items):\n    total = 0\n    for item in items:\n        total += item\n    " + omega + "\n"
    )


PACKED = '"""Packed-sequence stand-in (test data)."""\n\n\nclass PackedSeqParams:\n    cp_group = None\n'
RESOLVE = '\n\ndef resolve_cp_group(params, default):\n    """Pick the CP group of a micro-batch."""\n    return params.cp_group or default\n'
LAYOUT = '"""Layout stand-in added by the fake upstream commit."""\n\n\ndef zigzag_to_contiguous_chunks(x):\n    return x\n'
EXTRAS = '"""Extras stand-in (test data)."""\n\nENABLED = True\n'


def gdn_text(upstream: bool = False) -> str:
    text = (DATA / "gated_delta_net.py").read_text()
    if upstream:
        text = text.replace("cp_size = cp_group.size()\n", "cp_size = 1 if cp_group is None else cp_group.size()\n")
    return text


@dataclass(frozen=True)
class FakeRepos:
    """The two fake upstream repositories and their commit SHAs.

    Megatron-LM history on ``main``: base -> i1 (3 lines at the top of utils.py) ->
    prereq (adds ``resolve_cp_group``) -> upstream. ``side`` branches off ``base``.
    ``collide`` are two commits (branches collide-0/1) whose SHAs share 4 hex digits.
    Megatron-Bridge: ``bridge`` (``.dev.commit`` = base) -> ``bridge_other`` (= i1).
    """

    mlm: Path
    bridge_repo: Path
    base: str
    i1: str
    prereq: str
    upstream: str
    side: str
    collide: tuple
    bridge: str
    bridge_other: str


def build_fake_repos(root: Path) -> FakeRepos:
    mlm = init_repo(root / "Megatron-LM")
    base = commit(mlm, {
        "megatron/core/__init__.py": "",
        "megatron/core/utils.py": _utils(),
        "megatron/core/extras.py": EXTRAS,
        "megatron/core/packed_seq_params.py": PACKED,
        "megatron/core/ssm/gated_delta_net.py": gdn_text(),
        "megatron/core/transformer/transformer_config.py": (DATA / "transformer_config.py").read_text(),
        "README.md": "fake Megatron-LM\n",
    }, "base")
    git(mlm, "branch", "side", base)
    i1 = commit(mlm, {"megatron/core/utils.py": _utils(prefix="\nimport os\nimport sys\n")}, "i1: imports")
    prereq = commit(mlm, {"megatron/core/packed_seq_params.py": PACKED + RESOLVE}, "prereq: resolve_cp_group")
    upstream = commit(mlm, {
        "megatron/core/utils.py": _utils(prefix="\nimport os\nimport sys\n", alpha="value += 10", omega="return total + 0"),
        "megatron/core/context_parallel_layout.py": LAYOUT,
        "megatron/core/extras.py": EXTRAS + "pad_between_seqs = True\n",
        "megatron/core/ssm/gated_delta_net.py": gdn_text(upstream=True),
        "tests/unit_tests/test_utils.py": "def test_alpha():\n    assert True\n",
    }, "upstream: the feature")
    git(mlm, "checkout", "-q", "side")
    side = commit(mlm, {"megatron/core/extras.py": EXTRAS + "SIDE = 1\n"}, "side")
    git(mlm, "checkout", "-q", "main")

    # Two commits whose SHAs share their first 4 hex digits (found by computing SHAs).
    tree = git(mlm, "rev-parse", f"{base}^{{tree}}").strip()
    seen: dict[str, tuple] = {}
    n = 0
    while True:
        sha, body = commit_sha(tree, base, f"collide {n}")
        if sha[:4] in seen:
            pair = [seen[sha[:4]], (sha, body)]
            break
        seen[sha[:4]] = (sha, body)
        n += 1
    collide = []
    for i, (sha, body) in enumerate(pair):
        written = git(mlm, "hash-object", "-t", "commit", "-w", "--stdin", input=body).strip()
        assert written == sha
        git(mlm, "update-ref", f"refs/heads/collide-{i}", sha)
        collide.append(sha)

    br = init_repo(root / "Megatron-Bridge")
    bridge = commit(br, {
        "src/megatron/bridge/__init__.py": '"""Bridge stand-in."""\n',
        "src/megatron/bridge/models/gdn_bridge.py": "def bridge():\n    return 'gdn'\n",
        "src/megatron/core/utils.py": "# the Bridge's copy; the MCore file wins\n",
        "src/megatron/core/bridge_only.py": "ONLY_IN_BRIDGE = True\n",
        ".dev.commit": base + "\n",
        "README.md": "fake Megatron-Bridge\n",
    }, "bridge at base")
    bridge_other = commit(br, {".dev.commit": i1 + "\n"}, "bridge at i1")
    return FakeRepos(mlm=mlm, bridge_repo=br, base=base, i1=i1, prereq=prereq, upstream=upstream, side=side,
                     collide=tuple(collide), bridge=bridge, bridge_other=bridge_other)


@pytest.fixture(scope="session")
def fake_repos(tmp_path_factory) -> FakeRepos:
    """The fake repositories, built once per session; tests must not change them."""
    return build_fake_repos(tmp_path_factory.mktemp("upstreams"))


@pytest.fixture
def engine_env(monkeypatch, tmp_path):
    """Isolate the engine from the caller's environment (mirrors, cache, dates, git config)."""
    for var in ("MEGATRON_LM_REPO", "MEGATRON_BRIDGE_REPO", "GDN_BACKPORT_CACHE", "SOURCE_DATE_EPOCH"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")


# --- recipes -------------------------------------------------------------------------------

def recipe_data(r: FakeRepos) -> dict:
    """A recipe for the fake upstream commit that uses every step kind."""
    return {
        "schema_version": 1,
        "name": "fake-gdn",
        "pins": {"megatron_bridge": r.bridge, "mcore_base": r.base, "upstream": r.upstream,
                 "upstream_ref": "fake/Megatron-LM#1", "commits_between": 3},
        "steps": [
            {"id": "take-layout", "kind": "upstream_file", "path": "megatron/core/context_parallel_layout.py",
             "hunks": ["megatron/core/context_parallel_layout.py#1"], "why": "new upstream module, taken whole"},
            {"id": "prereq-resolve", "kind": "transplant", "commit": r.prereq, "upstream_ref": "fake#0",
             "path": "megatron/core/packed_seq_params.py", "symbols": ["resolve_cp_group"],
             "why": "the prerequisite helper landed after the base"},
            {"id": "take-utils", "kind": "upstream_hunks",
             "hunks": ["megatron/core/utils.py#1", "megatron/core/utils.py#2"],
             "why": "both utils hunks apply verbatim (offset -3)"},
            {"id": "add-gdn-cp", "kind": "add_file", "path": "megatron/core/ssm/gdn_context_parallel.py",
             "template": "gdn_context_parallel.py", "why": "our own module, added whole"},
            {"id": "adapt-none-group", "kind": "adaptation", "path": "megatron/core/ssm/gated_delta_net.py",
             "transform": "gdn_local_cp_none_group", "adapts": ["megatron/core/ssm/gated_delta_net.py#1"],
             "why": "a None CP group means size 1, base name kept"},
            {"id": "fix-tuple-index", "kind": "fix", "path": "megatron/core/ssm/gated_delta_net.py",
             "transform": "fix_local_cp_tuple_index", "why": "preserved downstream fix: tuple index"},
        ],
        "excluded": [
            {"id": "exclude-extras", "hunks": ["megatron/core/extras.py#1"], "why": "brings a forbidden name"},
            {"id": "exclude-tests", "hunks": ["tests/unit_tests/test_utils.py#1"], "why": "upstream tests stay upstream"},
        ],
        "forbidden_strings": ["pad_between_seqs"],
        "import_check": [],
    }


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def recipe(tmp_path, fake_repos) -> Path:
    """The full fake recipe, written to ``tmp_path/fake.yaml``."""
    return write_recipe(tmp_path / "fake.yaml", recipe_data(fake_repos))


@pytest.fixture
def carry_patch(tmp_path, fake_repos) -> Path:
    """A downstream patch against the base tree: already has the tuple-index fix, and edits
    a Bridge file (two hunks in total)."""
    gdn = gdn_text()
    bridge_file = "def bridge():\n    return 'gdn'\n"
    text = git_diff(tmp_path / "carry-src",
                    {"megatron/core/ssm/gated_delta_net.py": gdn, "megatron/bridge/models/gdn_bridge.py": bridge_file},
                    {"megatron/core/ssm/gated_delta_net.py": gdn.replace("param[slices]", "param[tuple(slices)]"),
                     "megatron/bridge/models/gdn_bridge.py": bridge_file + "\n\nCARRIED = True\n"})
    path = tmp_path / "downstream.patch"
    path.write_text(text)
    return path


@pytest.fixture
def make_options(tmp_path, fake_repos):
    """``make_options(recipe, **overrides)``: engine Options on the fake repos; the import check runs
    with the stub interpreter (``STUB_PYTHON``), so every check runs."""
    from backport.options import Options

    def make(recipe_path: Path, **kw) -> Options:
        defaults = dict(megatron_lm=str(fake_repos.mlm), megatron_bridge=str(fake_repos.bridge_repo),
                        cache_dir=tmp_path / "cache", date="20260102", python=STUB_PYTHON)
        defaults.update(kw)
        return Options(recipe=recipe_path, **defaults)

    return make


@pytest.fixture
def written(tmp_path, recipe, carry_patch, make_options):
    """A fake build with a carry, written to tmp_path/out (patch + manifest under patches/latest):
    ``(out folder, the build)``."""
    from backport import output
    from backport.engine import build

    b = build(make_options(recipe, carry=carry_patch))
    out = tmp_path / "out"
    output.write(b, out, trees=False)
    return out, b


@pytest.fixture(autouse=True)
def _tool_cache_in_tmp(monkeypatch, tmp_path_factory):
    """Locks and caches the tool keeps in ``$GDN_BACKPORT_CACHE`` (e.g. the Docker Engine lock of
    ``tools/image``) go to a temporary folder, never the user's ``~/.cache``."""
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(tmp_path_factory.mktemp("tool-cache")))
