"""``diff -r`` without ``-N`` writes "Only in <dir>: <name>" for a file on one side only and no
hunk for it: git apply and GNU patch skip the line, so the carry would silently lack that file.
Such a carry is refused (exit 6) naming the file; ``diff -ruN`` output and git patches whose text
happens to hold such a line (a format-patch mail's message) are read as before."""

from __future__ import annotations

import pytest

from backport.carry import CarryRefused, load_carry

_SECTION = ("diff -ru a/megatron/core/x.py b/megatron/core/x.py\n"
            "--- a/megatron/core/x.py\t2026-01-01 00:00:00.000000000 +0000\n"
            "+++ b/megatron/core/x.py\t2026-01-01 00:00:00.000000000 +0000\n"
            "@@ -1,2 +1,3 @@\n"
            "+# downstream\n"
            " a = 1\n"
            " b = 2\n")


@pytest.mark.parametrize("where", ["before", "after"])
def test_diff_r_only_in_line_is_refused_naming_the_file(tmp_path, where):
    only = "Only in b/megatron/core: extra.py\n"
    carry = tmp_path / "down.patch"
    carry.write_text(only + _SECTION if where == "before" else _SECTION + only, encoding="utf-8")
    with pytest.raises(CarryRefused) as info:
        load_carry(carry)
    assert info.value.reason == "only-in"
    assert "megatron/core/extra.py" in str(info.value) and "Only in b/megatron/core: extra.py" in str(info.value)
    assert "diff -ruN" in info.value.hint


def test_diff_ruN_and_git_mail_mentioning_only_in_are_read(tmp_path):
    carry = tmp_path / "down.patch"
    carry.write_text(_SECTION, encoding="utf-8")
    assert [f.path for f in load_carry(carry).files] == ["megatron/core/x.py"]
    mail = ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: a <a@b>\nSubject: [PATCH] x\n\n"
            "Only in CP: a line of the message that looks like diff -r's.\n---\n"
            "diff --git a/megatron/core/x.py b/megatron/core/x.py\n" + _SECTION.split("\n", 1)[1] + "-- \n2.39.5\n")
    carry.write_text(mail, encoding="utf-8")
    assert [f.path for f in load_carry(carry).files] == ["megatron/core/x.py"]
