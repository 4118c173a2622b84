"""Carried downstream patches on the real pinned tree (issue 10; skips, saying why, without mirrors).

The carries are made at run time from the base's own ``gated_delta_net.py`` (read from the
mirror, never committed): a comment line inside ``GatedDeltaNet.forward`` just before the
input projection, a one-line rename of the projection attribute call, the tuple-index fix
already present in an equivalent form, and Dynamo disabled by a context manager at the
call site (kept around the new forward's call, fix 7a ``already-present``; a compile counter
on the patched tree shows Dynamo never traces the helper in the recipe's form or the
user's), a context manager that is no fix form there (exit 6); class-level lines next to
code later steps change (merge), a def the transplant would replace and a config field the
recipe would add again (both exit 6).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from backport import engine, options
from backport.errors import ApplyError

from test_real_mirrors import BRIDGE, MLM, RECIPE  # noqa: F401  (same mirror discovery and skip)

BASE_SHA = "85bced0ae6ab46f61a0fd774074a3273daf6ae02"
GDN = "megatron/core/ssm/gated_delta_net.py"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(MLM is None or BRIDGE is None,
                       reason="no Megatron-LM/Megatron-Bridge mirror: set MEGATRON_LM_REPO and MEGATRON_BRIDGE_REPO "
                              "(or run tools/backport once to fill the cache)"),
]
ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent", "TZ": "UTC"}


def _base_gdn(path: str = GDN) -> str:
    return subprocess.run(["git", "--git-dir", MLM if MLM.endswith(".git") or Path(MLM, "HEAD").exists()
                           else str(Path(MLM) / ".git"), "show", f"{BASE_SHA}:{path}"],
                          check=True, capture_output=True, env={**os.environ, **ENV}).stdout.decode()


def _carry(tmp: Path, edit, path: str = GDN) -> Path:
    base = _base_gdn(path)
    new = edit(base)
    assert new != base, "the edit did not apply to the base file; the base changed"
    repo = tmp / "src"
    (repo / Path(path).parent).mkdir(parents=True)
    env = {**os.environ, **ENV}
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, env=env).stdout  # noqa: E731
    run("init", "-q")
    (repo / path).write_text(base)
    run("add", "-A")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    (repo / path).write_text(new)
    path = tmp / "downstream.patch"
    path.write_bytes(run("diff", "--full-index"))
    return path


@pytest.fixture(scope="module")
def cache(real_cache):
    return real_cache


def _build(cache: Path, carry: Path):
    return engine.build(options.Options(recipe=RECIPE, megatron_lm=MLM, megatron_bridge=BRIDGE, cache_dir=cache,
                                       date="20261130", carry=carry, import_check=False))


def _forward_of(b, tmp: Path) -> str:
    """Source of GatedDeltaNet.forward in the patched file (the output patch applied with GNU patch)."""
    import ast

    section = "diff --git" + b.patch.decode().split(f"diff --git a/{GDN} ")[1].split("diff --git")[0]
    section = f"diff --git a/{GDN} " + section[len("diff --git"):]
    tree = tmp / "patched"
    (tree / Path(GDN).parent).mkdir(parents=True)
    (tree / GDN).write_bytes((b.base_tree / GDN).read_bytes())
    subprocess.run(["patch", "-p1", "--fuzz=0", "--batch"], cwd=tree, input=section.encode(), check=True,
                   capture_output=True)
    text = (tree / GDN).read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "GatedDeltaNet")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    return "".join(text.splitlines(keepends=True)[fn.lineno - 1:fn.end_lineno])


COMMENT = "        # downstream: the projection stays in the autocast dtype\n"


def test_comment_before_input_projection_survives_the_forward_rewrite(tmp_path, cache):
    carry = _carry(tmp_path, lambda t: t.replace("        # Input projection\n", COMMENT + "        # Input projection\n", 1)
                   .replace("    param = param[slices]\n", "    param = param[(*slices,)]\n", 1))
    b = _build(cache, carry)
    forward = _forward_of(b, tmp_path)
    assert COMMENT + "        # Input projection\n" in forward
    m = b.manifest
    assert m["origins"]["fix-local-cp-tuple-index"]["status"] == "already-present"
    assert "param[(*slices,)]" in b.patch.decode() and "param[tuple(slices)]" not in b.patch.decode()
    checks = {c["check"]: c for c in m["verification"]}
    assert checks["carry_survival"]["ok"] and checks["carry_survival"]["detail"].startswith("2 carried hunk(s)")
    carried = [o for f in m["files"] for h in f["hunks"] for o in h["origins"] if o["kind"] == "carried"]
    assert sum(o["added"] for o in carried) == 2


def test_renamed_projection_call_survives_the_forward_rewrite(tmp_path, cache):
    carry = _carry(tmp_path, lambda t: t.replace("qkvzba, _ = self.in_proj(hidden_states)",
                                                 "qkvzba, _ = self.in_proj_downstream(hidden_states)", 1))
    b = _build(cache, carry)
    forward = _forward_of(b, tmp_path)
    assert "qkvzba, _ = self.in_proj_downstream(hidden_states)" in forward
    assert "self.in_proj(hidden_states)" not in forward
    assert {c["check"]: c["ok"] for c in b.manifest["verification"]}["carry_survival"]


CALL = ("        query, key, value, gate, beta, alpha = self._prepare_qkv_for_gated_delta_rule(\n"
        "            qkv, gate, beta, alpha, batch, seq_len\n        )\n")
GUARD = "        with torch._dynamo.config.patch(disable=True):\n"


def _wrap_call(header: str):
    """The base's call of the helper inside ``header`` (a ``with`` line of forward's indent)."""
    return lambda t: t.replace(CALL, header + "".join("    " + ln for ln in CALL.splitlines(keepends=True)), 1)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, cache):
    """The real downstream form of fix 7a: Dynamo off at forward's call site, @jit_fuser kept."""
    return _build(cache, _carry(tmp_path_factory.mktemp("guard"), _wrap_call(GUARD)))


def test_call_site_dynamo_guard_is_kept_in_the_users_form(guarded, tmp_path):
    m = guarded.manifest
    assert m["origins"]["fix-prepare-qkv-no-dynamo"]["status"] == "already-present"
    origin = m["origins"][f"carry:{GDN}#1"]
    assert origin["status"] == "applied" and [k["fix"] for k in origin["kept_forms"]] == ["fix-prepare-qkv-no-dynamo"]
    forward = _forward_of(guarded, tmp_path)
    assert (GUARD + "            query, key, value, gate, beta, alpha = self._prepare_qkv_for_gated_delta_rule(\n"
            "                qkv, gate, beta, alpha, batch, seq_len, cp_size_headwise\n            )\n") in forward
    patch = guarded.patch.decode()
    assert "torch.compiler.disable" not in patch and "-    @jit_fuser" not in patch  # our decorator not added
    assert {c["check"]: c["ok"] for c in m["verification"]}["carry_survival"]
    from backport.manifest_md import render_markdown

    assert "Kept in the carried form: `with torch._dynamo.config.patch(disable=True):`" in render_markdown(m)


def test_call_site_disable_wrapper_is_kept_in_the_users_form(tmp_path, cache):
    head = "        query, key, value, gate, beta, alpha = self._prepare_qkv_for_gated_delta_rule(\n"
    wrapped = ("        query, key, value, gate, beta, alpha = torch.compiler.disable(\n"
               "            self._prepare_qkv_for_gated_delta_rule\n        )(\n")
    b = _build(cache, _carry(tmp_path, lambda t: t.replace(head, wrapped, 1)))
    assert b.manifest["origins"]["fix-prepare-qkv-no-dynamo"]["status"] == "already-present"
    assert wrapped + "            qkv, gate, beta, alpha, batch, seq_len, cp_size_headwise\n" in _forward_of(b, tmp_path)
    assert "+    @torch.compiler.disable" not in b.patch.decode()


def test_call_site_context_manager_that_is_no_fix_form_is_exit_6(tmp_path, cache):
    with pytest.raises(ApplyError) as exc:
        _build(cache, _carry(tmp_path, _wrap_call('        with torch.autograd.profiler.record_function("qkv"):\n')))
    msg = exc.value.message
    assert exc.value.exit_code == 6
    assert f"carried hunk 1 of {GDN}" in msg and "recipe step adapt-gdn-forward" in msg
    assert "first conflicting line" in msg and "superseded" in exc.value.hint


def _patched_tree(b, tmp: Path) -> Path:
    """The base tree with the output patch applied by GNU patch (as the image does)."""
    import shutil

    tree = tmp / "tree"
    shutil.copytree(b.base_tree, tree, symlinks=True)
    subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--quiet"], cwd=tree, input=b.patch, check=True,
                   capture_output=True)
    return tree


def _probe(tree: Path) -> dict:
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("dynamo_probe.py")), str(tree)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_torch = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None or __import__("importlib").util.find_spec("fla") is None,
    reason="torch and flash-linear-attention are not installed in this interpreter: the compile-counter proof "
           "builds GatedDeltaNet from the patched tree (pip install -e '.[verify]' or use the project's .venv)")


@needs_torch
@pytest.mark.parametrize("form", ["recipe", "carried"])
def test_dynamo_never_traces_the_helper_in_either_form(form, guarded, cache, tmp_path):
    """Decision 7a on the real patched tree, counted: torch.compile(forward) with a
    CompileCounter backend compiles forward's frames, and no graph node comes from
    _prepare_qkv_for_gated_delta_rule, nor is the helper compiled as a frame of its own; our
    decorator protects it when called alone too, the user's guard only at forward's call site
    (alone, Dynamo goes in: the guard is what keeps it off)."""
    b = guarded if form == "carried" else _build(cache, None)
    got = _probe(_patched_tree(b, tmp_path))
    assert got["forward_frames"] > 0 and got["forward_ops"] > 50, got  # Dynamo really traced forward
    assert got["helper_in_graph"] is False and got["helper_frames"] == 0, got
    assert got["max_abs_diff"] < 1e-5, got
    if form == "recipe":
        assert got["decorators"] == ["torch.compiler.disable"], got
        assert got["direct_ops"] == 0 and not got["direct_helper_in_graph"] and got["direct_error"] is None, got
    else:
        assert got["decorators"] == ["jit_fuser"], got
        assert got["direct_helper_in_graph"] or (got["direct_error"] or "").endswith("(in the helper)"), got


@pytest.mark.parametrize("edit, added", [
    (lambda t: t.replace('    """\n\n    def __init__(', '    """\n\n    carry_flag = True  # CARRY21\n\n    def __init__(', 1),
     "+    carry_flag = True  # CARRY21\n"),
    (lambda t: t.replace("    def forward(", "    @torch._dynamo.disable\n    def forward(", 1),
     "+    @torch._dynamo.disable\n"),
])
def test_class_level_carried_lines_are_not_refused_by_later_steps(tmp_path, cache, edit, added):
    b = _build(cache, _carry(tmp_path, edit))
    assert added in b.patch.decode()
    assert {c["check"]: c["ok"] for c in b.manifest["verification"]}["carry_survival"]


def test_carried_def_replaced_by_the_transplant_is_exit_6(tmp_path, cache):
    psp = "megatron/core/packed_seq_params.py"
    carry = _carry(tmp_path, lambda t: t + ('\n\ndef resolve_cp_group(static_cp_group, packed_seq_params=None):\n'
                                            '    """CARRY7 downstream version."""\n'
                                            "    return static_cp_group  # CARRY7\n"), psp)
    with pytest.raises(ApplyError) as exc:
        _build(cache, carry)
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{psp}#1" in msg and "in resolve_cp_group" in msg
    assert "recipe step prereq-resolve-cp-group (transplant)" in msg and "first conflicting line" in msg


def test_carried_field_bound_again_by_the_config_step_is_exit_6(tmp_path, cache):
    cfg = "megatron/core/transformer/transformer_config.py"
    carry = _carry(tmp_path, lambda t: t.replace("    hidden_size: int", '    linear_cp_mode: str = "chunkwise"  # CARRY22\n'
                                                 "    hidden_size: int", 1), cfg)
    with pytest.raises(ApplyError) as exc:
        _build(cache, carry)
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{cfg}#1" in msg and "recipe step adapt-config-linear-cp-mode" in msg
    assert "linear_cp_mode" in msg and "CARRY22" in msg
