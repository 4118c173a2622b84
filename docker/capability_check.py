"""Dockerfile stage `image`: refuse the build unless the image can run GDN chunkwise CP.

Checks (each one named in the output; any failure exits 1):
  versions        FLA (flash-linear-attention, fla-core) and triton at the pins
  fla-cp          ``from fla.ops.cp import build_cp_context`` imports
  fla-signatures  ``causal_conv1d`` and ``chunk_gated_delta_rule`` take ``cp_context``
  fla-hopper      not FLA >= 0.5 with triton >= 3.4.0, < 3.7.1 on Hopper without a usable
                  tilelang: FLA refuses that in every backward (its issue #640). The GPU is
                  the visible one, else (no GPU at build time) Hopper, the cuda image's target;
                  --gpu none skips the rule
  megatron-import every Python module the patch touches imports from the patched tree
  fla-supported   the patched tree's GDN layers accept the installed FLA release
                  (``gdn_context_parallel.check_fla_version``)
  linear-cp-mode  ``TransformerConfig`` accepts exactly headwise/chunkwise/all_gather
                  for a GDN model and rejects ``auto`` and an unknown value

Writes the results, with the torch/FLA/triton versions, as JSON to --out.
Runs on CPU; needs no GPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import traceback
import warnings
from importlib import metadata
from pathlib import Path

MODES = ("headwise", "chunkwise", "all_gather")
REJECTED = ("auto", "ring")


def patched_modules(patch_text: str) -> list[str]:
    """Dotted names of the Python modules a ``-p1`` patch adds or changes under megatron/."""
    mods = []
    for line in patch_text.splitlines():
        if not line.startswith("+++ b/"):
            continue
        path = line[len("+++ b/"):].split("\t")[0].strip()
        if path.startswith("megatron/") and path.endswith(".py"):
            mod = path[:-3].replace("/", ".")
            if mod.endswith(".__init__"):
                mod = mod[: -len(".__init__")]
            mods.append(mod)
    return sorted(set(mods))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


#: FLA sets that install fla-core alone (image_pipeline/lock.py FLA_SETS): flash-linear-attention
#: 0.6.0 requires transformers>=5.6.2, which Megatron-Bridge 2faedbf6 refuses (<=5.6.0).
FLA_CORE_ONLY = ("0.6.0",)


def check_versions(fla_version: str, triton_version: str) -> dict:
    found = {d: _version(d) for d in ("flash-linear-attention", "fla-core", "triton", "torch")}
    without = fla_version in FLA_CORE_ONLY
    want = {"flash-linear-attention": None if without else fla_version, "fla-core": fla_version,
            "triton": triton_version}
    bad = [f"{d}=={found[d]} (want {v or 'none: the set leaves it out'})" for d, v in want.items() if found[d] != v]
    if bad:
        raise AssertionError("wrong versions installed: " + ", ".join(bad))
    return found


def check_fla_cp() -> None:
    from fla.ops.cp import build_cp_context  # noqa: F401


def check_fla_signatures() -> dict:
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out = {}
    for fn in (causal_conv1d, chunk_gated_delta_rule):
        params = inspect.signature(fn).parameters
        out[fn.__name__] = "cp_context" in params
    missing = [k for k, v in out.items() if not v]
    if missing:
        raise AssertionError(f"{', '.join(missing)} take no cp_context argument")
    return out


#: FLA's rule (fla/ops/common/chunk_o.py, chunk_bwd_dqkwg): on Hopper, triton in
#: [TRITON_BAD_FROM, TRITON_FIXED) gives wrong gated dq/dk/dw/dg, so FLA >= FLA_WITH_RULE raises
#: unless its tilelang backend takes the kernel.
FLA_WITH_RULE = (0, 5)
TRITON_BAD_FROM = (3, 4, 0)
TRITON_FIXED = (3, 7, 1)


def release(version) -> tuple:
    """The leading numbers of a version string (``"3.7.1+git"`` -> ``(3, 7, 1)``); () for None."""
    if not version:
        return ()
    match = re.match(r"\d+(\.\d+)*", str(version))
    return tuple(int(x) for x in match.group(0).split(".")) if match else ()


def tilelang_usable(environ=os.environ) -> bool:
    """What FLA 0.5's tilelang backend needs: ``tilelang`` importable, an ``nvcc``
    (CUDA_HOME/bin or PATH), and ``FLA_TILELANG`` not ``0``."""
    if environ.get("FLA_TILELANG") == "0" or importlib.util.find_spec("tilelang") is None:
        return False
    cuda_home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.access(os.path.join(cuda_home, "bin", "nvcc"), os.X_OK) or shutil.which("nvcc") is not None


def gpu_arch(choice: str = "auto") -> dict:
    """``{"hopper": bool, "seen": str}``: the visible GPU (``auto``), else Hopper assumed, or as told."""
    if choice != "auto":
        return {"hopper": choice == "hopper", "seen": f"--gpu {choice}"}
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return {"hopper": major == 9, "seen": f"{torch.cuda.get_device_name()} (sm{major}{minor})"}
    except Exception:  # no torch or no driver: same as no GPU
        pass
    return {"hopper": True, "seen": "no GPU visible; assuming Hopper (H100/H200), the cuda image's target"}


def check_fla_hopper(fla_version, triton_version, hopper: bool, tilelang: bool, seen: str = "") -> dict:
    """Refuse FLA >= 0.5 with triton >= 3.4.0, < 3.7.1 on Hopper without a usable tilelang.

    Raises:
        AssertionError: naming the versions, the GPU and the fixes.
    """
    fla, triton = release(fla_version), release(triton_version)
    detail = {"fla": fla_version, "triton": triton_version, "hopper": hopper, "tilelang": tilelang, "gpu": seen}
    applies = bool(fla) and fla >= FLA_WITH_RULE and bool(triton) and TRITON_BAD_FROM <= triton < TRITON_FIXED
    if applies and hopper and not tilelang:
        raise AssertionError(
            f"FLA {fla_version} with triton {triton_version} on Hopper ({seen or 'sm90'}) without a usable tilelang: "
            "FLA raises in every backward (gated chunk_bwd_dqkwg gives wrong results with triton >= 3.4.0, < 3.7.1 "
            "on Hopper, FLA issue #640). Fix: triton >= 3.7.1 with a torch that declares it (the FLA 0.5.2 image: "
            "`make image FLA=0.5.2`, docker/requirements-cuda-fla052.lock: torch 2.12.1 + triton 3.7.1), or "
            "`pip install tilelang` with nvcc on PATH (and FLA_TILELANG unset or 1), or FLA 0.4.2 with "
            "triton 3.6.0 (the default image)."
        )
    return detail


def check_fla_supported() -> str:
    from megatron.core.ssm.gdn_context_parallel import check_fla_version

    return check_fla_version()


def check_megatron_import(modules: list[str], tree: Path) -> dict:
    """Import every module the patch touches from the patched tree. A module that cannot import
    only because a package outside Megatron is not in this image (Megatron-Bridge's Qwen3-VL and
    training modules need transformer_engine, which the cpu flavour leaves out) is recorded as
    ``missing_dependency``, not failed; any other failure, or a module found outside the tree,
    fails the check."""
    failed, missing = [], {}
    for mod in modules:
        try:
            loaded = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            if root and root != "megatron":
                missing[mod] = root
            else:
                failed.append(f"{mod}: {type(exc).__name__}: {exc}")
            continue
        except Exception as exc:  # report every module, then fail once
            failed.append(f"{mod}: {type(exc).__name__}: {exc}")
            continue
        where = Path(getattr(loaded, "__file__", "") or "").resolve()
        if tree not in where.parents:
            failed.append(f"{mod}: imported from {where}, not from the patched tree {tree}")
    if failed:
        raise AssertionError("patched modules do not import:\n  " + "\n  ".join(failed))
    if len(missing) == len(modules):
        raise AssertionError(f"no patched module imports: each needs a package not installed ({missing})")
    return {"imported": [m for m in modules if m not in missing], "missing_dependency": missing}


def _gdn_config(mode: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_cp_mode=mode,
    )


def check_linear_cp_mode() -> dict:
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    if "linear_cp_mode" not in fields:
        raise AssertionError("TransformerConfig has no linear_cp_mode field")
    default = fields["linear_cp_mode"].default
    if default != "headwise":
        raise AssertionError(f"linear_cp_mode defaults to {default!r}, not 'headwise'")
    accepted = []
    for mode in MODES:
        try:
            _gdn_config(mode)
        except Exception as exc:
            raise AssertionError(f"TransformerConfig rejects linear_cp_mode={mode!r}: {exc}") from exc
        accepted.append(mode)
    for mode in REJECTED:
        try:
            _gdn_config(mode)
        except (ValueError, AssertionError):
            continue
        raise AssertionError(f"TransformerConfig accepts linear_cp_mode={mode!r}; it must raise ValueError")
    return {"default": default, "accepted": accepted, "rejected": list(REJECTED)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fla-version", required=True)
    parser.add_argument("--triton-version", required=True)
    parser.add_argument("--patch", type=Path, required=True)
    parser.add_argument("--tree", type=Path, default=Path(os.environ.get("GDN_TREE", "/opt/gdn/tree")))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gpu", choices=("auto", "hopper", "none"), default="auto",
                        help="GPU for the fla-hopper rule: auto = the visible one, else Hopper assumed")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    tree = args.tree.resolve()
    if str(tree) not in sys.path:
        sys.path.insert(0, str(tree))

    modules = patched_modules(args.patch.read_text())
    checks = [
        ("versions", lambda: check_versions(args.fla_version, args.triton_version)),
        ("fla-cp", check_fla_cp),
        ("fla-signatures", check_fla_signatures),
        ("fla-hopper", lambda: check_fla_hopper(_version("fla-core"), _version("triton"),
                                                tilelang=tilelang_usable(), **gpu_arch(args.gpu))),
        ("megatron-import", lambda: check_megatron_import(modules, tree)),
        ("fla-supported", check_fla_supported),
        ("linear-cp-mode", check_linear_cp_mode),
    ]
    results, failed = {}, []
    for name, fn in checks:
        try:
            detail = fn()
            results[name] = {"ok": True, "detail": detail}
            print(f"==> [capability:{name}] ok", flush=True)
        except Exception as exc:
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
            print(f"==> [capability:{name}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            if not isinstance(exc, AssertionError):
                traceback.print_exc(limit=-3, file=sys.stdout)
    report = {
        "ok": not failed,
        "failed": failed,
        "checks": results,
        "versions": {d: _version(d) for d in ("torch", "flash-linear-attention", "fla-core", "triton")},
        "python": sys.version.split()[0],
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    if failed:
        print(f"error: [capability] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("==> [capability] all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
