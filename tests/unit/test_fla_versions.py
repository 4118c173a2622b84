"""The FLA axis: which FLA releases the patched tree accepts (the recipe's version guard), the
capability check's Hopper/triton rule with faked versions, and the lock selection of each FLA set
(docker/requirements-cuda-fla052.lock beside the default locks). No network, no Docker."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from typing import Optional

import pytest

from backport.errors import ApplyError, BindingExists
from backport.recipe import load_recipe
from backport.transforms import REGISTRY
from image_pipeline.build import FLA_PIN, TRITON_PIN, build_args, image_tags
from image_pipeline.errors import InputError
from image_pipeline.inputs import FLAVOURS, Preflight, flavour_lock
from image_pipeline.lock import (DEFAULT_FLA, FLA_SETS, TARGETS, LockEntry, base_provided, held_pins, parse_lock,
                                 render_lock, requirements_for, target_for)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "docker"))
import capability_check as cc  # noqa: E402

ADAPTATION = REPO / "backport" / "adaptations" / "gdn_context_parallel.py"
GUARD_NAMES = ("SUPPORTED_FLA_VERSIONS", "UnsupportedFLAError", "installed_fla_version", "check_fla_version")


# --------------------------------------------------------------------------- the version guard

@pytest.fixture()
def guard():
    """The guard's definitions from our adaptation module, without the rest of the tree (which
    needs Megatron): a namespace holding :data:`GUARD_NAMES`."""
    tree = ast.parse(ADAPTATION.read_text(encoding="utf-8"))
    keep = [node for node in tree.body
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in GUARD_NAMES)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", "") in GUARD_NAMES for t in node.targets))]
    assert len(keep) == len(GUARD_NAMES), "the guard's definitions moved out of gdn_context_parallel.py"
    namespace = {"Optional": Optional}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(ADAPTATION), "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in GUARD_NAMES})


def test_guard_lists_the_image_fla_sets(guard):
    assert guard.SUPPORTED_FLA_VERSIONS == tuple(sorted(FLA_SETS)) == ("0.4.2", "0.5.2", "0.6.0")


@pytest.mark.parametrize("version", ["0.4.2", "0.5.2", "0.6.0"])
def test_guard_accepts_the_supported_versions(guard, version):
    assert guard.check_fla_version(version) == version


@pytest.mark.parametrize("version", ["0.4.1", "0.5.1", "0.5.3", "0.6.1", "0.7.0", "0.4.2.dev0"])
def test_guard_refuses_others_naming_the_version_found(guard, version):
    with pytest.raises(guard.UnsupportedFLAError) as exc:
        guard.check_fla_version(version)
    text = str(exc.value)
    assert f"flash-linear-attention {version} is installed" in text
    assert "0.4.2, 0.5.2 and 0.6.0 only" in text and "pip install flash-linear-attention==0.5.2" in text
    assert "`pip install fla-core==0.6.0 triton==3.7.1` (without flash-linear-attention)" in text
    assert not isinstance(exc.value, (ImportError, TypeError))  # not mistaken for "FLA missing"


def test_guard_reads_the_fla_that_imports(guard, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.1"))
    assert guard.installed_fla_version() == "0.6.1"
    with pytest.raises(guard.UnsupportedFLAError, match="flash-linear-attention 0.6.1 is installed"):
        guard.check_fla_version()
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.5.2"))
    assert guard.check_fla_version() == "0.5.2"


def test_guard_without_fla_says_not_found(guard, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert guard.installed_fla_version() is None
    with pytest.raises(guard.UnsupportedFLAError, match=r"\(not found\)"):
        guard.check_fla_version()


GDN_SOURCE = '''\
class GatedDeltaNet(MegatronModule):
    def __init__(self, config):
        """Doc."""

        if not HAVE_FLA:
            raise ImportError("FLA is not installed.")

        super().__init__(config)
        self.v_dim_local_tp = 4
'''


def test_transform_puts_the_check_right_after_the_have_fla_check():
    result = REGISTRY["gdn_init_check_fla_version"](GDN_SOURCE, "gated_delta_net.py")
    assert result.status == "applied"
    lines = result.text.splitlines()
    call = lines.index("        gdn_context_parallel.check_fla_version()")
    assert lines[call - 3].strip() == 'raise ImportError("FLA is not installed.")'
    assert lines[call + 2].strip() == "super().__init__(config)"
    again = REGISTRY["gdn_init_check_fla_version"](result.text, "gated_delta_net.py")
    assert (again.status, again.text) == ("already-present", result.text)


def test_transform_refuses_a_carried_check_of_another_form_and_a_missing_anchor():
    carried = GDN_SOURCE.replace("        super().__init__",
                                 "        check_fla_version('0.4.2')\n        super().__init__")
    with pytest.raises(BindingExists, match="already calls check_fla_version"):
        REGISTRY["gdn_init_check_fla_version"](carried, "gated_delta_net.py")
    with pytest.raises(ApplyError, match="if not HAVE_FLA"):
        REGISTRY["gdn_init_check_fla_version"](GDN_SOURCE.replace("not HAVE_FLA", "HAVE_FLA is False"),
                                               "gated_delta_net.py")


def test_recipe_lists_the_guard_as_beyond_upstream_with_its_reason():
    recipe, _ = load_recipe(REPO / "manifests" / "gdn-chunkwise-cp.yaml")
    step = next(s for s in recipe.steps if s.id == "adapt-gdn-fla-version-check")
    assert step.transform == "gdn_init_check_fla_version"
    assert step.beyond_upstream and "state_v_first" in step.beyond_upstream[0].why
    assert "0.6.0" in step.why and "chunk_indices" in step.beyond_upstream[0].why


# --------------------------------------------------------------------------- capability check

@pytest.mark.parametrize("fla, triton", [("0.5.2", "3.6.0"), ("0.5.2", "3.4.0"), ("0.5.0", "3.7.0+git4a1b"),
                                         ("0.6.0", "3.5.1"), ("0.6.0", "3.6.0")])
def test_capability_refuses_hopper_fla05_old_triton_without_tilelang(fla, triton):
    with pytest.raises(AssertionError) as exc:
        cc.check_fla_hopper(fla, triton, hopper=True, tilelang=False, seen="NVIDIA H200 (sm90)")
    text = str(exc.value)
    assert f"FLA {fla} with triton {triton} on Hopper (NVIDIA H200 (sm90))" in text
    assert "triton >= 3.7.1" in text and "`make image FLA=0.5.2`" in text and "pip install tilelang" in text


@pytest.mark.parametrize("fla, triton, hopper, tilelang", [
    ("0.5.2", "3.7.1", True, False),   # the fixed triton
    ("0.5.2", "3.8.0", True, False),
    ("0.5.2", "3.6.0", True, True),    # FLA's tilelang backend takes the kernel
    ("0.5.2", "3.6.0", False, False),  # not Hopper: FLA does not refuse
    ("0.5.2", "3.3.1", True, False),   # below FLA's bad range
    ("0.4.2", "3.6.0", True, False),   # FLA 0.4.2 has no such rule (the default image)
    (None, "3.6.0", True, False),      # no FLA: other checks say so
])
def test_capability_accepts_what_fla_runs(fla, triton, hopper, tilelang):
    detail = cc.check_fla_hopper(fla, triton, hopper=hopper, tilelang=tilelang)
    assert detail["fla"] == fla and detail["triton"] == triton


def test_capability_gpu_choice_and_tilelang_switch(monkeypatch):
    assert cc.gpu_arch("none")["hopper"] is False and cc.gpu_arch("hopper")["hopper"] is True
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    seen = cc.gpu_arch("auto")
    assert seen["hopper"] is True and "assuming Hopper" in seen["seen"]
    fake_torch.cuda = types.SimpleNamespace(is_available=lambda: True, get_device_capability=lambda: (8, 0),
                                            get_device_name=lambda: "NVIDIA A100")
    assert cc.gpu_arch("auto") == {"hopper": False, "seen": "NVIDIA A100 (sm80)"}
    monkeypatch.setattr(cc.importlib.util, "find_spec", lambda name: object())
    assert cc.tilelang_usable({"FLA_TILELANG": "0", "CUDA_HOME": "/nowhere"}) is False
    monkeypatch.setattr(cc.shutil, "which", lambda name: "/usr/bin/nvcc")
    assert cc.tilelang_usable({"CUDA_HOME": "/nowhere"}) is True
    monkeypatch.setattr(cc.importlib.util, "find_spec", lambda name: None)
    assert cc.tilelang_usable({}) is False


def test_release_parses_local_and_dev_versions():
    assert cc.release("3.7.1+git4a1b") == (3, 7, 1) and cc.release("0.5.2") == (0, 5, 2)
    assert cc.release(None) == () and cc.release("abc") == ()


# --------------------------------------------------------------------------- lock selection

def test_default_set_is_unchanged():
    assert (DEFAULT_FLA, FLA_PIN, TRITON_PIN) == ("0.4.2", "0.4.2", "3.6.0")
    assert target_for("cuda") is TARGETS["cuda"] and target_for("cpu", "0.4.2") is TARGETS["cpu"]
    assert flavour_lock("cuda").name == "requirements-cuda.lock"
    assert flavour_lock("cpu").name == "requirements-cpu.lock"


def test_fla052_selects_its_own_lock_and_build_args():
    target = target_for("cuda", "0.5.2")
    assert (target.key, target.triton, target.torch, target.own_torch) == ("cuda-fla052", "3.7.1", "torch==2.12.1",
                                                                          True)
    assert flavour_lock("cuda", "0.5.2") == REPO / "docker" / "requirements-cuda-fla052.lock"
    pre = Preflight("p" * 64, "m" * 64, "l" * 64, "t" * 64, "20261130-85bced0ae.patch", {}, {}, 27)
    args = build_args(FLAVOURS["cuda"], pre, fla="0.5.2")
    assert (args["FLA_VERSION"], args["TRITON_VERSION"]) == ("0.5.2", "3.7.1")
    assert build_args(FLAVOURS["cuda"], pre)["TRITON_VERSION"] == "3.6.0"
    assert image_tags(FLAVOURS["cuda"], pre, "0.5.2") == ["gdn-megatron:cuda-fla052",
                                                          "gdn-megatron:cuda-fla052-pppppppppppp"]
    assert image_tags(FLAVOURS["cuda"], pre) == ["gdn-megatron:cuda", "gdn-megatron:cuda-pppppppppppp"]


def test_cpu_flavour_with_fla052_is_refused_naming_the_locks_that_exist():
    with pytest.raises(InputError) as exc:
        flavour_lock("cpu", "0.5.2")
    assert exc.value.exit_code == 13
    assert "no lock for the cpu flavour with FLA 0.5.2" in exc.value.message
    assert "cuda (FLA 0.5.2)" in exc.value.message


def test_requirements_for_replaces_only_the_fla_axis():
    source = REPO / "docker" / "requirements.in"
    default = requirements_for(source, TARGETS["cuda"])
    fla052 = requirements_for(source, target_for("cuda", "0.5.2"))
    assert "flash-linear-attention==0.4.2" in default and "triton==3.6.0" in default
    assert [r for r in fla052 if r.split("==")[0] in ("flash-linear-attention", "fla-core", "triton")] == [
        "flash-linear-attention==0.5.2", "fla-core==0.5.2", "triton==3.7.1"]
    assert sorted(set(default) - set(fla052)) == ["fla-core==0.4.2", "flash-linear-attention==0.4.2", "triton==3.6.0"]


def test_fla052_target_locks_torch_and_its_cuda_runtime_but_not_transformer_engine():
    target = target_for("cuda", "0.5.2")
    for name in ("torch", "torchvision", "nvidia-cublas-cu12", "nvidia-cublas", "cuda-bindings", "cuda-toolkit"):
        assert base_provided(target, name) is False, name
    assert base_provided(target, "transformer-engine") is True
    assert base_provided("cuda", "torch") is True and base_provided(TARGETS["cuda"], "nvidia-cublas-cu12") is True
    text = render_lock([LockEntry("torch", "2.12.1", {"a" * 64})], target)
    assert text.startswith("# Generated by `tools/image lock --flavour cuda --fla 0.5.2`")
    assert "holds torch==2.12.1 (it declares\n# triton==3.7.1)" in text
    default_text = render_lock([LockEntry("a", "1", {"a" * 64})], TARGETS["cuda"])
    assert "--fla " not in default_text and "FLA 0.5.2" not in default_text


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_default_locks_render_byte_for_byte_as_committed(flavour):
    """The FLA axis changed the lock tooling, not the default locks: re-rendering a committed
    lock with its target gives its exact bytes."""
    text = flavour_lock(flavour).read_text(encoding="utf-8")
    assert render_lock(parse_lock(text).values(), TARGETS[flavour]) == text


FLA052_LOCK = REPO / "docker" / "requirements-cuda-fla052.lock"


@pytest.mark.skipif(not FLA052_LOCK.exists(), reason="docker/requirements-cuda-fla052.lock not generated")
def test_committed_fla052_lock_pins_the_set():
    entries = parse_lock(FLA052_LOCK.read_text())
    assert entries["flash-linear-attention"].version == entries["fla-core"].version == "0.5.2"
    assert entries["triton"].version == "3.7.1" and entries["torch"].version == "2.12.1"
    assert "torchvision" in entries and "transformer-engine" not in entries
    assert all(e.hashes for e in entries.values())
    default = parse_lock(flavour_lock("cuda").read_text())
    assert default["flash-linear-attention"].version == "0.4.2" and default["triton"].version == "3.6.0"
    assert "torch" not in default


def test_held_pins_keep_the_default_versions_except_the_axis_torch_and_what_torch_refuses():
    default = {n: LockEntry(n, v, {"0" * 64}) for n, v in [
        ("accelerate", "1.15.0"), ("setuptools", "84.2.1"), ("sympy", "1.14.0"), ("triton", "3.6.0"),
        ("fla-core", "0.4.2"), ("flash-linear-attention", "0.4.2"), ("torchvision", "0.25.0"),
        ("nvidia-cutlass-dsl-libs-cu13", "4.8.1")]}
    torch_requires = ["setuptools<82", "sympy>=1.13.3", "triton==3.7.1; platform_system == \"Linux\"",
                      "accelerate<1; platform_system == \"Windows\""]  # a marker false for the target
    held = held_pins(default, target_for("cuda", "0.5.2"), torch_requires)
    assert held == ["accelerate==1.15.0", "nvidia-cutlass-dsl-libs-cu13==4.8.1", "sympy==1.14.0"]


def _record_dry_runs(monkeypatch) -> list:
    """Replace the lock's pip dry run by one that installs the lock's entries as they are; returns
    the list that gets each run's sorted package names."""
    from image_pipeline import lock as L

    runs = []

    def fake_dry_run(path, target, python):
        entries = parse_lock(path.read_text())
        runs.append(sorted(entries))
        return {"install": [_fake_item(e) for e in entries.values()]}

    monkeypatch.setattr(L, "_dry_run", fake_dry_run)
    return runs


def _fake_item(entry):
    return {"metadata": {"name": entry.name, "version": entry.version, "requires_dist": []}}


def test_check_locks_dry_runs_only_the_pins_the_second_lock_does_not_share(tmp_path, monkeypatch):
    from image_pipeline import lock as L

    default = [LockEntry("flash-linear-attention", "0.4.2", {"1" * 64}), LockEntry("fla-core", "0.4.2", {"2" * 64}),
               LockEntry("triton", "3.6.0", {"3" * 64}), LockEntry("einops", "0.8.2", {"4" * 64}),
               LockEntry("numpy", "2.3.5", {"5" * 64})]
    fla052 = [LockEntry("flash-linear-attention", "0.5.2", {"6" * 64}), LockEntry("fla-core", "0.5.2", {"7" * 64}),
              LockEntry("triton", "3.7.1", {"8" * 64}), LockEntry("einops", "0.8.2", {"4" * 64}),
              LockEntry("numpy", "2.3.5", {"9" * 64})]  # same version, other hashes: not shared
    first, second = tmp_path / "requirements-cuda.lock", tmp_path / "requirements-cuda-fla052.lock"
    first.write_text(render_lock(default, TARGETS["cuda"]))
    second.write_text(render_lock(fla052, target_for("cuda", "0.5.2")))
    runs = _record_dry_runs(monkeypatch)
    results = L.check_locks([(first, TARGETS["cuda"]), (second, target_for("cuda", "0.5.2"))])
    assert runs[0] == ["einops", "fla-core", "flash-linear-attention", "numpy", "triton"]
    assert runs[1] == ["fla-core", "flash-linear-attention", "numpy", "triton"]  # einops from the first report
    assert [(r["fla"], r["packages"], r["shared"]) for r in results] == [("0.4.2", 5, 0), ("0.5.2", 5, 1)]
    second.write_text(render_lock(fla052[:2] + [LockEntry("triton", "3.6.0", {"3" * 64})] + fla052[3:],
                                  target_for("cuda", "0.5.2")))
    with pytest.raises(Exception, match=r"does not hold the FLA 0.5.2 set: triton==3.6.0"):
        L.check_locks([(first, TARGETS["cuda"]), (second, target_for("cuda", "0.5.2"))])


# --------------------------------------------------------------------------- the FLA 0.6.0 set

def test_fla060_set_is_fla_core_alone_on_the_052_torch_and_triton():
    target = target_for("cuda", "0.6.0")
    assert (target.key, target.triton, target.torch, target.own_torch) == ("cuda-fla060", "3.7.1", "torch==2.12.1",
                                                                          True)
    assert FLA_SETS["0.6.0"].packages == ("fla-core",)
    assert flavour_lock("cuda", "0.6.0") == REPO / "docker" / "requirements-cuda-fla060.lock"
    reqs = requirements_for(REPO / "docker" / "requirements.in", target)
    axis = [r for r in reqs if r.split("==")[0] in ("flash-linear-attention", "fla-core", "triton")]
    assert axis == ["fla-core==0.6.0", "triton==3.7.1"]
    text = render_lock([LockEntry("fla-core", "0.6.0", {"a" * 64})], target)
    assert "# FLA 0.6.0 set: fla-core 0.6.0, triton 3.7.1" in text
    assert "flash-linear-attention 0.6.0 requires transformers>=5.6.2, Megatron-Bridge <=5.6.0" in text
    with pytest.raises(InputError, match="no lock for the cpu flavour with FLA 0.6.0"):
        flavour_lock("cpu", "0.6.0")


def test_held_pins_release_what_the_fla_set_refuses():
    """FLA 0.6.0 needs transformers>=5.6.2: the default lock's 5.6.0 is not held (the resolver then
    refuses the set against Bridge's <=5.6.0, which is why the set leaves flash-linear-attention out)."""
    default = {n: LockEntry(n, v, {"0" * 64}) for n, v in [("transformers", "5.6.0"), ("einops", "0.8.2")]}
    held = held_pins(default, target_for("cuda", "0.6.0"), ["transformers<6,>=5.6.2", "einops"])
    assert held == ["einops==0.8.2"]


FLA060_LOCK = REPO / "docker" / "requirements-cuda-fla060.lock"


@pytest.mark.skipif(not FLA060_LOCK.exists(), reason="docker/requirements-cuda-fla060.lock not generated")
def test_committed_fla060_lock_pins_the_set():
    entries = parse_lock(FLA060_LOCK.read_text())
    assert entries["fla-core"].version == "0.6.0" and "flash-linear-attention" not in entries
    assert entries["triton"].version == "3.7.1" and entries["torch"].version == "2.12.1"
    assert entries["transformers"].version == parse_lock(flavour_lock("cuda").read_text())["transformers"].version
    assert all(e.hashes for e in entries.values())
    assert render_lock(entries.values(), target_for("cuda", "0.6.0")) == FLA060_LOCK.read_text()


def test_check_locks_refuses_flash_linear_attention_in_a_core_only_set(tmp_path, monkeypatch):
    from image_pipeline import lock as L

    default = [LockEntry("flash-linear-attention", "0.4.2", {"1" * 64}), LockEntry("fla-core", "0.4.2", {"2" * 64}),
               LockEntry("triton", "3.6.0", {"3" * 64})]
    fla060 = [LockEntry("fla-core", "0.6.0", {"7" * 64}), LockEntry("triton", "3.7.1", {"8" * 64})]
    first, second = tmp_path / "requirements-cuda.lock", tmp_path / "requirements-cuda-fla060.lock"
    first.write_text(render_lock(default, TARGETS["cuda"]))
    second.write_text(render_lock(fla060, target_for("cuda", "0.6.0")))
    monkeypatch.setattr(L, "_dry_run", lambda path, target, python: {
        "install": [_fake_item(e) for e in parse_lock(path.read_text()).values()]})
    results = L.check_locks([(first, TARGETS["cuda"]), (second, target_for("cuda", "0.6.0"))])
    assert [(r["fla"], r["packages"]) for r in results] == [("0.4.2", 3), ("0.6.0", 2)]
    second.write_text(render_lock(fla060 + [LockEntry("flash-linear-attention", "0.6.0", {"9" * 64})],
                                  target_for("cuda", "0.6.0")))
    with pytest.raises(Exception, match=r"flash-linear-attention==0.6.0 \(the FLA 0.6.0 set leaves it out\)"):
        L.check_locks([(first, TARGETS["cuda"]), (second, target_for("cuda", "0.6.0"))])


@pytest.mark.parametrize("fla, packages", [("0.4.2", ("0.4.2", "0.4.2")), ("0.5.2", ("0.5.2", "0.5.2")),
                                           ("0.6.0", (None, "0.6.0"))])
def test_capability_versions_of_each_set(monkeypatch, fla, packages):
    found = dict(zip(("flash-linear-attention", "fla-core"), packages), triton="3.7.1", torch="2.12.1")
    monkeypatch.setattr(cc, "_version", lambda dist: found.get(dist))
    assert cc.check_versions(fla, "3.7.1")["fla-core"] == fla
    if fla == "0.6.0":
        found["flash-linear-attention"] = "0.6.0"
        with pytest.raises(AssertionError, match="flash-linear-attention==0.6.0 \\(want none: the set leaves it out\\)"):
            cc.check_versions(fla, "3.7.1")


def test_check_locks_third_lock_reuses_the_second_locks_dry_run(tmp_path, monkeypatch):
    """The 0.6.0 lock shares torch's closure with the 0.5.2 lock, not with the default: it dry-runs
    only fla-core (the one pin no earlier lock holds alike)."""
    from image_pipeline import lock as L

    default = [LockEntry("flash-linear-attention", "0.4.2", {"1" * 64}), LockEntry("fla-core", "0.4.2", {"2" * 64}),
               LockEntry("triton", "3.6.0", {"3" * 64}), LockEntry("einops", "0.8.2", {"4" * 64})]
    fla052 = [LockEntry("flash-linear-attention", "0.5.2", {"6" * 64}), LockEntry("fla-core", "0.5.2", {"7" * 64}),
              LockEntry("triton", "3.7.1", {"8" * 64}), LockEntry("einops", "0.8.2", {"4" * 64}),
              LockEntry("torch", "2.12.1", {"9" * 64})]
    fla060 = [LockEntry("fla-core", "0.6.0", {"a" * 64}), LockEntry("triton", "3.7.1", {"8" * 64}),
              LockEntry("einops", "0.8.2", {"4" * 64}), LockEntry("torch", "2.12.1", {"9" * 64})]
    paths = [tmp_path / f"requirements-{k}.lock" for k in ("cuda", "cuda-fla052", "cuda-fla060")]
    targets = [TARGETS["cuda"], target_for("cuda", "0.5.2"), target_for("cuda", "0.6.0")]
    for path, entries, target in zip(paths, (default, fla052, fla060), targets):
        path.write_text(render_lock(entries, target))
    runs = _record_dry_runs(monkeypatch)
    results = L.check_locks(list(zip(paths, targets)))
    assert runs[1] == ["fla-core", "flash-linear-attention", "torch", "triton"]
    assert runs[2] == ["fla-core"]
    assert [(r["fla"], r["packages"], r["shared"]) for r in results] == [("0.4.2", 4, 0), ("0.5.2", 5, 1),
                                                                         ("0.6.0", 4, 3)]


def test_megatron_import_tells_a_missing_outside_package_from_a_broken_module(tmp_path, monkeypatch):
    """The capability check's megatron-import: a patched module that needs a package this image
    flavour leaves out (Bridge's Qwen3-VL and training modules need transformer_engine, absent in
    the cpu image) is recorded, not failed; a module broken by the patch still fails the check."""
    pkg = tmp_path / "megatron"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good_mod.py").write_text("X = 1\n")
    (pkg / "needs_te.py").write_text("import transformer_engine_absent_here  # noqa\n")
    (pkg / "broken.py").write_text("from megatron.not_there import y  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    got = cc.check_megatron_import(["megatron.good_mod", "megatron.needs_te"], tmp_path.resolve())
    assert got == {"imported": ["megatron.good_mod"],
                   "missing_dependency": {"megatron.needs_te": "transformer_engine_absent_here"}}
    with pytest.raises(AssertionError, match="megatron.broken"):
        cc.check_megatron_import(["megatron.good_mod", "megatron.broken"], tmp_path.resolve())
    with pytest.raises(AssertionError, match="no patched module imports"):
        cc.check_megatron_import(["megatron.needs_te"], tmp_path.resolve())
