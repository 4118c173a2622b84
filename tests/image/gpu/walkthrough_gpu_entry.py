"""torchrun entry for the walkthrough's example on one GPU (ranks share it over gloo).

NCCL refuses two ranks on one GPU, so a CP=2 world on a one-GPU host runs over gloo; FLA 0.4.2's CP
all-gather then needs the flat output view of ``tests/image/fla_gloo.py`` (installed here, after the
process group exists). Otherwise ``docs/examples/train_gdn_cp.py`` runs unchanged, with the real FLA
kernels on the GPU. With one GPU per rank, run the example itself (NCCL), as the walkthrough does.
Where torch sees no GPU it refuses with exit 2 and one ``error:``/``hint:`` pair (it divided by the
GPU count before).
"""

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:  # refuse before any process group: a host without a GPU is not this entry's
        print("error: walkthrough_gpu_entry.py needs a CUDA GPU, and torch sees none here "
              f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})\n"
              "hint: Run it on a GPU host (docs/train-with-the-image.md, \"What has run on a GPU\"), or run the "
              "CPU walkthrough instead: tests/image/walkthrough_cpu_entry.py.", file=sys.stderr)
        sys.exit(2)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    dist.init_process_group("gloo")
    import fla_gloo

    fla_gloo.install()
    from walkthrough_cpu_entry import example_path

    example = example_path()
    sys.argv = [str(example), *sys.argv[1:]]
    try:
        runpy.run_path(str(example), run_name="__main__")
    except SystemExit as exc:
        sys.exit(exc.code)
