"""backport.sources: pins by SHA, the bare cache, offline runs; tree assembly; hunk ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import git
import pytest

from backport.errors import CacheDamaged, PinError, SourceError
from backport.cache import default_cache_dir
from backport.sources import Source, open_source
from backport.tree import assemble_base_tree, tree_digest
from backport.upstream import load_hunks

from conftest import build_fake_repos, commit, git as run_git, init_repo

pytestmark = pytest.mark.usefixtures("engine_env")


@pytest.fixture(scope="module")
def mlm(fake_repos, tmp_path_factory):
    """A cache of the fake Megatron-LM shared by the read-only tests of this module."""
    return open_source("megatron-lm", str(fake_repos.mlm), tmp_path_factory.mktemp("shared-cache"))


def test_fixture_repos_are_reproducible(fake_repos, tmp_path):
    again = build_fake_repos(tmp_path / "again")
    assert (again.base, again.i1, again.prereq, again.upstream, again.side, again.collide, again.bridge) == (
        fake_repos.base, fake_repos.i1, fake_repos.prereq, fake_repos.upstream, fake_repos.side,
        fake_repos.collide, fake_repos.bridge)


def test_cache_is_a_bare_clone_marked_cold(fake_repos, tmp_path):
    said = []
    src = open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache", (fake_repos.upstream,), said.append)
    assert src.cold is True
    assert src.repo.bare
    assert src.repo.git_dir == str(tmp_path / "cache" / "megatron-lm.git")
    assert not (tmp_path / "cache" / "megatron-lm.git.partial").exists()
    assert said and said[0].startswith("cloning megatron-lm from")
    assert src.location == str(fake_repos.mlm.resolve())


def test_second_run_works_offline_and_is_warm(fake_repos, tmp_path):
    open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache", (fake_repos.upstream,))
    said = []
    src = open_source("megatron-lm", str(tmp_path / "nowhere"), tmp_path / "cache",
                      (fake_repos.upstream, fake_repos.base[:10]), said.append, offline=True)
    assert src.cold is False
    assert said == [f"megatron-lm: using the cache {tmp_path / 'cache' / 'megatron-lm.git'} "
                    f"(source {tmp_path / 'nowhere'}; it has every pinned commit)"]  # no clone, no fetch
    assert src.resolve(fake_repos.upstream[:10]) == fake_repos.upstream


def test_offline_without_cache_is_source_error(fake_repos, tmp_path):
    with pytest.raises(SourceError) as exc:
        open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache", offline=True)
    assert exc.value.exit_code == 3
    assert "--offline" in exc.value.message


def test_offline_missing_commit_is_source_error(fake_repos, tmp_path):
    open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache")
    missing = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(SourceError) as exc:
        open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache", (missing,), offline=True)
    assert exc.value.exit_code == 3
    assert missing in exc.value.message


def test_missing_commit_is_fetched_into_the_cache(tmp_path):
    origin = init_repo(tmp_path / "origin")
    first = commit(origin, {"a.txt": "1\n"}, "first")
    open_source("megatron-lm", str(origin), tmp_path / "cache", (first,))
    second = commit(origin, {"a.txt": "2\n"}, "second")
    said = []
    src = open_source("megatron-lm", str(origin), tmp_path / "cache", (second,), said.append)
    assert src.cold is True
    assert src.has_commit(second)
    assert any(m.startswith("fetching megatron-lm") for m in said)


def test_commit_absent_from_the_mirror_is_pin_error(fake_repos, tmp_path):
    """The mirror was read and fetched; the SHA names nothing in it: a pin error (README: 4)."""
    missing = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(PinError, match="not found in") as exc:
        open_source("megatron-lm", str(fake_repos.mlm), tmp_path / "cache", (missing,))
    assert exc.value.exit_code == 4


def test_clone_failure_is_source_error(tmp_path):
    with pytest.raises(SourceError, match="clone of") as exc:
        open_source("megatron-bridge", str(tmp_path / "not-a-repo"), tmp_path / "cache")
    assert exc.value.exit_code == 3
    assert not (tmp_path / "cache" / "megatron-bridge.git").exists()


def test_location_falls_back_to_the_env_var(fake_repos, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_BRIDGE_REPO", str(fake_repos.bridge_repo))
    src = open_source("megatron-bridge", None, tmp_path / "cache", (fake_repos.bridge,))
    assert src.location == str(fake_repos.bridge_repo.resolve())


@pytest.mark.parametrize("env, expected", [
    ({"GDN_BACKPORT_CACHE": "/somewhere/cache"}, "/somewhere/cache"),
    ({}, "HOME/.cache/gdn-backport"),
])
def test_default_cache_dir(monkeypatch, tmp_path, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert str(default_cache_dir()) == expected.replace("HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("digits", [40, 12, 7])
def test_full_and_unique_short_sha_resolve(mlm, fake_repos, digits):
    assert mlm.resolve(fake_repos.upstream[:digits]) == fake_repos.upstream
    assert mlm.resolve(fake_repos.upstream[:digits].upper()) == fake_repos.upstream


def test_ambiguous_short_sha_is_pin_error(mlm, fake_repos):
    a, b = fake_repos.collide
    assert a[:4] == b[:4] and a != b
    assert mlm.candidates(a[:4]) == sorted([a, b])
    with pytest.raises(PinError) as exc:
        mlm.resolve(a[:4])
    assert exc.value.exit_code == 4
    assert "2 commits" in exc.value.message and a[:12] in exc.value.message and b[:12] in exc.value.message
    assert mlm.resolve(a[:12]) == a


@pytest.mark.parametrize("rev", ["0123456789abcdef0123456789abcdef01234567", "0123456789ab"])
def test_unknown_sha_is_pin_error(mlm, rev):
    with pytest.raises(PinError, match="matches no commit") as exc:
        mlm.resolve(rev)
    assert exc.value.exit_code == 4


@pytest.mark.parametrize("rev", ["abc", "main", "HEAD~1", "g123456", "0" * 41, ""])
def test_non_hex_rev_is_pin_error(mlm, rev):
    said = {"abc": "is too short for a commit SHA: a short SHA needs at least 4 hex digits",
            "0" * 41: "is too long for a commit SHA"}.get(rev, "is not a commit SHA")
    with pytest.raises(PinError, match=said) as exc:
        mlm.candidates(rev)
    assert exc.value.exit_code == 4


def test_a_blob_sharing_the_prefix_does_not_make_it_ambiguous(fake_repos, tmp_path):
    repo = init_repo(tmp_path / "r")
    target = commit(repo, {"a.txt": "x\n"}, "c")
    assert target == "08302c7cb51c3369378194e40299cf526d204870"  # fixed identity and dates
    data = b"blob filler 1110\n"  # found once by search: its blob SHA starts with 0830 too
    blob = run_git(repo, "hash-object", "-w", "--stdin", input=data).strip()
    src = Source("megatron-lm", str(repo), git.Repo(repo))
    assert blob[:4] == target[:4]
    assert src.resolve(target[:4]) == target
    assert not src.has_commit(blob)


def test_count_between(mlm, fake_repos):
    assert mlm.count_between(fake_repos.base, fake_repos.upstream) == 3
    assert mlm.count_between(fake_repos.upstream, fake_repos.upstream) == 0


@pytest.mark.parametrize("ancestor, descendant", [("side", "upstream"), ("upstream", "base")])
def test_non_ancestor_is_pin_error(mlm, fake_repos, ancestor, descendant):
    with pytest.raises(PinError, match="is not an ancestor") as exc:
        mlm.count_between(getattr(fake_repos, ancestor), getattr(fake_repos, descendant))
    assert exc.value.exit_code == 4


def test_read_returns_the_blob_bytes(mlm, fake_repos):
    """Bytes must be exact: files taken whole from upstream end with a newline."""
    path = "megatron/core/context_parallel_layout.py"
    expected = run_git(fake_repos.mlm, "cat-file", "blob", f"{fake_repos.upstream}:{path}").encode()
    assert expected.endswith(b"\n")
    assert mlm.read(fake_repos.upstream, path) == expected


@pytest.mark.parametrize("path", ["megatron/core/absent.py", "megatron/core/context_parallel_layout.py"])
def test_read_of_an_absent_path_is_source_error(mlm, fake_repos, path):
    with pytest.raises(SourceError, match="cannot read") as exc:
        mlm.read(fake_repos.base, path)
    assert exc.value.exit_code == 3
    assert not isinstance(exc.value, CacheDamaged)  # an absent path is not a damaged cache
    assert ": fatal: " in exc.value.message and "stderr: '" not in exc.value.message  # git's words, unwrapped


def test_export_of_an_absent_path_is_source_error(mlm, fake_repos):
    with pytest.raises(SourceError, match="git archive") as exc:
        mlm.export(fake_repos.base, "nope")
    assert exc.value.exit_code == 3


def test_base_tree_overlays_mcore_on_the_bridge(fake_repos, tmp_path):
    cache = tmp_path / "cache"
    mlm = open_source("megatron-lm", str(fake_repos.mlm), cache)
    bridge = open_source("megatron-bridge", str(fake_repos.bridge_repo), cache)
    root = assemble_base_tree(bridge, fake_repos.bridge, mlm, fake_repos.base, cache)
    assert root == cache / "trees" / f"{fake_repos.bridge[:9]}-{fake_repos.base[:9]}"
    meg = root / "megatron"
    assert (meg / "core/utils.py").read_text() == run_git(fake_repos.mlm, "show", f"{fake_repos.base}:megatron/core/utils.py")
    assert (meg / "core/bridge_only.py").read_text() == "ONLY_IN_BRIDGE = True\n"
    assert (meg / "bridge/models/gdn_bridge.py").is_file()
    assert not (meg / "core/context_parallel_layout.py").exists()
    record = json.loads((root / ".complete").read_text())
    assert (record["bridge"], record["mcore"]) == (fake_repos.bridge, fake_repos.base)
    assert (record["files"], record["sha256"]) == tree_digest(meg)
    # cached: a second call returns the same tree without rebuilding it (same record inode)
    inode = (root / ".complete").stat().st_ino
    assert assemble_base_tree(bridge, fake_repos.bridge, mlm, fake_repos.base, cache) == root
    assert (root / ".complete").stat().st_ino == inode
    # ... and a changed entry is not reused: it is rebuilt (tests/unit/test_concurrency.py has more)
    (meg / "marker").write_text("foreign")
    assert assemble_base_tree(bridge, fake_repos.bridge, mlm, fake_repos.base, cache) == root
    assert not (meg / "marker").exists()


def test_hunk_ids_are_path_and_position(mlm, fake_repos):
    hunks = load_hunks(mlm, fake_repos.upstream)
    assert [h.id for h in hunks] == [
        "megatron/core/context_parallel_layout.py#1",
        "megatron/core/extras.py#1",
        "megatron/core/ssm/gated_delta_net.py#1",
        "megatron/core/utils.py#1",
        "megatron/core/utils.py#2",
        "tests/unit_tests/test_utils.py#1",
    ]
    by_id = {h.id: h for h in hunks}
    assert (by_id["megatron/core/utils.py#1"].added, by_id["megatron/core/utils.py#1"].removed) == (1, 1)
    assert by_id["megatron/core/context_parallel_layout.py#1"].header == "@@ -0,0 +1,5 @@"
    assert all(len(h.digest) == 16 for h in hunks)
    assert len({h.digest for h in hunks}) == len(hunks)


def test_last_hunk_of_the_commit_keeps_its_final_newline(mlm, fake_repos):
    """The diff's last line is a line like any other (GitPython must not strip its newline)."""
    last = load_hunks(mlm, fake_repos.upstream)[-1]
    assert [line.value for line in last.hunk] == ["def test_alpha():\n", "    assert True\n"]


# --- a damaged cache is named as the culprit (issue 23) ---------------------------------------------

def _damage_commit_in_pack(cache: Path, sha: str) -> None:
    """Repack the bare cache ``cache`` into one fresh pack, then flip bytes inside the zlib data of
    commit ``sha`` there (its type and size stay readable: ``cat-file -t`` still answers)."""
    run_git(cache, "repack", "-a", "-d", "-q")
    (pack,) = (cache / "objects" / "pack").glob("*.pack")
    assert pack.stat().st_nlink == 1  # a file of the cache's own, never one shared with the fixture repo
    index = run_git(cache, "show-index", input=(pack.with_suffix(".idx")).read_bytes())
    offset = next(int(line.split()[0]) for line in index.splitlines() if line.split()[1] == sha)
    data = bytearray(pack.read_bytes())
    for i in range(offset + 6, offset + 14):
        data[i] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))


def test_a_damaged_pack_is_named_as_the_cache_with_gits_words_not_as_a_pin(fake_repos, tmp_path):
    cache = tmp_path / "cache"
    src = open_source("megatron-lm", str(fake_repos.mlm), cache, (fake_repos.upstream,))
    _damage_commit_in_pack(cache / "megatron-lm.git", fake_repos.upstream)
    assert src.has_commit(fake_repos.upstream)  # the object is still listed: only its content is damaged
    with pytest.raises(SourceError) as exc:
        src.count_between(fake_repos.base, fake_repos.upstream)
    msg = exc.value.message
    assert exc.value.exit_code == 3 and "not an ancestor" not in msg
    assert f"the cache {cache / 'megatron-lm.git'} cannot be read (damaged)" in msg
    assert "`git merge-base --is-ancestor" in msg and "is corrupt" in msg  # git's own words
    assert "stderr: '" not in msg
    assert f"rm -rf {cache / 'megatron-lm.git'}" in exc.value.hint and "clones it again" in exc.value.hint
    with pytest.raises(CacheDamaged, match="cannot be read [(]damaged[)]"):
        load_hunks(src, fake_repos.upstream)


def test_a_damaged_cache_through_the_cli_exits_3_naming_it_and_a_rebuild_works(fake_repos, tmp_path):
    from click.testing import CliRunner

    from backport.cli import cli
    from conftest import recipe_data, write_recipe

    cache = tmp_path / "cache"
    args = ["--recipe", str(write_recipe(tmp_path / "r.yaml", recipe_data(fake_repos))),
            "--megatron-lm", str(fake_repos.mlm), "--megatron-bridge", str(fake_repos.bridge_repo),
            "--cache-dir", str(cache), "--no-import-check", "--date", "2026-01-02", "--out", str(tmp_path / "out")]
    assert CliRunner().invoke(cli, args).exit_code == 0
    _damage_commit_in_pack(cache / "megatron-lm.git", fake_repos.upstream)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 3, result.output
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines[-2].startswith("error: megatron-lm: the cache ") and "is corrupt" in lines[-2], result.stderr
    assert lines[-1].startswith(f"hint: Delete the damaged cache entry (`rm -rf {cache / 'megatron-lm.git'}`")
    shutil.rmtree(cache / "megatron-lm.git")  # the hint's own route: delete the entry, run the same command

    assert CliRunner().invoke(cli, args).exit_code == 0


@pytest.mark.parametrize("damage", ["HEAD", "objects"])
def test_a_cache_entry_git_no_longer_opens_is_named_not_a_bug(fake_repos, tmp_path, damage):
    cache = tmp_path / "cache"
    open_source("megatron-lm", str(fake_repos.mlm), cache, (fake_repos.upstream,))
    entry = cache / "megatron-lm.git"
    if damage == "HEAD":
        (entry / "HEAD").write_text("garbage\n")
    else:
        shutil.rmtree(entry / "objects")
    with pytest.raises(CacheDamaged) as exc:
        open_source("megatron-lm", str(fake_repos.mlm), cache, (fake_repos.upstream,))
    assert exc.value.exit_code == 3
    assert exc.value.message.startswith(f"megatron-lm: the cache {entry} cannot be read (damaged): it is not a git "
                                        "repository any more: fatal: not a git repository")
    assert f"rm -rf {entry}" in exc.value.hint
