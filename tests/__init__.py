"""Makes tests/image import as ``tests.image`` under pytest, not as a top-level ``image`` that would
shadow the image pipeline package (``image/``) when one session collects tests/image and tests/unit."""
