"""backport.transforms: each GDN transform on small stand-in sources (tests/unit/data/)."""

from __future__ import annotations

import ast

import libcst as cst
import pytest

from backport.errors import ApplyError
from backport.transforms import REGISTRY, register
from backport.transforms.gdn import ADAPTATIONS
from backport.transforms.transplant import transplant

from conftest import DATA

CONFIG = (DATA / "transformer_config.py").read_text()
GDN = (DATA / "gated_delta_net.py").read_text()

FIXES = ["fix_prepare_qkv_no_dynamo", "fix_local_cp_tuple_index"]


def test_registry_lists_the_gdn_transforms():
    assert sorted(REGISTRY) == sorted([
        "gdn_config_linear_cp_mode", "gdn_imports", "gdn_init_check_linear_cp", "gdn_init_check_fla_version",
        "gdn_linear_cp_forward",
        "gdn_prepare_qkv_headwise_cp_size", "gdn_prepare_qkv_fused_copies", "gdn_local_cp_none_group",
        "packed_seq_params_metadata_fields", "te_attention_skip_packed_metadata",
        "context_parallel_layout_finalize_export", "gdn_init_register_linear_cp_mode",
        "bridge_packed_seq_utils_finalize", "mcore_data_schedule_finalize", "qwen3_vl_finalize_packed",
        "qwen3_vl_step_finalize_packed", *FIXES])


def test_every_preserved_fix_of_the_recipe_has_a_recogniser_of_its_forms():
    """The three-way merge carries a fix's equivalent form into a rewritten function only
    through the fix's recogniser (FIX_FORMS): each fix step of the shipped recipe has one."""
    from backport.recipe import load_recipe
    from backport.transforms.fixes import FIX_FORMS

    recipe, _ = load_recipe(DATA.parents[2] / "manifests" / "gdn-chunkwise-cp.yaml")
    fixes = sorted(s.transform for s in recipe.steps if s.kind == "fix")
    assert fixes == sorted(FIXES) and sorted(FIX_FORMS) == sorted(FIXES)
    assert all(FIX_FORMS[f](GDN)[0] == "absent" for f in FIXES)


def test_registering_a_name_twice_is_refused():
    with pytest.raises(RuntimeError, match="registered twice"):
        register("gdn_imports")(lambda text, path="": None)


@pytest.mark.parametrize("name, old, new", [
    ("fix_local_cp_tuple_index", "return param[slices]", "return param[tuple(slices)]"),
    ("fix_prepare_qkv_no_dynamo", "    @jit_fuser\n    def _prepare", "    @torch.compiler.disable\n    def _prepare"),
    ("gdn_local_cp_none_group", "cp_size = cp_group.size()\n    cp_rank = cp_group.rank()",
     "cp_size = cp_group.size() if cp_group is not None else 1\n    cp_rank = cp_group.rank() if cp_group is not None else 0"),
    ("gdn_prepare_qkv_headwise_cp_size",
     "def _prepare_qkv_for_gated_delta_rule(self, qkv, batch):\n        heads = qkv // self.cp_size",
     "def _prepare_qkv_for_gated_delta_rule(self, qkv, batch, cp_size_headwise=1):\n        heads = qkv // cp_size_headwise"),
])
def test_small_transforms_change_exactly_their_anchor(name, old, new):
    assert GDN.count(old) == 1
    result = REGISTRY[name](GDN, "gated_delta_net.py")
    assert result.status == "applied"
    assert result.text == GDN.replace(old, new)


def test_config_transform_adds_the_field_after_cp_comm_type_and_replaces_the_head_assert():
    result = REGISTRY["gdn_config_linear_cp_mode"](CONFIG, "transformer_config.py")
    tree = ast.parse(result.text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransformerConfig")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert fields == ["hidden_size", "cp_comm_type", "linear_cp_mode", "num_layers"]
    field = next(n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id == "linear_cp_mode")
    assert ast.literal_eval(field.value) == "headwise"
    # the docstring of cp_comm_type stays attached to it (the field goes after it)
    assert result.text.index('"""How attention exchanges') < result.text.index("linear_cp_mode: str")
    post_init = ast.get_source_segment(result.text, next(n for n in cls.body if isinstance(n, ast.FunctionDef)))
    assert "tp_cp_size" not in post_init
    assert "check_linear_cp_geometry(\n            self.linear_cp_mode," in post_init
    assert post_init.index('raise ValueError("hidden_size') < post_init.index("check_linear_cp_geometry(")
    assert post_init.rstrip().endswith("self.done = True")


def test_imports_go_in_isort_order_among_the_megatron_imports():
    """Each import lands where isort (profile black, upstream's setting) puts it; the section's
    blank line stays before the first megatron import; nothing else moves."""
    text = REGISTRY["gdn_imports"](GDN, "gated_delta_net.py").text
    tree = ast.parse(text)
    modules = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert modules == ["megatron.core.context_parallel_layout", "megatron.core.jit",
                       "megatron.core.process_groups_config", "megatron.core.ssm"]
    assert "import torch\n\nfrom megatron.core.context_parallel_layout import (" in text
    added = text[text.index("from megatron.core.context_parallel_layout"):text.index("from megatron.core.jit")]
    rest = text.replace(added, "").replace("from megatron.core.ssm import gdn_context_parallel\n", "")
    assert rest == GDN


def test_init_check_follows_v_dim_local_tp():
    text = REGISTRY["gdn_init_check_linear_cp"](GDN, "gated_delta_net.py").text
    init = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    src = [ast.unparse(s) for s in init.body]
    i = src.index("self.v_dim_local_tp = 4 // tp_size")
    assert src[i + 1].startswith("gdn_context_parallel.check_linear_cp_geometry(self.config.linear_cp_mode")
    assert src[i + 2] == "self.built = True"


def test_forward_is_replaced_by_the_template_and_nothing_else_changes():
    text = REGISTRY["gdn_linear_cp_forward"](GDN, "gated_delta_net.py").text
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]
    assert methods == ["__init__", "forward", "_prepare_qkv_for_gated_delta_rule"]
    forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    template = ast.parse((ADAPTATIONS / "gated_delta_net_forward.py").read_text())
    expected = next(n for n in template.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    # same code; the docstring is re-indented with the method, so compare it cleaned
    assert ast.get_docstring(forward) == ast.get_docstring(expected)
    assert ast.dump(forward.args) == ast.dump(expected.args)
    assert [ast.dump(s) for s in forward.body[1:]] == [ast.dump(s) for s in expected.body[1:]]
    old_fwd = "    def forward(self, hidden_states, attention_mask):\n        return hidden_states\n"
    start = text.index("    def forward(")
    end = text.index("    @jit_fuser")
    assert text[:start] + old_fwd + "\n" + text[end:] == GDN


def _drop(text, old, new=""):
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize("name, source, anchor", [
    ("gdn_config_linear_cp_mode", _drop(CONFIG, "class TransformerConfig", "class OtherConfig"), "'TransformerConfig'"),
    ("gdn_config_linear_cp_mode", _drop(CONFIG, '    cp_comm_type: str = "p2p"\n'), "TransformerConfig.cp_comm_type"),
    ("gdn_config_linear_cp_mode", _drop(CONFIG, "def __post_init__", "def validate"), "'__post_init__'"),
    ("gdn_config_linear_cp_mode", _drop(CONFIG, "tp_cp_size =", "tp_size ="), "tp_cp_size = ..."),
    ("gdn_imports", _drop(GDN, "from megatron.core.process_groups_config import ProcessGroupCollection\n"),
     "megatron.core.process_groups_config"),
    ("gdn_init_check_linear_cp", _drop(GDN, "class GatedDeltaNet", "class Other"), "'GatedDeltaNet'"),
    ("gdn_init_check_linear_cp", _drop(GDN, "def __init__", "def setup"), "'__init__'"),
    ("gdn_init_check_linear_cp", _drop(GDN, "self.v_dim_local_tp =", "self.v_dim ="), "self.v_dim_local_tp"),
    ("gdn_linear_cp_forward", _drop(GDN, "def forward", "def run"), "'forward'"),
    ("gdn_prepare_qkv_headwise_cp_size", _drop(GDN, "def _prepare_qkv_for_gated_delta_rule", "def _prep"),
     "'_prepare_qkv_for_gated_delta_rule'"),
    ("gdn_local_cp_none_group", _drop(GDN, "def get_parameter_local_cp", "def get_local"), "'get_parameter_local_cp'"),
    ("gdn_local_cp_none_group", _drop(_drop(GDN, "cp_group.size()", "4"), "cp_group.rank()", "0"),
     "cp_size = cp_group.size()"),
    ("fix_prepare_qkv_no_dynamo", _drop(GDN, "def _prepare_qkv_for_gated_delta_rule", "def _prep"),
     "'_prepare_qkv_for_gated_delta_rule'"),
    ("fix_local_cp_tuple_index", _drop(GDN, "def get_parameter_local_cp", "def get_local"), "'get_parameter_local_cp'"),
    ("fix_local_cp_tuple_index", _drop(GDN, "return param[slices]", "return param"), "param[slices]"),
])
def test_missing_anchor_is_apply_error_naming_it(name, source, anchor):
    with pytest.raises(ApplyError) as exc:
        REGISTRY[name](source, "pkg/mod.py")
    assert exc.value.exit_code == 6
    assert anchor in exc.value.message
    assert "pkg/mod.py" in exc.value.message


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_invalid_python_is_apply_error(name):
    with pytest.raises(ApplyError, match="not valid Python") as exc:
        REGISTRY[name]("def broken(:\n", "pkg/mod.py")
    assert "pkg/mod.py" in exc.value.message


@pytest.mark.parametrize("name", FIXES + ["gdn_local_cp_none_group", "gdn_prepare_qkv_headwise_cp_size"])
def test_idempotent_transforms_report_already_present(name):
    once = REGISTRY[name](GDN, "gated_delta_net.py")
    twice = REGISTRY[name](once.text, "gated_delta_net.py")
    assert (once.status, twice.status) == ("applied", "already-present")
    assert twice.text == once.text


@pytest.mark.parametrize("name, carried_old, carried_new, marker", [
    ("fix_local_cp_tuple_index", "param[slices]", "param[tuple(slices)]", "tuple(slices)"),
    ("fix_prepare_qkv_no_dynamo", "@jit_fuser\n", "@torch.compiler.disable\n", "disable"),
    # a carried variant spelled differently from ours is still recognised
    ("fix_prepare_qkv_no_dynamo", "@jit_fuser\n", "@torch._dynamo.disable\n", "disable"),
])
def test_a_fix_already_carried_is_not_duplicated(name, carried_old, carried_new, marker):
    carried = GDN.replace(carried_old, carried_new)
    result = REGISTRY[name](carried, "gated_delta_net.py")
    assert result.status == "already-present"
    assert result.text == carried
    assert result.text.count(marker) == 1


# the names the real module binds that gdn_prepare_qkv_fused_copies' code reads (besides torch, jit_fuser)
GDN_FLA_IMPORTS = (
    "from torch import Tensor\n\n"
    "try:\n    from fla.modules.l2norm import l2norm\nexcept ImportError:\n    l2norm = None\n"
)


def _with_cp_size(text=None):
    """The stand-in (with the real module's Tensor and l2norm imports) after the steps that run
    before gdn_prepare_qkv_fused_copies."""
    if text is None:
        text = GDN.replace("import torch\n", "import torch\n" + GDN_FLA_IMPORTS, 1)
    text = REGISTRY["gdn_prepare_qkv_headwise_cp_size"](text, "gated_delta_net.py").text
    return REGISTRY["fix_prepare_qkv_no_dynamo"](text, "gated_delta_net.py").text


def test_fused_copies_replace_the_body_only_and_add_two_jit_fuser_functions_after_the_class():
    before = _with_cp_size()
    result = REGISTRY["gdn_prepare_qkv_fused_copies"](before, "gated_delta_net.py")
    assert result.status == "applied"
    tree = ast.parse(result.text)
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert names == ["GatedDeltaNet", "_split_query_key_value", "_expand_query_key_heads", "get_parameter_local_cp"]
    for fn in [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(("_split", "_expand"))]:
        assert [ast.unparse(d) for d in fn.decorator_list] == ["jit_fuser"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_prepare_qkv_for_gated_delta_rule")
    # fix 7a stays: the method itself is still kept away from Dynamo, signature unchanged
    assert [ast.unparse(d) for d in method.decorator_list] == ["torch.compiler.disable"]
    assert [a.arg for a in method.args.args] == ["self", "qkv", "batch", "cp_size_headwise"]
    calls = [ast.unparse(c.func) for c in sorted((c for c in ast.walk(method) if isinstance(c, ast.Call)),
                                                 key=lambda c: (c.lineno, c.col_offset))]
    assert calls == ["_split_query_key_value", "l2norm", "_expand_query_key_heads"]
    # nothing else in the file changed
    start, end = result.text.index("        \"\"\"\n        Prepare"), result.text.index("\n\n\n@jit_fuser")
    old_start = before.index("        heads = qkv")
    assert result.text[:start] == before[:old_start]
    assert result.text.endswith(before[before.index("\n\n\ndef get_parameter_local_cp"):])


def test_fused_copies_twice_is_already_present():
    once = REGISTRY["gdn_prepare_qkv_fused_copies"](_with_cp_size(), "gated_delta_net.py")
    twice = REGISTRY["gdn_prepare_qkv_fused_copies"](once.text, "gated_delta_net.py")
    assert (once.status, twice.status) == ("applied", "already-present")
    assert twice.text == once.text


def test_fused_copies_need_the_cp_size_step_first():
    with pytest.raises(ApplyError, match="gdn_prepare_qkv_headwise_cp_size step must run before") as exc:
        REGISTRY["gdn_prepare_qkv_fused_copies"](GDN, "pkg/mod.py")
    assert exc.value.exit_code == 6 and "pkg/mod.py" in exc.value.message


def test_fused_copies_refuse_a_carried_function_of_the_same_name_in_another_form():
    carried = _with_cp_size() + "\n\ndef _expand_query_key_heads(x):\n    return x\n"
    with pytest.raises(ApplyError, match="already binds _expand_query_key_heads") as exc:
        REGISTRY["gdn_prepare_qkv_fused_copies"](carried, "gated_delta_net.py")
    assert "recipe adds it" in exc.value.hint


@pytest.mark.parametrize("block", [
    "try:\n    from fused_ops import _split_query_key_value\nexcept ImportError:\n    _split_query_key_value = None\n",
    "if torch.cuda.is_available():\n    _split_query_key_value = torch.split\n",
])
def test_fused_copies_refuse_a_helper_name_bound_inside_a_block(block):
    # hostile19: a carried try/except import of the name passed (exit 0) and the def added after
    # the class silently shadowed the user's binding
    before = _with_cp_size()
    carried = before.replace("\n\nclass GatedDeltaNet", "\n\n" + block + "\n\nclass GatedDeltaNet", 1)
    line = carried.splitlines().index(block.splitlines()[1]) + 1
    with pytest.raises(ApplyError, match=r"already binds _split_query_key_value inside a block \(line") as exc:
        REGISTRY["gdn_prepare_qkv_fused_copies"](carried, "gated_delta_net.py")
    assert exc.value.exit_code == 6 and exc.value.name == "_split_query_key_value"
    assert exc.value.lineno == line and "hint" not in exc.value.message and exc.value.hint


@pytest.mark.parametrize("old, gone", [
    ("from megatron.core.jit import jit_fuser\n", "jit_fuser"),
    ("from torch import Tensor\n", "Tensor"),
    ("    from fla.modules.l2norm import l2norm\nexcept ImportError:\n    l2norm = None\n",
     "l2norm"),
])
def test_fused_copies_refuse_a_module_that_lacks_a_name_their_code_reads(old, gone):
    # hostile19: a carry without the jit_fuser import gave exit 7 with a hint to pass
    # --no-import-check, which then wrote a module that fails with NameError on import
    before = _with_cp_size()
    assert old in before
    carried = before.replace(old, "    pass\nexcept ImportError:\n    pass\n" if gone == "l2norm" else "", 1)
    with pytest.raises(ApplyError, match=f"uses {gone}, which the module does not bind") as exc:
        REGISTRY["gdn_prepare_qkv_fused_copies"](carried, "gated_delta_net.py")
    assert exc.value.exit_code == 6 and gone in exc.value.hint


def test_fused_copies_accept_helpers_the_carry_already_has_in_the_recipes_form_before_the_class():
    once = REGISTRY["gdn_prepare_qkv_fused_copies"](_with_cp_size(), "gated_delta_net.py").text
    start, end = once.index("\n\n\n@jit_fuser\ndef _split"), once.index("\n\n\ndef get_parameter_local_cp")
    helpers = once[start:end]
    moved = once[:start] + once[end:]
    moved = moved.replace("\n\n\nclass GatedDeltaNet", helpers + "\n\n\nclass GatedDeltaNet", 1)
    result = REGISTRY["gdn_prepare_qkv_fused_copies"](moved, "gated_delta_net.py")
    assert result.status == "already-present" and result.text == moved


def test_fused_copies_keep_a_carried_body_rebased_onto_the_template():
    # hostile19: a carry holding the step's body plus one line of its own (what the conflict hint
    # asks for: "rebase the carried hunk onto the backported code") was still a conflict (exit 6)
    once = REGISTRY["gdn_prepare_qkv_fused_copies"](_with_cp_size(), "gated_delta_net.py").text
    rebased = once.replace("        return _expand_query_key_heads(",
                           "        query_key = query_key * self.qk_scale  # CARRY19\n"
                           "        return _expand_query_key_heads(", 1)
    assert rebased != once
    result = REGISTRY["gdn_prepare_qkv_fused_copies"](rebased, "gated_delta_net.py")
    assert result.status == "already-present" and result.text == rebased


def test_fused_copies_replace_a_body_whose_template_statement_the_carry_changed():
    # a changed statement of the template's is not "the template plus additions": the step
    # rewrites the body (the engine's three-way merge then reports the conflict)
    once = REGISTRY["gdn_prepare_qkv_fused_copies"](_with_cp_size(), "gated_delta_net.py").text
    changed = once.replace("query_key = l2norm(query_key)", "query_key = l2norm(query_key, eps=1e-6)", 1)
    assert changed != once
    result = REGISTRY["gdn_prepare_qkv_fused_copies"](changed, "gated_delta_net.py")
    assert result.status == "applied" and result.text == once


from test_finalize_transforms import FINALIZE_SITES  # noqa: E402


def test_transforms_are_deterministic():
    special = {"gdn_prepare_qkv_fused_copies": _with_cp_size(),
               "packed_seq_params_metadata_fields": PACKED_SEQ_PARAMS,
               "te_attention_skip_packed_metadata": TE_ATTENTION,
               "context_parallel_layout_finalize_export": CONTEXT_PARALLEL_LAYOUT,
               "gdn_init_register_linear_cp_mode": REGISTRY["gdn_init_check_linear_cp"](GDN, "x.py").text,
               **{name: text for name, (text, _) in FINALIZE_SITES.items()},
               "gdn_init_check_fla_version": GDN.replace(
                   "        self.config = config\n",
                   "        if not HAVE_FLA:\n            raise ImportError('no FLA')\n        self.config = config\n")}
    for name in sorted(REGISTRY):
        src = CONFIG if "config" in name else special.get(name, GDN)
        assert REGISTRY[name](src, "x.py") == REGISTRY[name](src, "x.py")


UP = '"""Upstream."""\n\n\ndef keep():\n    return 1\n\n\ndef resolve(a):\n    return a or 2\n\n\nclass Helper:\n    x = 1\n'


def test_transplant_appends_new_symbols_in_the_given_order():
    out = transplant('"""Ours."""\n\nVALUE = 1\n', UP, ["Helper", "resolve"], "m.py", "abc")
    assert out == '"""Ours."""\n\nVALUE = 1\n\n\nclass Helper:\n    x = 1\n\n\ndef resolve(a):\n    return a or 2\n'


def test_transplant_replaces_an_existing_symbol_in_place():
    ours = "def resolve(a):\n    return a\n\n\nTAIL = 1\n"
    out = transplant(ours, UP, ["resolve"], "m.py", "abc")
    assert out == "\n\ndef resolve(a):\n    return a or 2\n\n\nTAIL = 1\n"
    cst.parse_module(out)


def test_transplant_of_a_missing_symbol_is_apply_error():
    with pytest.raises(ApplyError, match=r"m.py@abc: symbol 'absent' to transplant not found") as exc:
        transplant("X = 1\n", UP, ["resolve", "absent"], "m.py", "abc")
    assert exc.value.exit_code == 6


PACKED_SEQ_PARAMS = """from dataclasses import dataclass


@dataclass
class PackedSeqParams:
    qkv_format: str = None
    total_tokens: int = None
    seq_idx: Tensor = None

    def __post_init__(self):
        pass
"""

TE_ATTENTION = """class TEDotProductAttention(te.pytorch.DotProductAttention):
    def __init__(self, config):
        self.kept_packed_seq_params = set(field.name for field in dataclasses.fields(PackedSeqParams))
        # total_tokens and seq_idx are only for Mamba and should not be forwarded to TE attention.
        self.kept_packed_seq_params.discard("total_tokens")
        self.kept_packed_seq_params.discard("seq_idx")

        super().__init__()
"""


METADATA_FIELDS = ["cp_partition_route", "gdn_packed_metadata"]


def test_packed_seq_params_gets_the_metadata_fields_after_seq_idx_once():
    result = REGISTRY["packed_seq_params_metadata_fields"](PACKED_SEQ_PARAMS, "packed_seq_params.py")
    cls = ast.parse(result.text).body[1]
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert result.status == "applied"
    assert fields == ["qkv_format", "total_tokens", "seq_idx", *METADATA_FIELDS]
    assert all(ast.literal_eval(n.value) is None for n in cls.body[3:5])
    again = REGISTRY["packed_seq_params_metadata_fields"](result.text, "packed_seq_params.py")
    assert again.status == "already-present" and again.text == result.text


@pytest.mark.parametrize("name", METADATA_FIELDS)
def test_packed_seq_params_field_in_another_form_is_refused(name):
    from backport.errors import BindingExists

    text = PACKED_SEQ_PARAMS.replace("seq_idx: Tensor = None\n", f"seq_idx: Tensor = None\n    {name}: dict = None\n")
    with pytest.raises(BindingExists, match=name):
        REGISTRY["packed_seq_params_metadata_fields"](text, "packed_seq_params.py")


@pytest.mark.parametrize("name", METADATA_FIELDS)
def test_packed_seq_params_with_only_one_of_the_fields_is_refused(name):
    # the recipe's own form of one field but not the other: a carry that half-adds them
    text = PACKED_SEQ_PARAMS.replace("seq_idx: Tensor = None\n", f"seq_idx: Tensor = None\n    {name}: object = None\n")
    with pytest.raises(ApplyError, match="only some of cp_partition_route, gdn_packed_metadata"):
        REGISTRY["packed_seq_params_metadata_fields"](text, "packed_seq_params.py")


def test_packed_seq_params_without_the_seq_idx_anchor_is_apply_error():
    with pytest.raises(ApplyError, match="PackedSeqParams.seq_idx"):
        REGISTRY["packed_seq_params_metadata_fields"](PACKED_SEQ_PARAMS.replace("seq_idx", "idx"), "p.py")


def test_te_attention_discards_the_metadata_fields_after_seq_idx_once():
    result = REGISTRY["te_attention_skip_packed_metadata"](TE_ATTENTION, "transformer_engine.py")
    assert result.status == "applied"
    lines = [ln.strip() for ln in result.text.splitlines() if "discard" in ln]
    assert lines[-3:] == ['self.kept_packed_seq_params.discard("seq_idx")',
                          'self.kept_packed_seq_params.discard("cp_partition_route")',
                          'self.kept_packed_seq_params.discard("gdn_packed_metadata")']
    again = REGISTRY["te_attention_skip_packed_metadata"](result.text, "transformer_engine.py")
    assert again.status == "already-present" and again.text == result.text
    with pytest.raises(ApplyError, match="discard"):
        REGISTRY["te_attention_skip_packed_metadata"](TE_ATTENTION.replace('"seq_idx"', '"x"'), "te.py")


# The shape of upstream 5139086e's megatron/core/context_parallel_layout.py that the export
# anchors on: module-level defs, zigzag_to_contiguous_chunks among them.
CONTEXT_PARALLEL_LAYOUT = '''"""Layouts."""

import torch


def zigzag_to_contiguous_chunks(x, group, seq_dim=0):
    return x


def contiguous_to_zigzag_chunks(x, group, seq_dim=0):
    return x
'''

EXPORT_NAMES = ("finalize_packed_seq_params", "prebuild_thd_cp_partition_routes")


def _exported_names(text):
    """Names imported from megatron.core.ssm.gdn_context_parallel at module level."""
    return [a.name for st in ast.parse(text).body if isinstance(st, ast.ImportFrom)
            and st.module == "megatron.core.ssm.gdn_context_parallel" for a in st.names]


def test_context_parallel_layout_export_is_appended_once():
    result = REGISTRY["context_parallel_layout_finalize_export"](CONTEXT_PARALLEL_LAYOUT, "context_parallel_layout.py")
    assert result.status == "applied"
    # upstream's bytes stay the exact prefix (backport.verify's verbatim check allows an append)
    assert result.text.startswith(CONTEXT_PARALLEL_LAYOUT)
    assert _exported_names(result.text) == list(EXPORT_NAMES)
    tail = ast.parse(result.text[len(CONTEXT_PARALLEL_LAYOUT):])
    assert [type(st).__name__ for st in tail.body] == ["ImportFrom"]
    again = REGISTRY["context_parallel_layout_finalize_export"](result.text, "context_parallel_layout.py")
    assert again.status == "already-present" and again.text == result.text


def test_context_parallel_layout_export_in_another_form_is_binding_exists():
    from backport.errors import BindingExists

    text = CONTEXT_PARALLEL_LAYOUT + "\nfrom megatron.core.somewhere import finalize_packed_seq_params\n"
    with pytest.raises(BindingExists, match="already imports") as exc:
        REGISTRY["context_parallel_layout_finalize_export"](text, "context_parallel_layout.py")
    assert exc.value.exit_code == 6 and "line 13" in str(exc.value)


@pytest.mark.parametrize("name", EXPORT_NAMES)
def test_context_parallel_layout_that_defines_a_name_is_binding_exists(name):
    from backport.errors import BindingExists

    text = CONTEXT_PARALLEL_LAYOUT + f"\n\ndef {name}(packed_seq_params):\n    return packed_seq_params\n"
    with pytest.raises(BindingExists, match=f"already defines {name}"):
        REGISTRY["context_parallel_layout_finalize_export"](text, "context_parallel_layout.py")


def test_context_parallel_layout_without_the_anchor_is_apply_error():
    text = CONTEXT_PARALLEL_LAYOUT.replace("zigzag_to_contiguous_chunks", "zigzag_to_contiguous")
    with pytest.raises(ApplyError, match="anchor def zigzag_to_contiguous_chunks not found"):
        REGISTRY["context_parallel_layout_finalize_export"](text, "context_parallel_layout.py")
