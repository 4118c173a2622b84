"""The declarative recipe (YAML in ``manifests/``), validated with pydantic.

Unknown keys and missing fields are errors. :func:`check_coverage` proves that every hunk
of the upstream commit is taken verbatim, adapted, or excluded with a reason, exactly once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import RecipeError

Sha = Annotated[str, Field(pattern=r"^[0-9a-f]{40}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Pins(_Strict):
    """Full SHAs of every input."""

    megatron_bridge: Sha
    mcore_base: Sha
    upstream: Sha
    upstream_ref: str = Field(description="human reference, e.g. NVIDIA/Megatron-LM#3282 (dev)")
    commits_between: int = Field(ge=0, description="expected len(base..upstream)")


def _tree_path(value: str) -> str:
    """A recipe path must stay inside the tree root (relative, no '..', no backslash) and be
    written in normal form (one spelling per file)."""
    import posixpath

    if (not value or value.startswith("/") or "\\" in value or "\0" in value
            or any(part == ".." for part in value.split("/")) or posixpath.normpath(value) in (".", "")):
        raise ValueError(f"path {value!r} leaves the tree root (absolute, '..', or empty); "
                         "recipe paths are relative to the tree root, e.g. megatron/core/...")
    if posixpath.normpath(value) != value:
        raise ValueError(f"path {value!r} is not in normal form (no './', '//' or trailing '/'): "
                         f"write {posixpath.normpath(value)!r}")
    return value


TreePath = Annotated[str, AfterValidator(_tree_path)]


def _template_name(value: str) -> str:
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(f"template {value!r} must be a file name inside backport/adaptations/")
    return value


class BeyondUpstream(_Strict):
    """One thing a step does that upstream (at the recipe's upstream commit) does not: a fix or
    an adaptation of ours, listed in the manifest's "beyond upstream" table with its effect."""

    what: str = Field(min_length=10, description="what the step adds, in a phrase")
    why: str = Field(min_length=10, description="why it is needed or worth it")
    effect: str = Field(min_length=3, description="the measured effect, or the fault it prevents")
    evidence: str = Field(default="", description="where the figure comes from (a results/ folder)")


class _Step(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    why: str = Field(min_length=10)
    beyond_upstream: list[BeyondUpstream] = Field(
        default_factory=list, description="what this step adds beyond upstream, one entry per item")

    @field_validator("why")
    @classmethod
    def _reason_is_whole(cls, why: str) -> str:
        return lint_reason(why)


REASON_WORDS = 4


def lint_reason(why: str) -> str:
    """A reason must say why in words: not empty, at least four words.

    Raises:
        ValueError: the reason is empty or too short to be a reason.
    """
    text = why.strip()
    if len(text.split()) < REASON_WORDS:
        raise ValueError(f"reason {text!r} is shorter than {REASON_WORDS} words; say why in a sentence")
    return why


def lint_yaml_reasons(text: str) -> list[str]:
    """Reasons cut short by YAML itself: a plain (unquoted) ``why`` scalar followed by a `` #``.

    ``why: belong to PR #5664 (...)`` parses as ``belong to PR``, and so does a plain scalar
    continued on the next line where that line holds `` #``. Found with PyYAML's scanner: the
    text between the end of a plain ``why`` value and the end of its line must be empty.
    Returns ``"line N: ..."`` descriptions, empty when every reason is whole (or the YAML does
    not scan: the parser then reports it).
    """
    lines = text.splitlines()
    found = []
    try:
        tokens = list(yaml.scan(text))
    except yaml.YAMLError:
        return []
    for i, tok in enumerate(tokens[:-2]):
        if not (isinstance(tok, yaml.KeyToken) and isinstance(tokens[i + 1], yaml.ScalarToken)
                and tokens[i + 1].value == "why" and isinstance(tokens[i + 2], yaml.ValueToken)):
            continue
        value = tokens[i + 3] if i + 3 < len(tokens) else None
        if not isinstance(value, yaml.ScalarToken) or value.style is not None:
            continue  # quoted or block scalars keep their '#'
        end = value.end_mark
        rest = lines[end.line][end.column:] if end.line < len(lines) else ""
        if rest.lstrip().startswith("#"):
            found.append(f"line {end.line + 1}: {lines[end.line].strip()[:80]}")
    return found


class UpstreamFile(_Step):
    """Take a whole file of the upstream commit, byte for byte."""

    kind: Literal["upstream_file"]
    path: TreePath
    hunks: list[str] = Field(min_length=1)


class UpstreamHunks(_Step):
    """Apply listed hunks of the upstream commit verbatim (zero fuzz; offsets recorded)."""

    kind: Literal["upstream_hunks"]
    hunks: list[str] = Field(min_length=1)


class Transplant(_Step):
    """Copy named top-level symbols from another upstream commit (a prerequisite)."""

    kind: Literal["transplant"]
    commit: Sha
    path: TreePath
    symbols: list[str] = Field(min_length=1)
    upstream_ref: str


class AddFile(_Step):
    """Add one of our own modules (``backport/adaptations/<template>``) to the tree."""

    kind: Literal["add_file"]
    path: TreePath
    template: Annotated[str, AfterValidator(_template_name)]
    adapts: list[str] = Field(default_factory=list)


class Transform(_Step):
    """Run a named transform of ours (``backport.transforms``) on one file."""

    kind: Literal["adaptation", "fix"]
    path: TreePath
    transform: str
    adapts: list[str] = Field(default_factory=list)
    source: str = Field(default="", description="kind fix: the downstream patch the preserved fix comes from "
                                                "(shown in the manifest; 'not given' when empty)")


Step = Annotated[Union[UpstreamFile, UpstreamHunks, Transplant, AddFile, Transform], Field(discriminator="kind")]


class Exclusion(_Step):
    """Upstream hunks deliberately left out, with the reason."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    hunks: list[str] = Field(min_length=1)


class Superseded(_Strict):
    """A hunk of a carried patch that a recipe step makes unnecessary, with the reason.

    The step's new code wins where it conflicts with the hunk; ``carry_survival`` skips the
    hunk; the manifest records ``superseded`` with ``step`` and ``why``.
    """

    hunk: str = Field(pattern=r"^carry:.+#[0-9]+$", description="carried hunk id, carry:<path>#<n>")
    step: str = Field(description="id of the recipe step that supersedes it")
    why: str = Field(min_length=10)


class Recipe(_Strict):
    """A whole recipe file."""

    schema_version: Literal[1]
    name: str
    pins: Pins
    steps: list[Step] = Field(min_length=1)
    excluded: list[Exclusion]
    forbidden_strings: list[str]
    import_check: list[str] = Field(description="modules the verify step imports")
    superseded: list[Superseded] = Field(default_factory=list,
                                         description="carried hunks a step makes unnecessary, with the reason")

    @field_validator("steps")
    @classmethod
    def _unique_step_ids(cls, steps):
        return _unique(steps, "step")

    @model_validator(mode="after")
    def _superseded_steps_exist(self):
        ids = {s.id for s in self.steps}
        for sup in self.superseded:
            if sup.step not in ids:
                raise ValueError(f"superseded {sup.hunk}: step {sup.step!r} is not a step of this recipe")
        if len({s.hunk for s in self.superseded}) != len(self.superseded):
            raise ValueError("a carried hunk is declared superseded twice")
        return self

    @field_validator("excluded")
    @classmethod
    def _unique_exclusion_ids(cls, excluded):
        return _unique(excluded, "exclusion")


def _unique(items, what: str):
    seen = set()
    for item in items:
        if item.id in seen:
            raise ValueError(f"duplicate {what} id {item.id!r}")
        seen.add(item.id)
    return items


def load_recipe(path: Path) -> tuple[Recipe, str]:
    """Parse and validate ``path``; return the recipe and the sha256 of its bytes.

    Raises:
        RecipeError: unreadable YAML, unknown keys, missing or invalid fields.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc.strerror}", hint="Pass --recipe with an existing file.") from exc
    cut = lint_yaml_reasons(raw.decode("utf-8", errors="replace"))
    if cut:
        raise RecipeError(f"recipe {path}: a reason is cut short by an unquoted ' #' (YAML reads the rest as a "
                          f"comment): {'; '.join(cut)}", hint="Put that reason in double quotes and re-run.")
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from exc
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise RecipeError(f"recipe {path} is invalid: {problems}") from exc
    return recipe, hashlib.sha256(raw).hexdigest()


def hunk_dispositions(recipe: Recipe) -> dict[str, list[tuple[str, str]]]:
    """Map upstream hunk id -> [(disposition, step or exclusion id)] as the recipe declares."""
    out: dict[str, list[tuple[str, str]]] = {}
    for step in recipe.steps:
        if isinstance(step, (UpstreamFile, UpstreamHunks)):
            for hid in step.hunks:
                out.setdefault(hid, []).append(("verbatim", step.id))
        elif isinstance(step, (Transform, AddFile)):
            for hid in step.adapts:
                out.setdefault(hid, []).append(("adapted", step.id))
    for excl in recipe.excluded:
        for hid in excl.hunks:
            out.setdefault(hid, []).append(("excluded", excl.id))
    return out


def check_coverage(recipe: Recipe, upstream_ids: list[str]) -> dict[str, tuple[str, str]]:
    """Every upstream hunk must have exactly one disposition; no unknown ids.

    Returns:
        upstream hunk id -> (disposition, step/exclusion id).

    Raises:
        RecipeError: listing missing, duplicated and unknown hunk ids.
    """
    declared = hunk_dispositions(recipe)
    known = set(upstream_ids)
    missing = [h for h in upstream_ids if h not in declared]
    dup = sorted(h for h, d in declared.items() if len(d) > 1)
    unknown = sorted(h for h in declared if h not in known)
    if missing or dup or unknown:
        parts = []
        if missing:
            parts.append(f"not accounted for: {', '.join(missing)}")
        if dup:
            parts.append(f"listed more than once: {', '.join(dup)}")
        if unknown:
            parts.append(f"not in the upstream commit: {', '.join(unknown)}")
        raise RecipeError(
            "recipe does not account for the upstream commit exactly once per hunk: " + "; ".join(parts),
            hint="Run `tools/backport --list-hunks` to list the upstream hunk ids, then take, adapt or exclude each.",
        )
    return {h: declared[h][0] for h in upstream_ids}


# --- references --------------------------------------------------------------------------------
#: Beside a recipe ``<name>.yaml``, ``<name>.references.yaml`` says where every reference its reasons
#: cite resolves (decisions, RFC sections, images, pull requests, evidence folders); optional.
REFERENCES_SUFFIX = ".references.yaml"


class Reference(_Strict):
    """One kind of citation and where it resolves."""

    cites: str = Field(min_length=1, description="the citation as the recipe writes it, e.g. 'decision N'")
    pattern: str = Field(min_length=1, description="regular expression matching every such citation")
    target: str = Field(min_length=1, description="a path in this repository (optionally #anchor) or an https:// URL")
    what: str = Field(min_length=1, description="what the reader finds there")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        import re

        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from exc
        return value

    @field_validator("target")
    @classmethod
    def _where(cls, value: str) -> str:
        if value.startswith(("https://", "http://")):
            return value
        path = value.split("#", 1)[0]
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise ValueError("a target is a repository-relative path (optionally #anchor) or an https:// URL")
        return value


class References(_Strict):
    """``<recipe>.references.yaml``."""

    schema_version: Literal[1]
    references: list[Reference] = Field(min_length=1)


def references_path(recipe_path: Path) -> Path:
    """Where the references of ``recipe_path`` live (``<stem>.references.yaml`` beside it)."""
    return recipe_path.with_name(recipe_path.stem + REFERENCES_SUFFIX)


def load_references(recipe_path: Path) -> "list[dict] | None":
    """The references of the recipe at ``recipe_path`` as plain dicts (for the manifest), or None
    when the recipe has no references file.

    Raises:
        RecipeError: the file is unreadable, not YAML, or does not follow :class:`References`.
    """
    path = references_path(recipe_path)
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_bytes())
        refs = References.model_validate(data)
    except OSError as exc:
        raise RecipeError(f"cannot read the recipe's references {path}: {exc.strerror}",
                          hint="Make the file readable, or remove it (the manifest then has no references).") from exc
    except yaml.YAMLError as exc:
        raise RecipeError(f"the recipe's references {path} are not valid YAML: {exc}",
                          hint="Fix the YAML and run again.") from exc
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise RecipeError(f"the recipe's references {path} are invalid: {problems}",
                          hint="Each entry needs cites, pattern (a regular expression), target (a repository "
                               "path or an https:// URL) and what; see manifests/README.md.") from exc
    return [r.model_dump() for r in refs.references]
