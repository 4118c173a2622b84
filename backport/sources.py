"""Upstream sources: remote or local mirrors, kept in a local bare cache (gitpython).

Later runs work offline from the cache. Every commit is recorded by its full SHA; a
short SHA is accepted only when it resolves to exactly one commit. Clones and fetches into
``<cache>/<name>.git`` happen under that entry's lock (``<name>.git.lock``); a clone is made in
``<name>.git.partial`` and renamed into place only when complete. A shallow source is refused
(its history cannot prove the pins), and shallow history never enters the cache.

Every run looks at the entry before using it (:func:`cache_damage`, about 0.1-0.3 s): a
truncated, missing or foreign pack, a corrupt pack index, a half-written or broken ref, or a ref
to an object the entry lacks is named as damage (:class:`~backport.errors.CacheDamaged`, exit 3,
with the one command that repairs it: delete the entry, the next run clones it again), never
taken for a missing commit, fetched into, or used silently. A fresh clone found damaged names
its source (a local mirror) instead.
"""

from __future__ import annotations

import configparser
import hashlib
import io
import os
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import git

from . import interrupts, locks
from .cache import default_cache_dir  # noqa: F401 - re-exported: the cache location's old home
from .errors import CacheDamaged, PinError, SourceError
from .gitenv import isolate_gitpython, isolated

DEFAULT_URLS = {
    "megatron-lm": "https://github.com/NVIDIA/Megatron-LM.git",
    "megatron-bridge": "https://github.com/NVIDIA-NeMo/Megatron-Bridge.git",
}
ENV_VARS = {"megatron-lm": "MEGATRON_LM_REPO", "megatron-bridge": "MEGATRON_BRIDGE_REPO"}


#: git's own words for an object store it cannot read (a damaged pack, index or loose object)
#: (a missing object alone, "could not get object info" / "Not a valid object name", is not damage)
_DAMAGE = re.compile(r"corrupt|inflate|cannot unpack|unable to unpack|pack checksum|index CRC|"
                     r"bad offset|revindex|loose object|object file .* is empty|packfile .* cannot be accessed|"
                     r"invalid object type|does not match index|index file .* is too small|non-monotonic index|"
                     r"no corresponding \.pack|unterminated line|broken ref", re.I)


def is_damage(stderr: str) -> bool:
    """True when git's ``stderr`` says the object store itself is damaged (not a missing commit)."""
    return bool(_DAMAGE.search(stderr or ""))


def git_words(exc: git.GitCommandError) -> str:
    """git's own stderr of a failed command, on one line (GitPython's ``stderr: '...'`` wrapper removed)."""
    text = exc.stderr if isinstance(exc.stderr, str) else (exc.stderr or b"").decode("utf-8", "replace")
    text = text.strip()
    if text.startswith("stderr: '") and text.endswith("'"):
        text = text[len("stderr: '"):-1]
    return " ".join(text.split())


@dataclass
class Source:
    """One upstream repository as the tool sees it.

    Attributes:
        name: ``megatron-lm`` or ``megatron-bridge``.
        location: URL or local path it was cloned/fetched from.
        repo: the bare cache repository.
        cold: True when this run had to clone or fetch.
    """

    name: str
    location: str
    repo: git.Repo
    cold: bool = False
    offline: bool = False

    def damaged(self, exc: git.GitCommandError, what: str) -> CacheDamaged:
        """The error for a git command that failed on the cache itself: names the cache path,
        the command, git's own words, and how to rebuild the cache (exit 3)."""
        words = git_words(exc)[:400] or f"exit status {exc.status}"
        return _damaged(self.name, Path(self.repo.git_dir), self.location, f"`git {what}` failed: {words}",
                        self.offline)

    def candidates(self, rev: str) -> list[str]:
        """Full SHAs of the commits that ``rev`` (a hex prefix of 4-40 digits) names."""
        if re.fullmatch(r"[0-9a-fA-F]{1,3}", rev):
            raise PinError(f"{self.name}: {rev!r} is too short for a commit SHA: a short SHA needs at least 4 hex "
                           f"digits ({len(rev)} given).",
                           hint="Give at least 4 hex digits (7-12 are usual; the full 40 are never ambiguous).")
        if re.fullmatch(r"[0-9a-fA-F]{41,}", rev):
            raise PinError(f"{self.name}: {rev!r} is too long for a commit SHA: {len(rev)} hex digits, at most 40.",
                           hint="Give the 40-digit SHA (or a unique prefix of it).")
        if not re.fullmatch(r"[0-9a-fA-F]{4,40}", rev):
            raise PinError(f"{self.name}: {rev!r} is not a commit SHA (not hex).",
                           hint="Pins are hex SHAs (full 40 digits preferred).")
        rev = rev.lower()
        if len(rev) == 40:
            return [rev] if self._is_commit(rev) else []
        try:
            out = self.repo.git.rev_parse("--disambiguate=" + rev)
        except git.GitCommandError as exc:
            if is_damage(exc.stderr):
                raise self.damaged(exc, f"rev-parse --disambiguate={rev}") from exc
            return []
        return sorted(sha for sha in out.split() if self._is_commit(sha))

    def resolve(self, rev: str) -> str:
        """Full 40-hex SHA of commit ``rev`` (full or unique short SHA).

        Raises:
            PinError: unknown or ambiguous.
        """
        candidates = self.candidates(rev)
        if len(candidates) != 1:
            what = "no commit" if not candidates else f"{len(candidates)} commits ({', '.join(c[:12] for c in candidates)})"
            raise PinError(
                f"{self.name}: {rev!r} matches {what}.",
                hint="Give more digits of the SHA (the full 40 is safest).",
            )
        return candidates[0]

    def _is_commit(self, sha: str) -> bool:
        try:
            return self.repo.git.cat_file("-t", sha).strip() == "commit"
        except git.GitCommandError as exc:
            if is_damage(exc.stderr):
                raise self.damaged(exc, f"cat-file -t {sha}") from exc
            return False

    def has_commit(self, sha: str) -> bool:
        """True when ``sha`` (full) is a commit in the cache."""
        return self._is_commit(sha)

    def read(self, sha: str, path: str) -> bytes:
        """Bytes of ``path`` at commit ``sha``.

        Raises:
            SourceError: path absent or blob missing from the mirror.
        """
        try:
            return self.repo.git.show(f"{sha}:{path}", stdout_as_string=False, strip_newline_in_stdout=False)
        except git.GitCommandError as exc:
            if is_damage(exc.stderr):
                raise self.damaged(exc, f"show {sha[:12]}:{path}") from exc
            raise SourceError(f"{self.name}: cannot read {path} at {sha[:12]}: {git_words(exc)}") from exc

    def export(self, sha: str, path: str) -> tarfile.TarFile:
        """A tar archive of ``path`` at ``sha`` (``git archive``), opened for reading.

        Raises:
            SourceError: the archive fails (for example a blob absent from a partial mirror).
        """
        try:
            data = self.repo.git.archive("--format=tar", sha, path, stdout_as_string=False,
                                        strip_newline_in_stdout=False)
        except git.GitCommandError as exc:
            if is_damage(exc.stderr):
                raise self.damaged(exc, f"archive {sha[:12]} {path}") from exc
            raise SourceError(
                f"{self.name}: `git archive {sha[:12]} {path}` failed: {git_words(exc)[:400]}",
                hint="The mirror lacks objects; fetch a complete mirror and pass it with "
                f"--{self.name} (or {ENV_VARS[self.name]}).",
            ) from exc
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:")

    def count_between(self, ancestor: str, descendant: str) -> int:
        """Number of commits in ``ancestor..descendant``.

        Raises:
            PinError: ``ancestor`` is not an ancestor of ``descendant`` (git's answer: exit 1,
                nothing on stderr).
            SourceError: git could not answer (any other failure: a damaged cache), naming the
                cache and git's words.
        """
        try:
            self.repo.git.merge_base("--is-ancestor", ancestor, descendant)
        except git.GitCommandError as exc:
            if exc.status != 1 or git_words(exc):
                raise self.damaged(exc, f"merge-base --is-ancestor {ancestor[:12]} {descendant[:12]}") from exc
            raise PinError(
                f"{self.name}: {ancestor[:12]} is not an ancestor of {descendant[:12]}; "
                "the upstream feature must descend from the base.",
                hint="Check --upstream and the base pin in the recipe.",
            ) from exc
        try:
            return int(self.repo.git.rev_list("--count", f"{ancestor}..{descendant}"))
        except git.GitCommandError as exc:
            raise self.damaged(exc, f"rev-list --count {ancestor[:12]}..{descendant[:12]}") from exc


def _damaged(name: str, cache: Path, location: str, what: str, offline: bool = False) -> CacheDamaged:
    """The error for a damaged cache entry: names it and what is wrong, and gives the one command
    that repairs it (delete the entry; the next run clones it again), exit 3."""
    again = ("run the same command without --offline: it clones it again from " + location if offline else
             "run the same command again: the next run clones it again")
    shared = _hardlinked_packs(cache)
    if shared:  # git clone of a local mirror hard-links its packs: the same bytes are the mirror's
        return CacheDamaged(
            f"{name}: the cache {cache} cannot be read (damaged): {what}. Its pack files are hard links "
            f"shared with another repository ({', '.join(shared[:2])} have {len(shared)} such), most likely the "
            f"mirror {location}, whose copy is then damaged too.",
            hint=f"Check the mirror first (`git -C {location} fsck`; fetch it again if it fails), then delete the "
                 f"cache entry (`rm -rf {cache}`) and {again}.")
    return CacheDamaged(
        f"{name}: the cache {cache} cannot be read (damaged): {what}",
        hint=f"Delete the damaged cache entry (`rm -rf {cache}`; it is only a copy of {location}) and {again}.")


def _hardlinked_packs(cache: Path) -> list:
    """Names of the cache entry's pack files that have other hard links (st_nlink > 1)."""
    try:
        packs = sorted((Path(cache) / "objects" / "pack").glob("*.pack"))
        return [p.name for p in packs if p.stat().st_nlink > 1]
    except OSError:
        return []


def _hash_size(repo: git.Repo) -> int:
    """Bytes of one object name in ``repo`` (20 for SHA-1, 32 for a SHA-256 repository)."""
    try:
        fmt = repo.config_reader("repository").get_value("extensions", "objectformat", "sha1")
    except Exception:  # noqa: BLE001 - an unreadable config: git itself names it later
        fmt = "sha1"
    return 32 if str(fmt).lower() == "sha256" else 20


def _pack_damage(pack_dir: Path, size: int) -> Optional[str]:
    """What is wrong with the pack files in ``pack_dir``, or None: a ``.pack`` without its
    ``.idx`` (or the reverse), an index whose own checksum fails (a corrupt index), or a pack that
    is not the one its index names (truncated or replaced: git's "does not match index"). Reads
    each index whole (some MB) and only the first and last bytes of each pack."""
    algo = "sha256" if size == 32 else "sha1"
    packs = {p.stem for p in pack_dir.glob("pack-*.pack")}
    idxs = {p.stem for p in pack_dir.glob("pack-*.idx")}
    for stem in sorted(idxs - packs):
        return f"{pack_dir / stem}.idx has no {stem}.pack (a missing pack)"
    for stem in sorted(packs - idxs):
        return f"{pack_dir / stem}.pack has no {stem}.idx (a missing index)"
    for stem in sorted(packs):
        idx = (pack_dir / f"{stem}.idx").read_bytes()
        if len(idx) < 2 * size + 8 or hashlib.new(algo, idx[:-size]).digest() != idx[-size:]:
            return f"{pack_dir / stem}.idx fails its own checksum (a corrupt pack index)"
        with open(pack_dir / f"{stem}.pack", "rb") as f:
            head = f.read(4)
            f.seek(0, os.SEEK_END)
            length = f.tell()
            if length >= 12 + size:
                f.seek(length - size)
            tail = f.read(size)
        if head != b"PACK" or length < 12 + size or tail != idx[-2 * size:-size]:
            return (f"{pack_dir / stem}.pack ({length} bytes) is not the pack its index names (truncated or "
                    "overwritten; git: \"packfile ... does not match index\")")
    return None


def cache_damage(repo: git.Repo) -> Optional[str]:
    """What is damaged in the bare cache ``repo``, or None when nothing is: its pack files
    (:func:`_pack_damage`), a ref git ignores as broken (half-written) or cannot read, or a ref
    pointing at an object the cache lacks. Quotes git's own words where git gave them. About
    0.1 s on the Megatron-LM cache."""
    found = _pack_damage(Path(repo.git_dir) / "objects" / "pack", _hash_size(repo))
    if found:
        return found
    env = isolated()
    refs = interrupts.run_child(["git", "--git-dir", repo.git_dir, "for-each-ref", "--format=%(objectname) %(refname)"],
                          capture_output=True, env=env)
    words = " ".join(refs.stderr.decode("utf-8", "replace").split())[:400]
    if refs.returncode != 0 or words:
        return f"its refs cannot be read (a half-written ref?): `git for-each-ref` said: {words or refs.returncode}"
    pairs = [line.split(" ", 1) for line in refs.stdout.decode("utf-8", "replace").splitlines() if " " in line]
    objs = interrupts.run_child(["git", "--git-dir", repo.git_dir, "cat-file", "--batch-check"], capture_output=True,
                          env=env, input="".join(f"{sha}\n" for sha, _ref in pairs).encode())
    words = " ".join(objs.stderr.decode("utf-8", "replace").split())[:400]
    if objs.returncode != 0 or words:
        return f"its objects cannot be read: `git cat-file --batch-check` said: {words or objs.returncode}"
    lost = [ref for (sha, ref), line in zip(pairs, objs.stdout.decode("utf-8", "replace").splitlines())
            if line.endswith(" missing")]
    if lost:
        more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
        return f"{lost[0]}{more} point{'s' if len(lost) == 1 else ''} at objects the cache lacks (a lost pack or object)"
    return None


def is_shallow(path: "str | Path") -> bool:
    """True when the git repository at ``path`` (bare or not) has shallow history."""
    try:
        repo = git.Repo(path)
        isolate_gitpython(repo)  # the caller's git config must not change the answer
        out = repo.git.rev_parse("--is-shallow-repository")
    except (git.GitCommandError, git.InvalidGitRepositoryError, git.NoSuchPathError):
        return (Path(path) / "shallow").exists() or (Path(path) / ".git" / "shallow").exists()
    return out.strip() == "true"


def _shallow_error(name: str, location: str) -> SourceError:
    return SourceError(
        f"{name}: {location} is a shallow clone: fetch its full history; its commits cannot prove "
        "the pins (base ancestry, commit count).",
        hint=f"Run `git -C {location} fetch --unshallow` (or clone it without --depth), "
             "then run the same command again.")


def open_source(
    name: str,
    location: Optional[str],
    cache_dir: Path,
    needed: tuple[str, ...] = (),
    progress: Optional[Callable[[str], None]] = None,
    offline: bool = False,
) -> Source:
    """Open ``name`` through the bare cache, cloning or fetching only when needed.

    Args:
        name: ``megatron-lm`` or ``megatron-bridge``.
        location: URL or path; None means ``$MEGATRON_LM_REPO``/``$MEGATRON_BRIDGE_REPO``
            or the public GitHub URL.
        cache_dir: holds ``<name>.git``.
        needed: revisions (short or full) that must be present; missing ones trigger a fetch.
        progress: called with one-line status messages (clone/fetch).
        offline: never contact ``location``; fail if the cache lacks a needed commit.

    Raises:
        SourceError: clone/fetch failed, the source or cache is shallow, or a needed commit is
            unavailable offline.
        PinError: a needed commit is not in ``location`` even after fetching.
        BusyError: another run is cloning/fetching this entry and the run does not wait.
    """
    given = (f"--{name}" if location else ENV_VARS[name] if os.environ.get(ENV_VARS[name]) else
             f"the default URL; --{name} or {ENV_VARS[name]} name a mirror")
    location = location or os.environ.get(ENV_VARS[name]) or DEFAULT_URLS[name]
    local = os.path.isdir(location)
    if local:
        location = str(Path(location).resolve())
    cache = cache_dir / f"{name}.git"
    say = progress or (lambda _msg: None)
    with locks.hold(cache.with_name(cache.name + ".lock"), f"the {name} cache {cache}"):
        cold = False
        if os.path.lexists(cache):  # an entry that is there must open; else it is damage, not "no cache"
            _open_cache(name, cache, location, offline)
        if (cache / "HEAD").exists() and is_shallow(cache):
            if offline:
                raise SourceError(f"{name}: the cache {cache} holds shallow history and --offline was given.",
                                  hint=f"Run once without --offline, with --{name} pointing at a full mirror.")
            say(f"the cache {cache} holds shallow history (made by an older version); cloning it again")
            shutil.rmtree(cache)
        if not (cache / "HEAD").exists():
            if offline:
                raise SourceError(f"{name}: no cache at {cache} and --offline was given.",
                                  hint=f"Run once without --offline, with --{name} pointing at a mirror.")
            if local and is_shallow(location):
                raise _shallow_error(name, location)
            say(f"cloning {name} from {location} into {cache} (bare)")
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(cache.name + ".partial")
            if tmp.exists():
                shutil.rmtree(tmp)
            try:
                git.Repo.clone_from(location, tmp, bare=True, env=isolated())
            except git.GitCommandError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise SourceError(f"{name}: clone of {location} ({given}) failed: {git_words(exc)[:400]}",
                                  hint=_unreachable_hint(name, location, given)) from exc
            if is_shallow(tmp):
                shutil.rmtree(tmp)
                raise _shallow_error(name, location)
            os.rename(tmp, cache)
            cold = True
        repo = _open_cache(name, cache, location, offline)
        isolate_gitpython(repo)
        # Every run, warm or cold: a damaged entry is named, never used (nor fetched into) silently.
        damage = cache_damage(repo)
        if damage and cold:  # a fresh clone copies the packs of a local mirror as they are
            shutil.rmtree(cache)
            raise SourceError(f"{name}: the source {location} is damaged: its clone {cache} is: {damage}",
                              hint=f"Repair the mirror (`git -C {location} fsck`; fetch it again), or point "
                                   f"--{name} at another one, then run the same command again.")
        if damage:
            raise _damaged(name, cache, location, damage, offline)
        source = Source(name=name, location=location, repo=repo, cold=cold, offline=offline)
        missing = [rev for rev in needed if not _present(source, rev)]
        if not missing and not cold:
            say(f"{name}: using the cache {cache} (source {location}; it has every pinned commit)")
        if missing:
            if offline:
                origin = _origin(repo)
                other = (f" (the entry was cloned from {origin}, not from {location}: if that is another repository, "
                         f"delete it, `rm -rf {cache}`)" if origin and origin != location else "")
                raise SourceError(f"{name}: the cache {cache} lacks {', '.join(missing)} and --offline was given.",
                                  hint=f"Run without --offline so the cache can fetch from {location}{other}.")
            if local and is_shallow(location):
                raise _shallow_error(name, location)
            say(f"fetching {name} from {location} (missing {', '.join(m[:12] for m in missing)})")
            try:
                repo.git.fetch(location, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*", "--prune")
            except git.GitCommandError as exc:
                raise SourceError(f"{name}: fetch from {location} ({given}) failed: {git_words(exc)[:400]}",
                                  hint=_unreachable_hint(name, location, given)) from exc
            if is_shallow(cache):
                shutil.rmtree(cache)
                raise _shallow_error(name, location)
            source.cold = True
            still = [rev for rev in needed if not _present(source, rev)]
            if still:
                raise PinError(f"{name}: {', '.join(still)} not found in {location} (fetched just now).",
                               hint="Check the SHA (a typo, or a commit of another repository?), or point "
                                    f"--{name} at a mirror that has it.")
    return source


def _unreachable_hint(name: str, location: str, given: str) -> str:
    """What to do when ``location`` (named by ``given``: a flag, a variable or the default) cannot
    be cloned or fetched from."""
    what = "a Megatron-LM" if name == "megatron-lm" else "a Megatron-Bridge"
    if "://" in location or location.startswith("git@"):
        return (f"Check the network and the URL, or point --{name} (or {ENV_VARS[name]}) at {what} mirror on disk, "
                "then run the same command again.")
    there = "is not a git repository" if os.path.isdir(location) else "does not exist"
    return (f"{location} {there}: point --{name} (or {ENV_VARS[name]}; this value came from "
            f"{given.split(';')[0]}) at {what} mirror (a full `git clone --mirror`), then run the same command again.")


def _open_cache(name: str, cache: Path, location: str, offline: bool) -> git.Repo:
    """The cache entry ``cache`` opened with GitPython.

    Raises:
        CacheDamaged: it is a file, or git does not open it (HEAD, objects/ or refs/ gone or
            damaged, a config git cannot parse), naming what git says.
    """
    if not cache.is_dir():
        raise _damaged(name, cache, location, "it is a file, not a bare repository folder", offline)
    try:
        return git.Repo(cache)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, configparser.Error, ValueError) as exc:
        raise _unreadable_cache(name, cache, location, offline) from exc


def _unreadable_cache(name: str, cache: Path, location: str, offline: bool = False) -> CacheDamaged:
    """The error for a cache entry git does not take for a repository at all (HEAD or objects/
    damaged or gone, a config it cannot parse), quoting git's own words (``git rev-parse
    --git-dir`` there)."""
    proc = interrupts.run_child(["git", "-C", str(cache), "rev-parse", "--git-dir"], capture_output=True,
                          env=isolated({"GIT_CEILING_DIRECTORIES": str(cache.parent)}))
    words = " ".join(proc.stderr.decode("utf-8", "replace").split())[:400] or "GitPython does not open it"
    what = "it is not a git repository any more" if "not a git repository" in words or proc.returncode == 0 \
        else "git cannot open it"
    return _damaged(name, cache, location, f"{what}: {words}", offline)


def _origin(repo: git.Repo) -> Optional[str]:
    """The ``remote.origin.url`` a cache entry was cloned from, or None."""
    try:
        return str(repo.config_reader("repository").get_value('remote "origin"', "url"))
    except Exception:  # noqa: BLE001 - no origin recorded
        return None


def _present(source: Source, rev: str) -> bool:
    return bool(source.candidates(rev))
