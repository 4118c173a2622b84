"""Carried changes survive the recipe, or the run fails (issue 10, part 1).

Three-way merge of carried edits into functions a step rewrites (synthetic unit tests of
the merge and through the engine on the fake repositories), ``superseded`` declarations,
the ``carry_survival`` check, and preserved fixes recognised by their AST effect.
"""

from __future__ import annotations

import pytest

from backport.carry import carry_workspace
from backport.engine import build
from backport.errors import ApplyError, RecipeError, VerificationError
from backport.manifest_md import render_markdown
from backport.recipe import load_recipe
from backport.transforms import REGISTRY, Result
from backport.transforms.fixes import dynamo_state, tuple_index_state
from backport.transforms.merge import merge3, merge_carried_functions

from conftest import gdn_text, git_diff, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")

BASE = '''"""Layer (test data)."""


class Layer:
    def __init__(self):
        self.in_proj = None

    def forward(self, x):
        x = self.norm(x)

        # Input projection
        qkv = self.in_proj(x)
        qkv = qkv.float()

        out = self.core(qkv)
        return out


def helper():
    return 1
'''

NEW_FORWARD = '''    def forward(self, x, mode="headwise"):
        plan = self.plan(mode)
        x = self.norm(x)

        # Input projection
        qkv = self.in_proj(x)
        qkv = qkv.float()

        out = self.route(plan, qkv)
        return out
'''


class _Step:
    id = "adapt-forward"
    kind = "adaptation"
    transform = "rewrite_forward"


def rewrite_forward(text: str) -> str:
    """A stand-in for gdn_linear_cp_forward: replaces Layer.forward wholesale."""
    start = text.index("    def forward(")
    end = text.index("\n\ndef helper")
    return text[:start] + NEW_FORWARD + text[end:]


def _carried(tmp_path, new_text: str):
    carry_dir = tmp_path / "carry-src"
    patch = git_diff(carry_dir, {"m/layer.py": BASE}, {"m/layer.py": new_text})
    (tmp_path / "c.patch").write_text(patch)
    base = tmp_path / "base"
    (base / "m").mkdir(parents=True)
    (base / "m" / "layer.py").write_text(BASE)
    carry, ws = carry_workspace(tmp_path / "c.patch", base)
    return carry.hunks, ws.files["m/layer.py"].text


def test_comment_before_the_input_projection_is_merged_into_the_new_body(tmp_path):
    hunks, carried = _carried(tmp_path, BASE.replace("        # Input projection\n",
                                                     "        # downstream: keep fp32 here\n        # Input projection\n"))
    assert [h.symbol for h in hunks] == ["Layer.forward"]
    out = merge_carried_functions(BASE, carried, rewrite_forward(carried), hunks, _Step, "m/layer.py", set())
    assert out == rewrite_forward(BASE).replace("        # Input projection\n",
                                                "        # downstream: keep fp32 here\n        # Input projection\n")


def test_renamed_projection_call_is_merged_into_the_new_body(tmp_path):
    hunks, carried = _carried(tmp_path, BASE.replace("qkv = self.in_proj(x)", "qkv = self.in_proj_fp8(x)"))
    out = merge_carried_functions(BASE, carried, rewrite_forward(carried), hunks, _Step, "m/layer.py", set())
    assert "qkv = self.in_proj_fp8(x)" in out and "self.route(plan, qkv)" in out
    assert "self.in_proj(x)" not in out


def test_real_conflict_fails_naming_hunk_line_and_step(tmp_path):
    hunks, carried = _carried(tmp_path, BASE.replace("out = self.core(qkv)", "out = self.core_v2(qkv)"))
    with pytest.raises(ApplyError) as exc:
        merge_carried_functions(BASE, carried, rewrite_forward(carried), hunks, _Step, "m/layer.py", set())
    msg = exc.value.message
    assert exc.value.exit_code == 6
    assert "carried hunk 1 of m/layer.py" in msg and "carry:m/layer.py#1" in msg
    assert "recipe step adapt-forward" in msg and "'        out = self.core_v2(qkv)'" in msg
    assert "superseded" in exc.value.hint and "update the recipe step" not in exc.value.hint


def test_superseded_hunk_lets_the_new_body_win(tmp_path):
    hunks, carried = _carried(tmp_path, BASE.replace("out = self.core(qkv)", "out = self.core_v2(qkv)"))
    out = merge_carried_functions(BASE, carried, rewrite_forward(carried), hunks, _Step, "m/layer.py",
                                  {"carry:m/layer.py#1"})
    assert out == rewrite_forward(BASE)


def test_step_that_edits_in_place_keeps_its_result(tmp_path):
    hunks, carried = _carried(tmp_path, BASE.replace("qkv = self.in_proj(x)", "qkv = self.in_proj_fp8(x)"))
    after = carried.replace("out = self.core(qkv)", "out = self.core(qkv, cp=True)")
    assert merge_carried_functions(BASE, carried, after, hunks, _Step, "m/layer.py", set()) == after


def test_merge3_counts_conflicts():
    assert merge3("a\nB\nc\n", "a\nb\nc\n", "a\nb\nc\nd\n") == ("a\nB\nc\nd\n", 0)
    text, n = merge3("a\nB\nc\n", "a\nb\nc\n", "a\nX\nc\n")
    assert n == 1 and "<<<<<<< new" in text and "||||||| base" in text


# --- through the engine on the fake repositories -------------------------------------------------

def _recipe_with(fake_repos, tmp_path, *steps, superseded=None):
    data = recipe_data(fake_repos)
    data["steps"] += list(steps)
    if superseded:
        data["superseded"] = superseded
    return write_recipe(tmp_path / "r.yaml", data)


FORWARD_STEP = {"id": "adapt-forward", "kind": "adaptation", "path": "megatron/core/ssm/gated_delta_net.py",
                "transform": "gdn_linear_cp_forward", "why": "our three-mode forward replaces the base forward"}
DYNAMO_STEP = {"id": "fix-no-dynamo", "kind": "fix", "path": "megatron/core/ssm/gated_delta_net.py",
               "transform": "fix_prepare_qkv_no_dynamo", "why": "preserved downstream fix: no Dynamo"}


def _carry(tmp_path, new_gdn: str, extra: dict | None = None):
    before = {"megatron/core/ssm/gated_delta_net.py": gdn_text()}
    after = {"megatron/core/ssm/gated_delta_net.py": new_gdn}
    if extra:
        before.update({k: v[0] for k, v in extra.items()})
        after.update({k: v[1] for k, v in extra.items()})
    path = tmp_path / "down.patch"
    path.write_text(git_diff(tmp_path / "carry-src", before, after))
    return path


def test_engine_conflict_with_the_forward_rewrite_is_exit_6(tmp_path, fake_repos, make_options):
    carry = _carry(tmp_path, gdn_text().replace("        return hidden_states\n",
                                                "        return hidden_states * 2\n"))
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe_with(fake_repos, tmp_path, FORWARD_STEP), carry=carry))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and "carry:megatron/core/ssm/gated_delta_net.py#1" in msg
    assert "recipe step adapt-forward" in msg and "GatedDeltaNet.forward" in msg
    assert "return hidden_states * 2" in msg


def test_engine_superseded_hunk_is_recorded_with_its_reason(tmp_path, fake_repos, make_options):
    carry = _carry(tmp_path, gdn_text().replace("        return hidden_states\n",
                                                "        return hidden_states * 2\n"))
    why = "the backported forward scales inside the new route"
    recipe = _recipe_with(fake_repos, tmp_path, FORWARD_STEP, superseded=[
        {"hunk": "carry:megatron/core/ssm/gated_delta_net.py#1", "step": "adapt-forward", "why": why}])
    b = build(make_options(recipe, carry=carry))
    origin = b.manifest["origins"]["carry:megatron/core/ssm/gated_delta_net.py#1"]
    assert origin["status"] == "superseded" and origin["superseded_why"] == why
    assert origin["superseded_by"] == "adapt-forward"
    assert "hidden_states * 2" not in b.patch.decode()
    survival = next(c for c in b.manifest["verification"] if c["check"] == "carry_survival")
    assert "1 superseded" in survival["detail"]
    assert why in render_markdown(b.manifest)


def test_superseded_must_name_a_step_of_the_recipe(tmp_path, fake_repos):
    data = recipe_data(fake_repos)
    data["superseded"] = [{"hunk": "carry:x.py#1", "step": "no-such-step", "why": "a reason long enough"}]
    with pytest.raises(RecipeError) as exc:
        load_recipe(write_recipe(tmp_path / "r.yaml", data))
    assert "no-such-step" in exc.value.message


def test_step_that_drops_a_carried_change_fails_carry_survival(tmp_path, fake_repos, make_options, monkeypatch):
    def drop(text, path):
        return Result(text.replace("CARRIED_FLAG = True\n", "").replace('"""Toy layer."""', '"""Toy layer!"""'))

    monkeypatch.setitem(REGISTRY, "drop_carried", drop)
    step = {"id": "adapt-drop", "kind": "adaptation", "path": "megatron/core/ssm/gated_delta_net.py",
            "transform": "drop_carried", "why": "a step that loses a carried line"}
    carry = _carry(tmp_path, gdn_text().replace("import torch\n", "import torch\n\nCARRIED_FLAG = True\n"))
    with pytest.raises(VerificationError) as exc:
        build(make_options(_recipe_with(fake_repos, tmp_path, step), carry=carry))
    assert exc.value.exit_code == 7 and "carry_survival" in exc.value.message
    assert "carry:megatron/core/ssm/gated_delta_net.py#1" in exc.value.message
    assert "CARRIED_FLAG = True" in exc.value.message


def test_carried_call_site_context_manager_is_kept_as_already_present(tmp_path, fake_repos, make_options):
    user = gdn_text().replace(
        "        return hidden_states\n",
        '        with torch.compiler.set_stance("force_eager"):\n'
        "            heads, batch = self._prepare_qkv_for_gated_delta_rule(hidden_states, 1)\n"
        "        return hidden_states\n")
    b = build(make_options(_recipe_with(fake_repos, tmp_path, DYNAMO_STEP), carry=_carry(tmp_path, user)))
    assert b.manifest["origins"]["fix-no-dynamo"]["status"] == "already-present"
    patch = b.patch.decode()
    assert '+        with torch.compiler.set_stance("force_eager"):' in patch
    assert "torch.compiler.disable" not in patch  # the user's form is kept, nothing added


def test_undecidable_dynamo_form_fails_and_says_so(tmp_path, fake_repos, make_options):
    user = gdn_text().replace(
        "        return hidden_states\n",
        "        with my_no_compile():\n"
        "            heads, batch = self._prepare_qkv_for_gated_delta_rule(hidden_states, 1)\n"
        "        return hidden_states\n")
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe_with(fake_repos, tmp_path, DYNAMO_STEP), carry=_carry(tmp_path, user)))
    assert "cannot decide" in exc.value.message and "my_no_compile()" in exc.value.message


# --- equivalent forms of the preserved fixes, by AST effect ------------------------------------------

GDN = gdn_text()
CALL = "            heads, batch = self._prepare_qkv_for_gated_delta_rule(hidden_states, 1)\n"


def _forward_with(lines: str) -> str:
    return GDN.replace("        return hidden_states\n", lines + "        return hidden_states\n")


@pytest.mark.parametrize("text, state", [
    (GDN, "absent"),
    (GDN.replace("    @jit_fuser\n", "    @torch.compiler.disable\n"), "present"),
    (GDN.replace("    @jit_fuser\n", "    @torch._dynamo.disable(recursive=False)\n"), "present"),
    (GDN.replace("import torch\n", "import torch\nfrom torch.compiler import disable as no_dynamo\n")
        .replace("    @jit_fuser\n", "    @no_dynamo\n"), "present"),
    (_forward_with('        with torch.compiler.set_stance("force_eager"):\n' + CALL), "present"),
    (_forward_with("        with torch._dynamo.config.patch(disable=True):\n" + CALL), "present"),
    (_forward_with("        heads, batch = torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)(hidden_states, 1)\n"),
     "present"),
    (GDN.replace("        self.built = True\n", "        self.built = True\n        self._prepare_qkv_for_gated_delta_rule = "
                 "torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)\n"), "present"),
    (_forward_with(CALL.replace("    heads", "heads")), "absent"),
    (_forward_with('        with torch.compiler.set_stance("default"):\n' + CALL), "undecidable"),
    (_forward_with("        with my_no_compile():\n" + CALL), "undecidable"),
    (GDN.replace("    @jit_fuser\n", "    @my_no_compile\n"), "undecidable"),
])
def test_dynamo_fix_forms(text, state):
    assert dynamo_state(text)[0] == state
    result_or_error = None
    try:
        result_or_error = REGISTRY["fix_prepare_qkv_no_dynamo"](text, "g.py")
    except ApplyError as exc:
        result_or_error = exc
    if state == "present":
        assert result_or_error.status == "already-present" and result_or_error.text == text
    elif state == "absent":
        assert "@torch.compiler.disable" in result_or_error.text and result_or_error.status == "applied"
    else:
        assert isinstance(result_or_error, ApplyError) and "cannot decide" in result_or_error.message


@pytest.mark.parametrize("old, new, state", [
    ("return param[slices]", "return param[slices]", "absent"),
    ("return param[slices]", "return param[tuple(slices)]", "present"),
    ("return param[slices]", "return param[(*slices,)]", "present"),
    ("return param[slices]", "slices = tuple(slices)\n    return param[slices]", "present"),
    ("return param[slices]", "index = make_index(slices)\n    return param[index]", "undecidable"),
    ("return param[slices]", "return param.narrow(dim, cp_rank, 1)", "undecidable"),
    ("return param[slices]", "return param[tuple(slices)]  # tuple(slices)", "present"),
    ("return param[slices]", "return param[slices]  # tuple(slices) some day", "absent"),
])
def test_tuple_index_fix_forms(old, new, state):
    text = GDN.replace(old, new)
    assert tuple_index_state(text)[0] == state
    if state == "present":
        assert REGISTRY["fix_local_cp_tuple_index"](text, "g.py") == Result(text, "already-present")
    elif state == "absent":
        out = REGISTRY["fix_local_cp_tuple_index"](text, "g.py")
        assert out.status == "applied" and "param[tuple(slices)]" in out.text
    else:
        with pytest.raises(ApplyError) as exc:
            REGISTRY["fix_local_cp_tuple_index"](text, "g.py")
        assert "cannot decide" in exc.value.message or "not found" in exc.value.message


# --- a preserved fix in the user's form inside a function a step rewrites (issue 23, part 2) -------

GDN_BASE = '''"""Layer (test data)."""

import torch


class GatedDeltaNet:
    def forward(self, x):
        x = self.norm(x)

        # Prepare QKV tensors
        query, key = self._prepare_qkv_for_gated_delta_rule(
            x, 1
        )
        return self.core(query, key)

    @jit_fuser
    def _prepare_qkv_for_gated_delta_rule(self, x, batch):
        return x, batch
'''

GDN_NEW_FORWARD = '''    def forward(self, x, mode="headwise"):
        plan = self.plan(mode)
        x = self.norm(x)

        # Split, reshape, L2 norm (prepare QKV)
        query, key = self._prepare_qkv_for_gated_delta_rule(
            x, 1, plan.size
        )
        return self.route(plan, query, key)
'''
CALL_BASE = ("        query, key = self._prepare_qkv_for_gated_delta_rule(\n"
             "            x, 1\n"
             "        )\n")
CALL_NEW = ("        query, key = self._prepare_qkv_for_gated_delta_rule(\n"
            "            x, 1, plan.size\n"
            "        )\n")


class _ForwardStep:
    id = "adapt-gdn-forward"
    kind = "adaptation"
    transform = "gdn_linear_cp_forward"


def rewrite_gdn_forward(text: str, new_forward: str = GDN_NEW_FORWARD) -> str:
    """A stand-in for gdn_linear_cp_forward: replaces GatedDeltaNet.forward wholesale."""
    start = text.index("    def forward(")
    end = text.index("\n    @jit_fuser")
    return text[:start] + new_forward + text[end:]


def _wrapped(call: str, header: str) -> str:
    return header + "".join("    " + ln if ln.strip() else ln for ln in call.splitlines(keepends=True))


def _gdn_carried(tmp_path, new_text: str):
    patch = git_diff(tmp_path / "carry-src", {"m/gdn.py": GDN_BASE}, {"m/gdn.py": new_text})
    (tmp_path / "c.patch").write_text(patch)
    base = tmp_path / "base"
    (base / "m").mkdir(parents=True)
    (base / "m" / "gdn.py").write_text(GDN_BASE)
    carry, ws = carry_workspace(tmp_path / "c.patch", base)
    return carry.hunks, ws.files["m/gdn.py"].text


DYNAMO_FORMS = [("fix-prepare-qkv-no-dynamo", dynamo_state)]
CONFIG_PATCH = "        with torch._dynamo.config.patch(disable=True):\n"


@pytest.mark.parametrize("header", [
    CONFIG_PATCH,
    "        with torch._dynamo.config.patch(\"disable\", True):  # downstream: keep Dynamo off\n",
    '        with torch.compiler.set_stance("force_eager"):\n',
])
def test_call_site_dynamo_guard_is_carried_onto_the_rewritten_call(tmp_path, header):
    hunks, carried = _gdn_carried(tmp_path, GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, header)))
    kept = []
    out = merge_carried_functions(GDN_BASE, carried, rewrite_gdn_forward(carried), hunks, _ForwardStep, "m/gdn.py",
                                  set(), fix_forms=DYNAMO_FORMS, kept_forms=kept)
    assert out == rewrite_gdn_forward(GDN_BASE).replace(CALL_NEW, _wrapped(CALL_NEW, header))
    assert kept == [{"hunks": ["carry:m/gdn.py#1"], "step": "adapt-gdn-forward", "fix": "fix-prepare-qkv-no-dynamo",
                     "symbol": "GatedDeltaNet.forward", "wrapper": [header.rstrip("\n")],
                     "around": ["self._prepare_qkv_for_gated_delta_rule"],
                     "restated": [ln.rstrip("\n") for ln in _wrapped(CALL_BASE, "").splitlines(keepends=True)],
                     "replaced": CALL_BASE.splitlines(), "kind": "with"}]
    # the fix step that runs next finds its effect already there and keeps @jit_fuser
    fixed = REGISTRY["fix_prepare_qkv_no_dynamo"](out, "m/gdn.py")
    assert fixed == Result(out, "already-present") and "    @jit_fuser\n    def _prepare" in out


@pytest.mark.parametrize("comment", [
    "        # downstream: norm in fp32\n",
    "        with torch.no_grad():  # a new block, not around base statements: merged by lines\n"
    "            self.calls += 1\n",
])
def test_the_rest_of_the_carried_function_merges_beside_the_kept_guard(tmp_path, comment):
    user = GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, CONFIG_PATCH)).replace(
        "        x = self.norm(x)\n", "        x = self.norm(x)\n" + comment)
    hunks, carried = _gdn_carried(tmp_path, user)
    out = merge_carried_functions(GDN_BASE, carried, rewrite_gdn_forward(carried), hunks, _ForwardStep, "m/gdn.py",
                                  set(), fix_forms=DYNAMO_FORMS, kept_forms=[])
    assert out == rewrite_gdn_forward(GDN_BASE).replace(CALL_NEW, _wrapped(CALL_NEW, CONFIG_PATCH)).replace(
        "        x = self.norm(x)\n", "        x = self.norm(x)\n" + comment)


@pytest.mark.parametrize("user, new_forward, why", [
    (GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, "        with my_profiler():\n")), GDN_NEW_FORWARD,
     "not a form of a preserved fix: never guessed"),
    (GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, CONFIG_PATCH)),
     GDN_NEW_FORWARD.replace(CALL_NEW, CALL_NEW + CALL_NEW), "the new body calls the helper twice"),
    (GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, CONFIG_PATCH)),
     GDN_NEW_FORWARD.replace(CALL_NEW, "        query, key = self._prepare_qkv_v2(x, 1)\n"),
     "the new body has no such call"),
    (GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, CONFIG_PATCH)).replace(
        "return self.core(query, key)", "return self.core_v2(query, key)"), GDN_NEW_FORWARD,
     "another carried change of the function conflicts"),
])
def test_call_site_guard_that_cannot_be_carried_is_still_a_conflict(tmp_path, user, new_forward, why):
    hunks, carried = _gdn_carried(tmp_path, user)
    with pytest.raises(ApplyError) as exc:
        merge_carried_functions(GDN_BASE, carried, rewrite_gdn_forward(carried, new_forward), hunks, _ForwardStep,
                                "m/gdn.py", set(), fix_forms=DYNAMO_FORMS, kept_forms=[])
    assert exc.value.exit_code == 6, why
    assert "carry:m/gdn.py#1" in exc.value.message and "recipe step adapt-gdn-forward" in exc.value.message


def test_without_the_fix_in_the_recipe_the_guard_is_a_conflict(tmp_path):
    hunks, carried = _gdn_carried(tmp_path, GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, CONFIG_PATCH)))
    with pytest.raises(ApplyError) as exc:
        merge_carried_functions(GDN_BASE, carried, rewrite_gdn_forward(carried), hunks, _ForwardStep, "m/gdn.py",
                                set())
    assert exc.value.exit_code == 6 and "first conflicting line" in exc.value.message


def test_any_preserved_fix_recogniser_lets_its_form_be_carried(tmp_path):
    """Not tied to fix 7a: a fix whose equivalent form is a `with` around a call of a rewritten
    function is carried the same way, judged by that fix's own recogniser."""
    def no_grad_update(text):
        import ast

        fn = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "forward")
        inside = [c for w in ast.walk(fn) if isinstance(w, ast.With) and "no_grad" in ast.unparse(w.items[0])
                  for c in ast.walk(w) if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.core"]
        return ("present", "with no_grad") if inside else ("absent", "")

    ret, ret_new = "        return self.core(query, key)\n", "        return self.route(plan, query, key)\n"
    base = GDN_BASE.replace(ret, "        out = self.core(query, key)\n        return out\n")
    new_forward = GDN_NEW_FORWARD.replace(ret_new, "        out = self.core(query, key, plan)\n        return out\n")
    user = base.replace("        out = self.core(query, key)\n",
                        "        with torch.no_grad():\n            out = self.core(query, key)\n")
    patch = git_diff(tmp_path / "carry-src", {"m/gdn.py": base}, {"m/gdn.py": user})
    (tmp_path / "c.patch").write_text(patch)
    (tmp_path / "base" / "m").mkdir(parents=True)
    (tmp_path / "base" / "m" / "gdn.py").write_text(base)
    carry, ws = carry_workspace(tmp_path / "c.patch", tmp_path / "base")
    carried = ws.files["m/gdn.py"].text
    kept = []
    out = merge_carried_functions(base, carried, rewrite_gdn_forward(carried, new_forward), carry.hunks, _ForwardStep,
                                  "m/gdn.py", set(), fix_forms=[("fix-no-grad", no_grad_update)], kept_forms=kept)
    assert "        with torch.no_grad():\n            out = self.core(query, key, plan)\n" in out
    assert [k["fix"] for k in kept] == ["fix-no-grad"]


@pytest.mark.parametrize("user, named", [
    (GDN_BASE.replace(CALL_BASE, _wrapped(CALL_BASE, CONFIG_PATCH)), "torch._dynamo.config.patch(disable=True)"),
    (GDN_BASE.replace("= self._prepare_qkv_for_gated_delta_rule(\n",
                      "= torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)(\n"),
     "torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)"),
])
def test_carry_survival_checks_the_kept_guard_not_the_restated_call(tmp_path, user, named):
    from types import SimpleNamespace

    from backport.verify import carry_survival

    patch = git_diff(tmp_path / "carry-src", {"m/gdn.py": GDN_BASE}, {"m/gdn.py": user})
    (tmp_path / "c.patch").write_text(patch)
    (tmp_path / "base" / "m").mkdir(parents=True)
    (tmp_path / "base" / "m" / "gdn.py").write_text(GDN_BASE)
    carry, ws = carry_workspace(tmp_path / "c.patch", tmp_path / "base")
    carried = ws.files["m/gdn.py"].text
    kept = []
    merged = merge_carried_functions(GDN_BASE, carried, rewrite_gdn_forward(carried), carry.hunks, _ForwardStep,
                                     "m/gdn.py", set(), fix_forms=DYNAMO_FORMS, kept_forms=kept)
    origins = {"carry:m/gdn.py#1": {"kind": "carried", "kept_forms": [
        {k: v for k, v in kept[0].items() if k != "hunks"}]}}
    run = SimpleNamespace(carry_model=carry, ws=ws, origins=origins, carried_text={"m/gdn.py": carried})
    ws.files["m/gdn.py"].replace_text(merged, "adapt-gdn-forward")
    assert carry_survival(run)["ok"]  # the call's carried arguments are the step's now
    ws.files["m/gdn.py"].replace_text(rewrite_gdn_forward(GDN_BASE), "a-later-step")
    with pytest.raises(VerificationError) as exc:
        carry_survival(run)
    assert "carry:m/gdn.py#1" in exc.value.message and named in exc.value.message


def test_call_site_disable_wrapper_is_carried_onto_the_rewritten_call(tmp_path):
    """The other call-site form, torch.compiler.disable(self._prepare...)(...), by the same rule."""
    wrap = "torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)("
    user = GDN_BASE.replace("= self._prepare_qkv_for_gated_delta_rule(\n", f"= {wrap}\n")
    hunks, carried = _gdn_carried(tmp_path, user)
    kept = []
    out = merge_carried_functions(GDN_BASE, carried, rewrite_gdn_forward(carried), hunks, _ForwardStep, "m/gdn.py",
                                  set(), fix_forms=DYNAMO_FORMS, kept_forms=kept)
    assert out == rewrite_gdn_forward(GDN_BASE).replace("= self._prepare_qkv_for_gated_delta_rule(\n", f"= {wrap}\n")
    assert [(k["kind"], k["fix"], k["wrapper"]) for k in kept] == [
        ("call", "fix-prepare-qkv-no-dynamo", ["torch.compiler.disable(self._prepare_qkv_for_gated_delta_rule)"])]
    assert REGISTRY["fix_prepare_qkv_no_dynamo"](out, "m/gdn.py").status == "already-present"
