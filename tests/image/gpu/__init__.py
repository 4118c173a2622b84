"""GPU part of the image regression suite (run with tools/gpu-suite)."""
