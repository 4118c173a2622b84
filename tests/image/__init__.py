"""Image regression suite (a package so its conftest does not shadow other test dirs)."""
