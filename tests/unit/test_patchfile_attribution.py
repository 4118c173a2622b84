"""backport.patchfile.attribute_hunks: lines git's diff aligns differently from the step-wise
tracking get a neighbour's origin, and that guess never lands on the user's carry while a
recipe line is in the hunk (a newcomer's one-line carried comment was reported as
"added 1, removed 1" in session 20)."""

from types import SimpleNamespace

from backport.patchfile import attribute_hunks

PATCH = """\
--- a/m.py
+++ b/m.py
@@ -1,5 +1,5 @@
 def f():
+    x = 1
-    a = None
-    b = None
-    c = None
+    pop()
+    # DOWNSTREAM: keep this note
     return a
"""
ORIGINS = {
    "adapt-f": {"kind": "adaptation"},
    "carry:m.py#1": {"kind": "carried"},
}


def _ws(removed_by):
    # target lines: 1 def, 2 x = 1 (recipe), 3 pop() (untracked), 4 # DOWNSTREAM (carried), 5 return
    tags = [("base",), ("origin", "adapt-f"), ("base",), ("origin", "carry:m.py#1"), ("base",)]
    state = SimpleNamespace(tags=tags, removed_by=removed_by, mode_origin=None, exists=True)
    return SimpleNamespace(files={"m.py": state})


def _origins_of(files):
    return {o["origin"]: (o["added"], o["removed"]) for o in files[0]["hunks"][0]["origins"]}


def test_untracked_lines_next_to_a_carried_line_go_to_the_recipe():
    # "-    c = None" and "+    pop()" were not tracked; the carried comment is their nearest
    # attributed line, but the carry added one line and removed none.
    files, stats = attribute_hunks(PATCH, _ws({}), ORIGINS)
    assert _origins_of(files) == {"adapt-f": (2, 3), "carry:m.py#1": (1, 0)}
    assert stats == {"exact": 2, "by_neighbour": 4}


def test_an_untracked_removal_tied_between_a_carried_line_and_a_recipe_removal():
    # The shape session 20's newcomer hit (GatedDeltaNet.forward, a one-line carried comment):
    # the carried "+" line and the recipe's next "-" line are both one line away from an
    # untracked "-" line; the tie went to the carry ("added 1, removed 1").
    patch = """\
--- a/m.py
+++ b/m.py
@@ -1,4 +1,4 @@
 def f():
+    x = 1
+    # DOWNSTREAM: keep this note
-    a = None
-    b = None
     return a
"""
    tags = [("base",), ("origin", "adapt-f"), ("origin", "carry:m.py#1"), ("base",)]
    ws = SimpleNamespace(files={"m.py": SimpleNamespace(tags=tags, removed_by={2: "adapt-f"},
                                                        mode_origin=None, exists=True)})
    files, stats = attribute_hunks(patch, ws, ORIGINS)
    assert _origins_of(files) == {"adapt-f": (1, 2), "carry:m.py#1": (1, 0)}
    assert stats == {"exact": 3, "by_neighbour": 1}


def test_a_carry_alone_in_its_hunk_still_takes_its_untracked_neighbours():
    patch = """\
--- a/m.py
+++ b/m.py
@@ -1,4 +1,4 @@
 def f():
-    b = None
+    # DOWNSTREAM: keep this note
     return a
 
"""
    tags = [("base",), ("origin", "carry:m.py#1"), ("base",), ("base",)]
    ws = SimpleNamespace(files={"m.py": SimpleNamespace(tags=tags, removed_by={}, mode_origin=None, exists=True)})
    files, stats = attribute_hunks(patch, ws, ORIGINS)
    assert _origins_of(files) == {"carry:m.py#1": (1, 1)}
    assert stats == {"exact": 1, "by_neighbour": 1}


def test_an_untracked_line_prefers_a_neighbour_of_its_own_sign():
    # "-    a = None" was removed by adapt-g; the untracked "-    b = None" and "-    c = None"
    # take adapt-g (same sign), not adapt-f's "+    x = 1", which is as near or nearer
    origins = dict(ORIGINS, **{"adapt-g": {"kind": "adaptation"}})
    files, _ = attribute_hunks(PATCH, _ws({1: "adapt-g"}), origins)
    assert _origins_of(files)["adapt-g"] == (0, 3)


def test_added_lines_are_counted_as_upstreams_or_ours_by_content():
    """With upstream's lines of the file, each origin's added lines split into lines equal to an
    upstream line (indentation aside: transforms re-indent) and ours (line_class: a blank line has no class)."""
    from backport.upstream_lines import line_class

    up = frozenset({"def f():", "return a", "pop()"})
    assert line_class("        pop()", up) == "upstream"
    assert line_class("    pop() ", up) == "upstream"
    assert line_class("    push()", up) == "ours"
    assert line_class("   ", up) is None
    assert line_class("pop()", frozenset()) == "ours"
    files, _ = attribute_hunks(PATCH, _ws({}), ORIGINS, upstream_lines={"m.py": up})
    counts = {o["origin"]: (o["added"], o["added_upstream"], o["added_ours"], o["added_carried"])
              for o in files[0]["hunks"][0]["origins"]}
    # adapt-f added "x = 1" (ours) and "pop()" (upstream's); the carry's comment is carried, never "ours"
    assert counts == {"adapt-f": (2, 1, 1, 0), "carry:m.py#1": (1, 0, 0, 1)}
    plain, _ = attribute_hunks(PATCH, _ws({}), ORIGINS)
    assert "added_upstream" not in plain[0]["hunks"][0]["origins"][0]


def test_every_added_line_has_a_kind_and_an_origin_in_runs():
    """Per-line provenance: ``lines`` runs cover the hunk's added lines in order, each with one of
    three kinds (a user's carried line is "carried", never "ours"); removed lines have their origin;
    output hunk ids are not upstream hunk ids."""
    up = frozenset({"pop()"})
    files, _ = attribute_hunks(PATCH, _ws({}), ORIGINS, upstream_lines={"m.py": up})
    hunk = files[0]["hunks"][0]
    assert hunk["id"] == "out:m.py#1"
    assert hunk["lines"] == [{"kind": "ours", "origin": "adapt-f", "n": 1},
                             {"kind": "upstream", "origin": "adapt-f", "n": 1},
                             {"kind": "carried", "origin": "carry:m.py#1", "n": 1}]
    assert sum(r["n"] for r in hunk["lines"]) == hunk["added"]
    assert sum(r["n"] for r in hunk["removed_lines"]) == hunk["removed"]
    assert hunk["added_by_kind"] == {"upstream": 1, "ours": 1, "carried": 1} == files[0]["added_by_kind"]


def test_blank_and_bracket_lines_take_their_neighbours_kind():
    from backport.patchfile import line_kinds

    origins = {"up#1": {"kind": "upstream-verbatim"}, "step": {"kind": "adaptation"},
               "carry:m.py#1": {"kind": "carried"}}
    labels = [["+", "step"], ["+", "step"], ["+", "step"], ["-", "step"], ["+", "up#1"], ["+", "carry:m.py#1"],
              ["+", "step"]]
    # content classes: "upstream" line, a blank (None), a ")" (None), removed, then any content
    classes = ["upstream", None, None, None, "ours", "ours", None]
    assert line_kinds(labels, classes, origins) == [
        "upstream", "upstream", "upstream", None, "upstream", "carried", "upstream"]
    assert line_kinds([["+", "step"]], [None], origins) == ["ours"]
