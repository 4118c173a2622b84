"""The README's and the docs' examples cannot rot: every shell example is complete (bash parses it,
every variable it uses is defined in it) and safe to paste (what it writes goes under an ignored
folder or outside the repository, never over a tracked file, unless it is one of the deliberate
writes listed below); the cheap ones run (``tools/backport --help``, ``--summary``, ``annotate``;
Python examples are compiled, and run against ``build/tree/patched`` when it is there); examples
that need Docker, a GPU or the mirrors are checked statically only. Also: docs/README.md indexes
every doc, and every doc path or relative link in the README and the docs names a file that
exists. Budget: well under 30 s on 2 cores (the runs are a few short subprocesses)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]

#: Variables an example may use without defining them (the shell's own).
SHELL_ENV = {"HOME", "PWD", "PATH", "USER", "OLDPWD"}

#: Writes to tracked files that are the point of the command (the README says so beside each).
DELIBERATE = {
    "--release": "a new dated release: it is meant to change manifests/lock.json, which is then committed",
    "make release": "a new dated release (the same)",
    "make record-gate": "copies the gate report over the committed one, on purpose",
}

#: Commands that write outputs, and how an example must send them elsewhere.
WRITERS = {
    "tools/backport": "--out",
    "bench/wire_bytes.py": "--out",
}

#: Read-only forms of the writers above (they write nothing, or only a scratch folder of their own).
READ_ONLY = ("--check", "--dry-run", "--summary", "--list-hunks", "--help", "-h", "--version", "annotate")


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, text)`` of every code example of a Markdown page: fenced blocks (their
    language: ``sh``/``bash``/``console``/``shell`` -> ``sh``, ``python``), and blocks indented four
    spaces after a blank line (``python`` when they open with ``from``/``import``, else ``sh``)."""
    lines = page.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            lang, start, body = fence.group(1).lower(), i + 1, []
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            lang = "sh" if lang in ("sh", "bash", "console", "shell") else lang
            if lang in ("sh", "python"):
                out.append((start + 1, lang, "\n".join(body)))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()) and line.strip():
            start, body = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            text = "\n".join(body).strip("\n")
            lang = "python" if re.match(r"(from|import) \w", text) else "sh"
            out.append((start + 1, lang, text))
            continue
        i += 1
    return out


def examples(lang: str) -> list:
    return [pytest.param(page, line, text, id=f"{page.relative_to(REPO)}:{line}")
            for page in PAGES for line, kind, text in blocks(page) if kind == lang]


def commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped, split
    on ``&&``, ``||``, ``;`` and ``|``."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.split("\n"):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        cmd: list = []
        for word in words + ["&&"]:
            if word in ("&&", "||", ";", "|"):
                if cmd:
                    out.append(" ".join(shlex.quote(w) if w != "<" else w for w in cmd))
                cmd = []
            else:
                cmd.append(word)
    return out


def _ignored_or_outside(path: str) -> bool:
    """True when ``path`` (as an example writes it) is outside the repository, a variable the example
    defines, or a path git ignores."""
    if path.startswith(("/", "$", "~")) and not path.startswith(str(REPO)):
        return True
    rel = os.path.relpath(REPO / path, REPO) if not path.startswith("/") else os.path.relpath(path, REPO)
    res = subprocess.run(["git", "check-ignore", "-q", "--no-index", rel], cwd=REPO)
    return res.returncode == 0


@pytest.mark.parametrize("page, line, text", examples("sh"))
def test_shell_example_parses_and_defines_its_variables(page, line, text):
    res = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert res.returncode == 0, f"{page.name}:{line}: bash cannot parse the example: {res.stderr}"
    code = re.sub(r"#[^\n'\"]*$", "", text, flags=re.M)  # comments may name variables
    used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", code))
    defined = set(re.findall(r"(?:^|[\s;&(])(?:export\s+|local\s+)?([A-Za-z_]\w*)=", code, flags=re.M))
    defined |= set(re.findall(r"\bfor\s+([A-Za-z_]\w*)\s+in\b", code))
    defined |= set(re.findall(r"\$\{([A-Za-z_]\w*):[-=]", code))  # ${VAR:-default}
    missing = sorted(used - defined - SHELL_ENV)
    assert not missing, f"{page.name}:{line}: the example uses {missing} without defining them"


@pytest.mark.parametrize("page, line, text", examples("sh"))
def test_shell_example_writes_nothing_tracked(page, line, text):
    for cmd in commands(text):
        words = shlex.split(cmd)
        if any(key in cmd for key in DELIBERATE):
            continue
        for i, word in enumerate(words):
            if word in (">", ">>") and i + 1 < len(words):
                assert _ignored_or_outside(words[i + 1]), f"{page.name}:{line}: `{cmd}` writes {words[i + 1]}"
        writer = next((w for w in WRITERS if any(word.endswith(w) for word in words)), None)
        if writer is None or any(flag in words for flag in READ_ONLY):
            continue
        flag = WRITERS[writer]
        plain_run = writer == "tools/backport" and not ({"--carry", "--date", "--bridge", "--mcore-base"} & set(words))
        if flag not in words:
            # a plain `tools/backport` rewrites manifests/lock.json with its committed bytes ("lock: ...
            # equals the committed lock"): the tracked file keeps its content
            assert plain_run, f"{page.name}:{line}: `{cmd}` writes into the repository: give it {flag} under build/"
            continue
        target = words[words.index(flag) + 1]
        assert _ignored_or_outside(target), f"{page.name}:{line}: `{cmd}`: {flag} {target} is not an ignored folder"


def test_the_carry_example_is_complete_and_safe():
    """The issue's case: the carry example defines REPO and the mirrors and passes --out."""
    text = next(t for line, lang, t in blocks(REPO / "docs" / "carry.md") if "--carry" in t)
    assert "--out build/" in text and re.search(r"^REPO=", text, re.M) and "MEGATRON_LM_REPO" in text


@pytest.mark.parametrize("page, line, text", examples("python"))
def test_python_example_compiles_and_runs_on_the_patched_tree(page, line, text):
    fragment = re.match(r"# fragment of (\S+)\n", text)
    if fragment:  # lines quoted from an example file: they must still be in it, as written
        source = (REPO / fragment.group(1)).read_text(encoding="utf-8")
        missing = [ln for ln in text.splitlines()[1:] if ln.strip() and ln not in source.splitlines()]
        assert not missing, f"{page.name}:{line}: not in {fragment.group(1)}: {missing}"
        return
    compile(text, f"{page.name}:{line}", "exec")
    tree = REPO / "build" / "tree" / "patched"
    if not (tree / "megatron" / "core").is_dir():
        pytest.skip("build/tree/patched is absent (make patch): compiled only")
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run([sys.executable, "-c", text], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{page.name}:{line}: {res.stderr[-2000:]}"


#: Shell commands of the examples that are cheap and read-only: run, with what they need.
RUNNABLE = [
    (r"^tools/backport (--help|-h)$", None),
    (r"^tools/backport --summary$", "patches/latest/manifest.json"),
    (r"^tools/backport annotate\b", "patches/latest/manifest.json"),
]


def _runnable() -> list:
    found = []
    for page in PAGES:
        for line, lang, text in blocks(page):
            if lang != "sh":
                continue
            for cmd in commands(text):
                for pattern, needs in RUNNABLE:
                    if re.match(pattern, cmd):
                        found.append(pytest.param(cmd, needs, id=f"{page.relative_to(REPO)}:{line}:{cmd}"))
    return found


@pytest.mark.parametrize("cmd, needs", _runnable())
def test_cheap_examples_run(cmd, needs):
    if needs and not (REPO / needs).exists():
        pytest.skip(f"{needs} is absent (make patch)")
    res = subprocess.run(shlex.split(cmd), cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, COLUMNS="200"))
    assert res.returncode == 0, f"`{cmd}` exited {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.strip()


def test_the_docs_index_lists_every_doc_once():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \|", index, re.M)
    on_disk = sorted(p.name for p in DOCS if p.name != "README.md")
    assert sorted(listed) == on_disk, "docs/README.md must list every doc once, one row each"


def test_doc_paths_and_links_resolve():
    missing = []
    for page in PAGES + [REPO / "docs" / "README.md"]:
        text = page.read_text(encoding="utf-8")
        for ref in re.findall(r"`(docs/[\w./-]+\.(?:md|py|sh))`", text):
            if not (REPO / ref).exists():
                missing.append(f"{page.name}: {ref}")
        for ref in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in ref:
                continue
            if not (page.parent / ref).exists():
                missing.append(f"{page.name}: ({ref})")
    assert not missing, missing


def _inline_commands() -> list:
    """Commands quoted inline in prose (`` `tools/... --flag` ``), which readers paste as well."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for cmd in re.findall(r"`((?:tools/\w[\w-]*|\.venv/bin/python \S+\.py|python \S+\.py) [^`]*)`", text):
            # a syntax description, not a command: a placeholder (SHA, PATCH, [DIR]) or a flag without its value
            if re.search(r"(?<![$\w])[A-Z][A-Z_]+\b|\[", cmd) or re.search(r"\s--[\w-]+$", cmd):
                continue
            found.append(pytest.param(page, cmd, id=f"{page.relative_to(REPO)}:{cmd[:60]}"))
    return found


@pytest.mark.parametrize("page, cmd", _inline_commands())
def test_inline_command_writes_nothing_tracked(page, cmd):
    test_shell_example_writes_nothing_tracked(page, 0, cmd)


def _image_builds() -> list:
    """Every example block that runs ``tools/image build`` or ``gate`` (with the block's text)."""
    return [pytest.param(page, line, text, id=f"{page.relative_to(REPO)}:{line}")
            for page in PAGES for line, lang, text in blocks(page)
            if lang == "sh" and re.search(r"tools/image (build|gate)\b", text)]


#: ``tools/image`` flag -> the output of ``tools/backport --out OUT`` it reads (backport.output's layout).
IMAGE_INPUTS = {"--tree": "build/tree/base", "--patch": "patches/latest/megatron.patch",
                "--manifest": "patches/latest/manifest.json", "--tree-lock": "manifests/lock.json"}


@pytest.mark.parametrize("page, line, text", _image_builds())
def test_image_build_examples_use_real_flags_and_the_outputs_of_their_backport_run(page, line, text):
    """The "build the image from a carry or a retarget" commands cannot rot: each flag is one of
    ``tools/image build``'s (read from the click definition), and a block that first runs
    ``tools/backport --out OUT`` points every input flag at the file that run writes there."""
    from backport import output
    from image_pipeline.cli import cli as image_cli

    assert set(IMAGE_INPUTS.values()) <= {output.TREES[0], *output.FIXED_PATHS}  # the layout is backport's
    out = None
    for cmd in commands(text):
        words = shlex.split(cmd)
        if words[:1] == ["tools/backport"] and "--out" in words:
            out = words[words.index("--out") + 1]
        if words[:2] not in (["tools/image", "build"], ["tools/image", "gate"]):
            continue
        sub = image_cli.commands[words[1]]
        known = {o for p in sub.params for o in p.opts}
        used = [w for w in words[2:] if w.startswith("--")]
        assert set(used) <= known, f"{page.name}:{line}: `{cmd}` uses flags tools/image {words[1]} lacks: " \
                                   f"{sorted(set(used) - known)}"
        if out is None:
            continue
        for flag, rel in IMAGE_INPUTS.items():
            assert flag in words, f"{page.name}:{line}: `{cmd}` builds from {out} but gives no {flag}"
            assert words[words.index(flag) + 1] == f"{out}/{rel}", \
                f"{page.name}:{line}: {flag} must be {out}/{rel}, the file `tools/backport --out {out}` writes"


def test_the_readme_goes_from_a_carried_patch_to_an_image_in_one_command():
    """Issue 45: one line takes a carried patch to a built image (and names the doc for the rest)."""
    one = [cmd for _line, lang, text in blocks(REPO / "README.md") if lang == "sh" for cmd in [text]
           if "--carry" in text and "tools/image build" in text and "\n" not in text.strip()]
    assert one, "README.md: no one-line example from `tools/backport --carry` to `tools/image build`"
    assert "Build the image from a carry or a retarget" in (REPO / "docs/image-build-and-gate.md").read_text()


def test_results_readmes_name_what_their_figures_cover_not_how_they_were_made():
    """A results page names patches, dates and devices; "session 3" says nothing to its reader
    (issue 45). Code spans (file names such as ``session3-calls.md``) are left out."""
    found = []
    for page in sorted(REPO.glob("results/**/README.md")):
        prose = re.sub(r"`[^`\n]*`", "", page.read_text(encoding="utf-8"))
        found += [f"{page.relative_to(REPO)}:{n}: {line.strip()[:80]}"
                  for n, line in enumerate(prose.splitlines(), 1) if re.search(r"\bsessions?\b", line, re.I)]
    assert not found, found
