"""The image pipeline's errors (exit codes 9-14): subclasses of :class:`backport.errors.PipelineError`,
each with an exit code and a hint that says what to do next."""

from __future__ import annotations

from typing import Optional

from backport.errors import PipelineError


class ImageError(PipelineError):
    """Building or gating the image failed."""

    exit_code = 9
    default_hint = "Read the log tail above; `make image` rebuilds from the verified patch."


class DockerUnavailable(ImageError):
    """No Docker Engine answers (not installed, not started, no permission)."""

    exit_code = 10
    default_hint = "Start one with `sudo tools/dockerd-up`, then run the same command again."


class DiskSpaceError(ImageError):
    """Too little free disk under Docker's root for the build (see :data:`MIN_FREE_GIB`)."""

    exit_code = 11
    default_hint = ("Free space (e.g. remove old images: `tools/image prune`), or lower the "
                    "floor with --min-free-gb, then run the same command again.")


class GateFailed(ImageError):
    """The image's regression suite failed, errored, or ran no test."""

    exit_code = 12
    default_hint = ("Fix the failing tests named above, then run `make gate` again (it rebuilds the "
                    "image from the verified patch first).")


class InputError(ImageError):
    """A build input is missing or disagrees with another (tree, patch, manifest, lock, wheel)."""

    exit_code = 13
    default_hint = "Run `tools/backport --upstream 5139086e` to write the tree and patch, then `make image`."


class TreeDrift(InputError):
    """The pristine or patched tree is not the one ``manifests/lock.json`` records (exit 13).

    Raised before a build (the context's pristine tree), from a build step (``base-tree``,
    ``patched-tree``, or a hunk that applies only at an offset), and by the gate (the digest
    computed inside the image). The message names the first differing file.
    """

    default_hint = ("Rebuild the trees and the patch with `tools/backport --upstream 5139086e` "
                    "(it rewrites build/tree/ and patches/latest/), then `make image`. If the lock is the "
                    "stale one, regenerate it the same way.")


class BaseImageMissing(ImageError):
    """The base image is not local and cannot be pulled (no registry reachable)."""

    exit_code = 14
    default_hint = ("Where a registry is reachable, add --pull (`make image IMAGE_ARGS=--pull`); "
                    "elsewhere load the base first (`docker load`), or build the cpu flavour: "
                    "`make image IMAGE_FLAVOUR=cpu`.")


#: Hint of a pull that failed although --pull was given (the default hint says to add it).
PULL_FAILED_HINT = ("The pull itself failed: check that this machine reaches the registry (for nvcr.io also "
                    "`docker login nvcr.io`) and that the tag exists, then run the same command again; or load "
                    "the base from a file (`docker load -i FILE`), or build the cpu flavour: "
                    "`make image IMAGE_FLAVOUR=cpu`.")


class BuildStepFailed(ImageError):
    """A Dockerfile step failed; carries the step and the tail of its log."""

    exit_code = 9

    def __init__(self, step: str, detail: str, tail: list[str], hint: Optional[str] = None):
        self.step = step
        self.detail = detail
        self.tail = list(tail)
        text = f"image build failed at step {step}: {detail}\n--- last {len(self.tail)} log lines:\n"
        text += "\n".join(f"  | {t}" for t in self.tail)
        super().__init__(text, hint or hint_for_step(step))


def hint_for_step(step: str) -> str:
    """What to do when ``step`` (a script marker such as ``patch-apply``) fails."""
    hints = {
        "deps": "The locked Python packages did not install. If a hash or pin changed, "
                "regenerate the lock with `tools/image lock`, then `make image`.",
        "patch-digest": "The patch in the context is not the one the manifest describes; "
                        "regenerate with `tools/backport --upstream 5139086e`, then `make image`.",
        "patch-apply": "The patch does not apply to the pinned tree with zero fuzz. Regenerate it "
                       "against build/tree/base with `tools/backport --upstream 5139086e`, then `make image`.",
        "leftovers": "The patch left .rej/.orig files; regenerate it with `tools/backport`, then `make image`.",
        "conflict-markers": "Remove the conflict markers from the recipe's output "
                            "(`tools/backport`), then `make image`.",
        "byte-compile": "A patched file has a syntax error; fix the recipe step that writes it, "
                        "re-run `tools/backport`, then `make image`.",
        "capability": "The image cannot run GDN chunkwise CP. Check the pins in "
                      "docker/requirements.in (flash-linear-attention==0.4.2, fla-core==0.4.2, "
                      "triton==3.6.0), run `tools/image lock`, then `make image`.",
    }
    for key, hint in hints.items():
        if step.startswith(key):
            return hint
    return "Read the log tail above, fix its cause, then run `make image` again."
