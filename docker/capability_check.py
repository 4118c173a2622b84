"""Dockerfile stage `image`: refuse the build unless the image can run GDN chunkwise CP.

Checks (each one named in the output; any failure exits 1):
  versions        FLA (flash-linear-attention, fla-core) and triton at the pins
  fla-cp          ``from fla.ops.cp import build_cp_context`` imports
  fla-signatures  ``causal_conv1d`` and ``chunk_gated_delta_rule`` take ``cp_context``
  megatron-import every Python module the patch touches imports from the patched tree
  linear-cp-mode  ``TransformerConfig`` accepts exactly headwise/chunkwise/all_gather
                  for a GDN model and rejects ``auto`` and an unknown value

Writes the results, with the torch/FLA/triton versions, as JSON to --out.
Runs on CPU; needs no GPU.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
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


def check_versions(fla_version: str, triton_version: str) -> dict:
    found = {d: _version(d) for d in ("flash-linear-attention", "fla-core", "triton", "torch")}
    want = {"flash-linear-attention": fla_version, "fla-core": fla_version, "triton": triton_version}
    bad = [f"{d}=={found[d]} (want {v})" for d, v in want.items() if found[d] != v]
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


def check_megatron_import(modules: list[str], tree: Path) -> list[str]:
    failed = []
    for mod in modules:
        try:
            loaded = importlib.import_module(mod)
        except Exception as exc:  # report every module, then fail once
            failed.append(f"{mod}: {type(exc).__name__}: {exc}")
            continue
        where = Path(getattr(loaded, "__file__", "") or "").resolve()
        if tree not in where.parents:
            failed.append(f"{mod}: imported from {where}, not from the patched tree {tree}")
    if failed:
        raise AssertionError("patched modules do not import:\n  " + "\n  ".join(failed))
    return modules


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
        ("megatron-import", lambda: check_megatron_import(modules, tree)),
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
