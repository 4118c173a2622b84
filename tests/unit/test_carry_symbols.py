"""Carried symbols are neither replaced, bound again nor wrongly refused by recipe steps.

Defects found by a hostile tester: a transplant replaced a def the carry added (exit 0);
a transform added a second ``linear_cp_mode`` field after the carried one (exit 0, the
user's default lost); class-level carried lines were refused by later steps (the merge used
the pristine base as the ancestor). ``carry_survival`` checks every carried line in the
symbol where it lands, not the hunk header's anchor symbol.
"""

from __future__ import annotations

import types

import pytest

from backport.carry import carry_workspace
from backport.engine import build
from backport.errors import ApplyError, VerificationError
from backport.transforms import REGISTRY, Result
from backport.verify import carry_survival

from conftest import PACKED, RESOLVE, DATA, gdn_text, git_diff, recipe_data, write_recipe

pytestmark = pytest.mark.usefixtures("engine_env")

GDN = "megatron/core/ssm/gated_delta_net.py"
CFG = "megatron/core/transformer/transformer_config.py"
PSP = "megatron/core/packed_seq_params.py"
CONFIG_STEP = {"id": "adapt-config", "kind": "adaptation", "path": CFG, "transform": "gdn_config_linear_cp_mode",
               "why": "adds linear_cp_mode and the per-mode head rule"}
GDN_STEPS = [
    {"id": "adapt-init-check", "kind": "adaptation", "path": GDN, "transform": "gdn_init_check_linear_cp",
     "why": "check the CP mode in __init__"},
    {"id": "adapt-forward", "kind": "adaptation", "path": GDN, "transform": "gdn_linear_cp_forward",
     "why": "our three-mode forward replaces the base forward"},
    {"id": "adapt-prepare-qkv", "kind": "adaptation", "path": GDN, "transform": "gdn_prepare_qkv_headwise_cp_size",
     "why": "headwise CP size argument"},
]


def _recipe(fake_repos, tmp_path, *steps):
    data = recipe_data(fake_repos)
    data["steps"] += list(steps)
    return write_recipe(tmp_path / "r.yaml", data)


def _carry(tmp_path, changes: dict) -> "Path":
    before = {p: old for p, (old, _new) in changes.items()}
    after = {p: new for p, (_old, new) in changes.items()}
    path = tmp_path / "down.patch"
    path.write_text(git_diff(tmp_path / "carry-src", before, after))
    return path


DOWNSTREAM_RESOLVE = ('\n\ndef resolve_cp_group(static_cp_group, packed_seq_params=None):\n'
                      '    """CARRY7 downstream version."""\n    return static_cp_group  # CARRY7\n')


def test_transplant_replacing_a_carried_def_is_a_conflict(tmp_path, fake_repos, make_options):
    carry = _carry(tmp_path, {PSP: (PACKED, PACKED + DOWNSTREAM_RESOLVE)})
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path), carry=carry))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{PSP}#1" in msg and "in resolve_cp_group" in msg
    assert "recipe step prereq-resolve" in msg and "replaces resolve_cp_group" in msg
    assert "def resolve_cp_group(static_cp_group, packed_seq_params=None):" in msg


def test_transplant_of_a_carried_def_identical_to_upstream_merges(tmp_path, fake_repos, make_options):
    b = build(make_options(_recipe(fake_repos, tmp_path), carry=_carry(tmp_path, {PSP: (PACKED, PACKED + RESOLVE)})))
    patch = b.patch.decode()
    assert patch.count("+def resolve_cp_group(params, default):") == 1
    assert next(c for c in b.manifest["verification"] if c["check"] == "carry_survival")["ok"]


def test_carried_field_bound_again_by_the_config_transform_is_a_conflict(tmp_path, fake_repos, make_options):
    cfg = (DATA / "transformer_config.py").read_text()
    user = cfg.replace("    hidden_size: int = 8\n", '    linear_cp_mode: str = "chunkwise"  # CARRY22\n    hidden_size: int = 8\n')
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path, CONFIG_STEP), carry=_carry(tmp_path, {CFG: (cfg, user)})))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{CFG}#1" in msg and "recipe step adapt-config" in msg
    assert "adds linear_cp_mode to TransformerConfig" in msg and "CARRY22" in msg


def test_carried_field_of_the_recipes_exact_form_is_kept_once(tmp_path, fake_repos, make_options):
    cfg = (DATA / "transformer_config.py").read_text()
    user = cfg.replace("    hidden_size: int = 8\n", '    linear_cp_mode: str = "headwise"\n    hidden_size: int = 8\n')
    b = build(make_options(_recipe(fake_repos, tmp_path, CONFIG_STEP), carry=_carry(tmp_path, {CFG: (cfg, user)})))
    assert b.patch.decode().count('linear_cp_mode: str = "headwise"') == 1


def test_any_step_binding_a_carried_name_again_is_a_conflict(tmp_path, fake_repos, make_options, monkeypatch):
    monkeypatch.setitem(REGISTRY, "rebind_flag", lambda text, path: Result(text + "\nCARRIED_FLAG = False\n"))
    step = {"id": "adapt-rebind", "kind": "adaptation", "path": GDN, "transform": "rebind_flag",
            "why": "a step that binds a carried name again"}
    carry = _carry(tmp_path, {GDN: (gdn_text(), gdn_text().replace("import torch\n", "import torch\n\nCARRIED_FLAG = True\n"))})
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path, step), carry=carry))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and "binds CARRIED_FLAG again in module level" in msg
    assert "recipe step adapt-rebind" in msg and f"carry:{GDN}#1" in msg


@pytest.mark.parametrize("old, new, added, steps", [
    ('    """Toy layer."""\n\n', '    """Toy layer."""\n\n    carry_flag = True  # CARRY21\n\n',
     "+    carry_flag = True  # CARRY21\n", GDN_STEPS),
    # the toy forward's one-line signature is rewritten, so only the other steps run here
    ("    def forward(", "    @torch._dynamo.disable\n    def forward(", "+    @torch._dynamo.disable\n",
     [GDN_STEPS[0], GDN_STEPS[2]]),
])
def test_class_level_carried_lines_merge_through_later_steps(tmp_path, fake_repos, make_options, old, new, added,
                                                             steps):
    user = gdn_text().replace(old, new, 1)
    b = build(make_options(_recipe(fake_repos, tmp_path, *steps), carry=_carry(tmp_path, {GDN: (gdn_text(), user)})))
    assert added in b.patch.decode()
    assert next(c for c in b.manifest["verification"] if c["check"] == "carry_survival")["ok"]


def test_survival_checks_the_symbol_where_the_carried_lines_land(tmp_path):
    base_text = "class A:\n    def f(self):\n        return 1\n"
    carried = base_text + "\n\ndef g():\n    return 2  # CARRIED\n"
    (tmp_path / "base" / "m").mkdir(parents=True)
    (tmp_path / "base" / "m" / "a.py").write_text(base_text)
    (tmp_path / "c.patch").write_text(git_diff(tmp_path / "src", {"m/a.py": base_text}, {"m/a.py": carried}))
    carry, ws = carry_workspace(tmp_path / "c.patch", tmp_path / "base")
    h = carry.hunks[0]
    assert h.symbol == "A.f"  # the header's anchor, not where the def lands
    assert {sym for sign, line, sym in h.line_symbols if line.strip()} == {"g"}
    ws.files["m/a.py"].replace_text(base_text + "\n\ndef g():\n    return 3\n", "step")
    run = types.SimpleNamespace(carry_model=carry, ws=ws, carried_text={"m/a.py": carried}, origins={})
    with pytest.raises(VerificationError) as exc:
        carry_survival(run)
    assert "in g: added line 'return 2  # CARRIED' is missing" in exc.value.message


# --- every insertion transform detects what it would add twice ---------------------------------------

IMPORT_ANCHOR = "from megatron.core.process_groups_config import ProcessGroupCollection\n"


def test_gdn_imports_already_there_exactly_are_already_present():
    from backport.transforms.gdn import gdn_imports

    once = gdn_imports(gdn_text()).text
    again = gdn_imports(once)
    assert again.status == "already-present" and again.text == once


def test_gdn_imports_of_a_name_bound_otherwise_is_refused():
    from backport.errors import BindingExists
    from backport.transforms.gdn import gdn_imports

    user = gdn_text().replace(IMPORT_ANCHOR, IMPORT_ANCHOR + "from my.layout import zigzag_to_contiguous_chunks\n")
    with pytest.raises(BindingExists) as exc:
        gdn_imports(user)
    assert exc.value.exit_code == 6 and exc.value.name == "zigzag_to_contiguous_chunks" and exc.value.scope == ""


def test_gdn_imports_add_only_the_missing_names():
    from backport.transforms.gdn import gdn_imports

    user = gdn_text().replace(IMPORT_ANCHOR, IMPORT_ANCHOR + "from megatron.core.ssm import gdn_context_parallel\n")
    out = gdn_imports(user).text
    assert out.count("gdn_context_parallel\n") == 1 and "zigzag_to_contiguous_chunks" in out


INIT_ANCHOR = "        self.v_dim_local_tp = 4 // tp_size\n"


def test_init_check_already_there_exactly_is_already_present():
    from backport.transforms.gdn import gdn_init_check_linear_cp

    once = gdn_init_check_linear_cp(gdn_text()).text
    assert gdn_init_check_linear_cp(once).status == "already-present"


def test_init_check_in_another_form_through_the_engine_names_the_carried_hunk(tmp_path, fake_repos, make_options):
    user = gdn_text().replace(INIT_ANCHOR, INIT_ANCHOR + "        gdn_context_parallel.check_linear_cp_geometry("
                                                         "'chunkwise', 1, 1, 1, 1)  # CARRY\n")
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path, GDN_STEPS[0]), carry=_carry(tmp_path, {GDN: (gdn_text(), user)})))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{GDN}#1" in msg and "recipe step adapt-init-check" in msg
    assert "adds check_linear_cp_geometry to GatedDeltaNet.__init__ again" in msg and "# CARRY" in msg
    # the hint is the step's own advice for a binding (not the function-rewrite one), plus `superseded`
    hint = exc.value.hint
    assert "Drop the check from the carried patch" in hint and "same lines of this function" not in hint
    assert f"superseded: [{{hunk: carry:{GDN}#1, step: adapt-init-check" in hint


def test_prepare_qkv_parameter_in_another_form_is_refused(tmp_path, fake_repos, make_options):
    user = gdn_text().replace("def _prepare_qkv_for_gated_delta_rule(self, qkv, batch):",
                              "def _prepare_qkv_for_gated_delta_rule(self, qkv, batch, cp_size_headwise=2):")
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path, GDN_STEPS[2]), carry=_carry(tmp_path, {GDN: (gdn_text(), user)})))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{GDN}#1" in msg and "recipe step adapt-prepare-qkv" in msg
    assert "cp_size_headwise" in msg


def test_prepare_qkv_parameter_in_the_recipes_form_still_gets_its_body_rewrite():
    from backport.transforms.gdn import gdn_prepare_qkv_headwise_cp_size

    user = gdn_text().replace("def _prepare_qkv_for_gated_delta_rule(self, qkv, batch):",
                              "def _prepare_qkv_for_gated_delta_rule(self, qkv, batch, cp_size_headwise=1):")
    out = gdn_prepare_qkv_headwise_cp_size(user)
    assert out.status == "applied" and "heads = qkv // cp_size_headwise" in out.text
    assert gdn_prepare_qkv_headwise_cp_size(out.text).status == "already-present"


def test_upstream_file_over_a_carried_file_is_a_conflict(tmp_path, fake_repos, make_options):
    layout = "megatron/core/context_parallel_layout.py"
    carry = tmp_path / "down.patch"
    carry.write_text(git_diff(tmp_path / "carry-src", {"README.md": "fake Megatron-LM\n"},
                              {"README.md": "fake Megatron-LM\n",
                               layout: "def zigzag_to_contiguous_chunks(x):\n    return x  # CARRY\n"}))
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path), carry=carry))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{layout}#1" in msg and "recipe step take-layout (upstream_file)" in msg
    assert "return x  # CARRY" in msg


def test_a_second_binding_of_the_identical_form_is_accepted(tmp_path, fake_repos, make_options, monkeypatch):
    monkeypatch.setitem(REGISTRY, "import_os", lambda text, path: Result(text + "\nimport os\n"))
    step = {"id": "adapt-import-os", "kind": "adaptation", "path": GDN, "transform": "import_os",
            "why": "a step that imports what the carry imports"}
    carry = _carry(tmp_path, {GDN: (gdn_text(), gdn_text().replace("import torch\n", "import os\n\nimport torch\n"))})
    b = build(make_options(_recipe(fake_repos, tmp_path, step), carry=carry))
    assert b.patch.decode().count("+import os\n") == 2
    assert next(c for c in b.manifest["verification"] if c["check"] == "carry_survival")["ok"]


def test_a_step_bringing_back_a_symbol_the_carry_removes_is_a_conflict(tmp_path, fake_repos, make_options,
                                                                        monkeypatch):
    cls = "class PackedSeqParams:\n    cp_group = None\n"
    monkeypatch.setitem(REGISTRY, "restore_cls", lambda text, path: Result(text + "\n\n" + cls))
    step = {"id": "adapt-restore", "kind": "adaptation", "path": PSP, "transform": "restore_cls",
            "why": "a step that brings back a class the carry removes"}
    carry = _carry(tmp_path, {PSP: (PACKED, PACKED.replace(cls, "CP_GROUP = None\n"))})
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path, step), carry=carry))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{PSP}#1" in msg and "brings back PackedSeqParams" in msg
    assert "recipe step adapt-restore" in msg


def test_add_file_over_a_carried_new_file_names_the_carried_hunk(tmp_path, fake_repos, make_options):
    path = "megatron/core/ssm/gdn_context_parallel.py"
    carry = tmp_path / "down.patch"
    carry.write_text(git_diff(tmp_path / "carry-src", {"README.md": "x\n"},
                              {"README.md": "x\n", path: "LINEAR_CP_MODES = ('headwise',)  # CARRY\n"}))
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path), carry=carry))
    assert exc.value.exit_code == 6 and f"(carry:{path}#1)" in exc.value.message
    assert "step add-gdn-cp" in exc.value.message and "Drop the file" in exc.value.hint


def test_carried_field_where_the_transform_inserts_its_own_merges(tmp_path, fake_repos, make_options):
    cfg = (DATA / "transformer_config.py").read_text()
    doc = '    """How attention exchanges keys and values across CP ranks."""\n'
    user = cfg.replace(doc, doc + "\n    carry_field: int = 3  # CARRY30\n")
    b = build(make_options(_recipe(fake_repos, tmp_path, CONFIG_STEP), carry=_carry(tmp_path, {CFG: (cfg, user)})))
    patch = b.patch.decode()
    assert "+    carry_field: int = 3  # CARRY30\n" in patch and 'linear_cp_mode: str = "headwise"' in patch
    assert next(c for c in b.manifest["verification"] if c["check"] == "carry_survival")["ok"]


def test_alignment_artefact_is_told_from_a_real_conflict():
    from backport.transforms.merge import _kept_by_new

    kept = {"new": ["R\n", "\n", "C\n"], "base": [], "carried": ["\n", "C\n"]}
    real = {"new": ["x = 3\n"], "base": ["x = 1\n"], "carried": ["x = 2\n"]}
    undone = {"new": ["R\n", "gone\n", "C\n"], "base": ["gone\n"], "carried": ["C\n"]}
    assert _kept_by_new(kept) and not _kept_by_new(real) and not _kept_by_new(undone)


def test_carried_line_where_a_step_inserts_is_kept_once(tmp_path, fake_repos, make_options):
    user = gdn_text().replace(INIT_ANCHOR, INIT_ANCHOR + "        self.carry_attr = 5  # CARRY40\n")
    b = build(make_options(_recipe(fake_repos, tmp_path, GDN_STEPS[0]), carry=_carry(tmp_path, {GDN: (gdn_text(), user)})))
    patch = b.patch.decode()
    assert patch.count("self.carry_attr = 5  # CARRY40") == 1 and "check_linear_cp_geometry" in patch


def test_merge_does_not_repeat_a_carried_line_the_step_kept(tmp_path):
    from backport.transforms.merge import merge_carried_functions

    base = "class L:\n    def __init__(self):\n        self.a = 1\n\n        # proj\n        self.p = 2\n"
    carried = base.replace("        self.a = 1\n", "        self.a = 1\n        self.carry_attr = 5  # CARRY40\n")
    (tmp_path / "base" / "m").mkdir(parents=True)
    (tmp_path / "base" / "m" / "l.py").write_text(base)
    (tmp_path / "c.patch").write_text(git_diff(tmp_path / "src", {"m/l.py": base}, {"m/l.py": carried}))
    carry, _ws = carry_workspace(tmp_path / "c.patch", tmp_path / "base")
    after = carried.replace("        self.a = 1\n", "        self.a = 1\n\n        check(\n            self.a,\n        )\n")
    step = types.SimpleNamespace(id="adapt-check", kind="adaptation", transform="add_check")
    out = merge_carried_functions(base, carried, after, carry.hunks, step, "m/l.py", set())
    assert out == after and out.count("# CARRY40") == 1


FUSED_STEPS = [
    GDN_STEPS[2],
    {"id": "fix-no-dynamo", "kind": "fix", "path": GDN, "transform": "fix_prepare_qkv_no_dynamo",
     "why": "preserved downstream fix: no Dynamo"},
    {"id": "adapt-fused-copies", "kind": "adaptation", "path": GDN, "transform": "gdn_prepare_qkv_fused_copies",
     "why": "two jit_fuser functions around an eager l2norm"},
]


def test_fused_copies_over_a_carried_helper_import_inside_try_names_the_carried_hunk(tmp_path, fake_repos,
                                                                                     make_options):
    # hostile19: a carried `try: from ... import _split_query_key_value` was shadowed by the def
    # the step adds after the class (exit 0); now exit 6 naming the carried hunk and its line
    block = ("from torch import Tensor\n\ntry:\n    from fused_ops import _split_query_key_value  # CARRY19\n"
             "except ImportError:\n    _split_query_key_value = None\n")
    user = gdn_text().replace("import torch\n", "import torch\n" + block, 1)
    carry = _carry(tmp_path, {GDN: (gdn_text(), user)})
    with pytest.raises(ApplyError) as exc:
        build(make_options(_recipe(fake_repos, tmp_path, *FUSED_STEPS), carry=carry))
    msg = exc.value.message
    assert exc.value.exit_code == 6 and f"carry:{GDN}#1" in msg and "recipe step adapt-fused-copies" in msg
    assert "_split_query_key_value" in msg and "# CARRY19" in msg
