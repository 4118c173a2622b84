"""backport.workspace: zero-fuzz hunks with recorded offsets, and per-line origins."""

from __future__ import annotations

import difflib

import pytest
from unidiff import PatchSet

from backport.errors import ApplyError
from backport.workspace import FileState, Workspace


def hunks_between(old: list[str], new: list[str], n: int = 3) -> list:
    diff = "".join(difflib.unified_diff(old, new, "a/f.py", "b/f.py", n=n))
    return [h for pfile in PatchSet(diff) for h in pfile]


def lines(*names: str) -> list[str]:
    return [f"{x}\n" for x in names]


BASE = lines(*(f"l{i}" for i in range(10)))


@pytest.mark.parametrize("prefix, offset", [(0, 0), (2, 2), (5, 5)])
def test_hunk_lands_with_its_offset_recorded(prefix, offset):
    new = BASE[:4] + lines("added") + BASE[5:]
    (hunk,) = hunks_between(BASE, new)
    state = FileState.from_base("f.py", "".join(lines(*(f"p{i}" for i in range(prefix))) + BASE))
    assert state.apply_hunk(hunk, "up#1") == offset
    assert state.lines == lines(*(f"p{i}" for i in range(prefix))) + new


def test_negative_offset_when_the_tree_lacks_lines():
    old = lines("x", "y", "z") + BASE
    new = lines("x", "y", "z") + BASE[:6] + lines("changed") + BASE[7:]
    (hunk,) = hunks_between(old, new)
    state = FileState.from_base("f.py", "".join(BASE))
    assert state.apply_hunk(hunk, "up#1") == -3
    assert state.text == "".join(BASE[:6] + lines("changed") + BASE[7:])


@pytest.mark.parametrize("tree", [
    lines(*(f"l{i}" for i in range(3)), "L3 differs", *(f"l{i}" for i in range(4, 10))),   # context differs
    lines(*(f"l{i}" for i in range(4)), "l4 differs", *(f"l{i}" for i in range(5, 10))),   # removed line differs
    lines(*(f"l{i}" for i in range(4)), " l4", *(f"l{i}" for i in range(5, 10))),          # whitespace only
    [],                                                                                       # empty file
])
def test_hunk_that_does_not_match_exactly_is_apply_error(tree):
    new = BASE[:4] + lines("added") + BASE[5:]
    (hunk,) = hunks_between(BASE, new)
    state = FileState.from_base("pkg/f.py", "".join(tree))
    before = list(state.lines)
    with pytest.raises(ApplyError) as exc:
        state.apply_hunk(hunk, "up#7")
    assert exc.value.exit_code == 6
    assert "pkg/f.py" in exc.value.message and "up#7" in exc.value.message and "zero fuzz" in exc.value.message
    assert state.lines == before


def test_identical_hunks_land_in_order():
    block = lines("def f():", "    x = 1", "    return x")
    filler = lines(*(f"# {i}" for i in range(5)))
    changed = block[:1] + lines("    x = 2") + block[2:]
    old = filler + block + filler + block + filler
    new = filler + changed + filler + changed + filler
    h1, h2 = hunks_between(old, new)
    assert str(h1).splitlines()[1:] == str(h2).splitlines()[1:]  # same text, different places
    state = FileState.from_base("f.py", "".join(lines("head1", "head2") + old))
    assert [state.apply_hunk(h1, "up#1"), state.apply_hunk(h2, "up#2")] == [2, 2]
    assert state.lines == lines("head1", "head2") + new
    assert state.removed_by == {8: "up#1", 16: "up#2"}


def test_offset_is_carried_forward_to_the_next_hunk():
    """The second hunk's context also occurs earlier (unchanged); the carried offset of the
    first hunk (which adds 20 lines) puts the search at the right copy."""
    ctx = lines("k", "x", "k")
    old = lines("a0", "a1", "a2") + lines("u") + ctx + lines("v", "w") + ctx + lines("t0", "t1", "t2")
    new_mid = ctx[:1] + lines("y") + ctx[2:]
    new = lines("a0", "a1") + lines(*(f"n{i}" for i in range(20))) + lines("a2", "u") + ctx + lines("v", "w") + new_mid + lines("t0", "t1", "t2")
    h1, h2 = hunks_between(old, new, n=1)
    assert [line.value for line in h2 if line.is_context or line.is_removed] == ctx
    state = FileState.from_base("f.py", "".join(old))
    state.apply_hunk(h1, "up#1")
    state.apply_hunk(h2, "up#2")
    assert state.lines == new


def test_new_file_hunk_creates_the_file_and_rejects_an_existing_one():
    (hunk,) = hunks_between([], lines("a", "b"))
    state = FileState.from_base("new.py", None)
    assert state.apply_hunk(hunk, "up#1") == 0
    assert state.text == "a\nb\n" and state.tags == [("origin", "up#1")] * 2
    existing = FileState.from_base("new.py", "x\n")
    with pytest.raises(ApplyError, match="creates a file that already exists"):
        existing.apply_hunk(hunk, "up#1")


def test_apply_hunk_tags_added_lines_and_records_removals():
    new = BASE[:2] + lines("two", "three") + BASE[4:]
    (hunk,) = hunks_between(BASE, new)
    state = FileState.from_base("f.py", "".join(BASE))
    state.apply_hunk(hunk, "up#1")
    assert state.tags == [("base", 0), ("base", 1), ("origin", "up#1"), ("origin", "up#1")] + [
        ("base", i) for i in range(4, 10)]
    assert state.removed_by == {2: "up#1", 3: "up#1"}
    assert state.base_lines == BASE


def test_replace_text_tags_only_changed_lines():
    state = FileState.from_base("f.py", "".join(BASE))
    assert state.replace_text("".join(BASE[:3] + lines("new") + BASE[5:] + lines("tail")), "step-a") is True
    assert state.tags == [("base", 0), ("base", 1), ("base", 2), ("origin", "step-a")] + [
        ("base", i) for i in range(5, 10)] + [("origin", "step-a")]
    assert state.removed_by == {3: "step-a", 4: "step-a"}


def test_replace_text_with_the_same_text_changes_nothing():
    state = FileState.from_base("f.py", "".join(BASE))
    assert state.replace_text("".join(BASE), "step-a") is False
    assert state.tags == [("base", i) for i in range(10)] and state.removed_by == {}


def test_removed_by_records_the_first_origin_that_removed_a_base_line():
    state = FileState.from_base("f.py", "".join(BASE))
    state.replace_text("".join(BASE[:5] + lines("mine") + BASE[6:]), "step-a")
    state.replace_text("".join(BASE[:5] + lines("theirs") + BASE[6:]), "step-b")
    assert state.removed_by == {5: "step-a"}  # base line 5 went with step-a; step-b replaced step-a's line
    assert state.tags[5] == ("origin", "step-b")


def test_workspace_loads_once_and_lists_changed_files_sorted():
    reads = []

    def reader(path):
        reads.append(path)
        return None if path == "new.py" else "x\n"

    ws = Workspace()
    for path in ("z.py", "a.py", "new.py", "same.py"):
        ws.get(path, reader)
    ws.get("z.py", reader)
    ws.get("z.py", reader).replace_text("y\n", "s")
    ws.get("a.py", reader).replace_text("y\n", "s")
    assert reads == ["z.py", "a.py", "new.py", "same.py"]
    # new.py was looked up but never created: no empty file is emitted for it
    assert [f.path for f in ws.changed()] == ["a.py", "z.py"]
