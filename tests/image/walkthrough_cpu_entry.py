"""torchrun entry for the walkthrough's example on CPU (tests/image/test_image_walkthrough.py).

Runs ``docs/examples/train_gdn_cp.py`` unchanged, with the two CPU stand-ins the rest of the CPU
suite uses: FLA's four entry points computed by ``fla_emulation`` (FLA's kernels are Triton and need a
GPU) and ``torch.cuda.current_device()`` answering "cpu" (``_world.install_cpu_device_shim``: MCore
allocates some collective outputs there). Everything else is the example's own code on the tree first
on ``PYTHONPATH``.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _world import install_cpu_device_shim  # noqa: E402
from fla_emulation import emulated_fla_in_megatron  # noqa: E402

def example_path():
    """``train_gdn_cp.py`` in a checkout (``docs/examples/``) or in the image (``/opt/gdn/examples/``)."""
    for folder in (HERE.parent.parent / "docs" / "examples", HERE.parent.parent / "examples"):
        if (folder / "train_gdn_cp.py").is_file():
            return folder / "train_gdn_cp.py"
    return None


if __name__ == "__main__":
    install_cpu_device_shim()
    example = example_path()
    if example is None:
        sys.exit("walkthrough_cpu_entry: train_gdn_cp.py is neither in docs/examples (a checkout) nor in "
                 "/opt/gdn/examples (the image)")
    sys.argv = [str(example), *sys.argv[1:]]
    with emulated_fla_in_megatron():
        try:
            runpy.run_path(str(example), run_name="__main__")
        except SystemExit as exc:
            sys.exit(exc.code)
