"""tools/backport annotate: the patch with one provenance tag per line in a margin, from the manifest's
per-line runs; the patch file stays a valid patch; refusals name the culprit (exit 2)."""

from __future__ import annotations

import subprocess

import pytest

from backport.annotate import annotate, load, select
from backport.cli import main

pytestmark = pytest.mark.usefixtures("engine_env")


def _run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["annotate", *args])
        raise SystemExit(0)
    cap = capsys.readouterr()
    return exc.value.code or 0, cap.out, cap.err


def test_every_patch_line_appears_once_behind_its_margin(written, capsys):
    out, b = written
    rc, text, err = _run(capsys, "--out", str(out))
    assert rc == 0
    patch = (out / "patches/latest/megatron.patch").read_text()
    body = [line.split(" | ", 1)[1] if " | " in line else "" for line in text.splitlines()]
    plus = [ln for ln in patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert [ln for ln in body if ln.startswith("+") and not ln.startswith("+++")] == plus
    added = [line for line in text.splitlines() if " | +" in line and " | +++" not in line]
    assert all(line.split()[0] in ("upstream", "ours", "carried") for line in added)
    # the user's carried line is "carried" with its carry hunk id, never "ours"
    carried = [line for line in added if "CARRIED = True" in line]
    assert carried and carried[0].split()[:2] == ["carried", "carry:megatron/bridge/models/gdn_bridge.py#1"]
    kinds = b.manifest["patch"]["added_by_kind"]
    assert err.strip() == (f"{b.manifest['patch']['hunks']} output hunks: {kinds['upstream']} upstream, "
                           f"{kinds['ours']} ours, {kinds['carried']} carried added lines")
    # the patch on disk is untouched and still applies
    assert (out / "patches/latest/megatron.patch").read_bytes() == b.patch


def test_one_command_lists_a_files_lines_not_from_upstream(written, capsys):
    out, b = written
    rc, text, _ = _run(capsys, "gated_delta_net.py", "--kind", "ours,carried", "--out", str(out))
    assert rc == 0
    added = [line for line in text.splitlines() if " | +" in line and " | +++" not in line]
    assert added and {line.split()[0] for line in added} <= {"ours", "carried"}
    gdn = next(f for f in b.manifest["files"] if f["path"].endswith("gated_delta_net.py"))
    assert len(added) == gdn["added_by_kind"]["ours"] + gdn["added_by_kind"]["carried"]
    assert "| --- a/megatron/core/ssm/gated_delta_net.py" in text and "gdn_bridge.py" not in text


def test_selectors_output_hunk_file_and_origin(written):
    out, b = written
    text, m = load(out / "patches/latest/megatron.patch", out / "patches/latest/manifest.json")
    first = m["files"][0]["hunks"][0]["id"]
    assert first.startswith("out:") and select(m, [first]) == [first]
    assert select(m, []) == [h["id"] for f in m["files"] for h in f["hunks"]]
    origin = "add-gdn-cp"
    hunks = select(m, [origin])
    assert hunks and all(any(o["origin"] == origin for o in h["origins"])
                         for f in m["files"] for h in f["hunks"] if h["id"] in hunks)
    lines = annotate(text, m, hunks)
    assert any(line.startswith(f"ours     {origin}") for line in lines)


def test_refusals_name_the_culprit(written, tmp_path, capsys):
    out, _ = written
    rc, _, err = _run(capsys, "no_such_file.py", "--out", str(out))
    assert rc == 2 and "'no_such_file.py' names no output hunk, file or origin" in err and "hint:" in err
    rc, _, err = _run(capsys, "--kind", "mine", "--out", str(out))
    assert rc == 2 and "--kind mine is not a line kind" in err
    rc, _, err = _run(capsys, "--kind", ",", "--out", str(out))
    assert rc == 2 and "--kind ',' names no line kind" in err
    other = tmp_path / "other.patch"
    other.write_bytes((out / "patches/latest/megatron.patch").read_bytes() + b"\n")
    rc, _, err = _run(capsys, "--patch", str(other), "--manifest", str(out / "patches/latest/manifest.json"))
    assert rc == 2 and "is not the one the manifest" in err
    rc, _, err = _run(capsys, "--out", str(tmp_path / "nowhere"))
    assert rc == 2 and "cannot read the patch" in err and "make patch" in err


def test_annotated_output_is_not_mistaken_for_the_patch(written, tmp_path, capsys):
    """The margins make annotate's output no patch at all (it is for reading); the patch file itself
    applies with GNU patch."""
    out, b = written
    rc, text, _ = _run(capsys, "--out", str(out))
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-r", str(b.base_tree), str(tree)], check=True)
    ok = subprocess.run(["patch", "-p1", "--dry-run", "--fuzz=0", "-d", str(tree)],
                        input=(out / "patches/latest/megatron.patch").read_bytes(), capture_output=True)
    assert ok.returncode == 0, ok.stdout
    assert all(" | " in line for line in text.splitlines())
