"""The base tree's compile record: byte_compiles compiles only what the patch changes and takes
the verdict on the base's own bytes from a record kept once per cache entry and interpreter."""

from __future__ import annotations

import builtins
import json

from backport import tree as tree_mod


def _entry(tmp_path):
    root = tmp_path / "entry"
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "ok.py").write_text("x = 1\n")
    (root / "megatron" / "core" / "bad.py").write_text("def f(:\n")
    count, digest = tree_mod.tree_digest(root / "megatron")
    (root / tree_mod.RECORD).write_text(json.dumps({"files": count, "sha256": digest}))
    return root


def test_a_base_file_that_does_not_compile_is_recorded_once_and_reused(tmp_path, monkeypatch):
    root = _entry(tmp_path)
    first = tree_mod.base_compile_errors(root)
    assert list(first) == ["megatron/core/bad.py"] and first["megatron/core/bad.py"].startswith("1: ")
    kept = list(root.glob(".compile-*.json"))
    assert len(kept) == 1
    # The second call reads the record: nothing is compiled again.
    monkeypatch.setattr(builtins, "compile", lambda *a, **k: (_ for _ in ()).throw(AssertionError("compiled")))
    assert tree_mod.base_compile_errors(root) == first


def test_the_record_belongs_to_the_entrys_digest(tmp_path):
    root = _entry(tmp_path)
    tree_mod.base_compile_errors(root)
    record = next(root.glob(".compile-*.json"))
    data = json.loads(record.read_text())
    data["sha256"], data["errors"] = "0" * 64, {}
    record.write_text(json.dumps(data))
    # A record made for other bytes is not trusted: the base is compiled again.
    assert list(tree_mod.base_compile_errors(root)) == ["megatron/core/bad.py"]


def test_no_cache_entry_means_no_record(tmp_path):
    (tmp_path / "megatron").mkdir()
    assert tree_mod.base_compile_errors(tmp_path) is None
