"""The image pipeline: build and gate the training image through docker-py (no docker CLI).

Functions return data and report progress through an ``on_line`` callback; :mod:`image_pipeline.cli`
(``tools/image``) prints. Errors are :class:`image_pipeline.errors.ImageError` subclasses, each with an
exit code and a hint that says what to do next.

One module per stage of ``make image`` / ``make gate``::

    inputs.preflight()          inputs present, manifest agrees with the patch, trees are the lock's
    engine.docker_client()      the engine answers (else: run tools/dockerd-up)
    engine.check_disk()         enough free disk under Docker's root, by storage driver
    engine.ensure_base_image()  cpu flavour: debootstrap bookworm + import (once)
    build.stage_context()       build/image/context-<flavour>/ (tree, patch, suite, locks, wheel)
    build.build_image()         streamed classic build; a failing step -> BuildStepFailed
    gate.run_gate()             the suite inside the image -> JUnit XML -> verdict -> report

:mod:`image_pipeline.lock` writes and checks the requirements locks (``tools/image lock``,
``check-lock``); :mod:`image_pipeline.errors` holds the error classes and their exit codes.
"""
