"""`mxflux train` with the Triton AdamW step on the CPU (Triton's interpreter), for
tests/gpu/test_adamw_fsdp.py: as one process, or under torchrun on FSDP2 shards.

    TRITON_INTERPRET=1 python tests/adamw_train_worker.py ARGS...                       # one process
    TRITON_INTERPRET=1 python -m torch.distributed.run --nproc_per_node 2 tests/adamw_train_worker.py ARGS...

ARGS are `mxflux train`'s. The step's kernels are let run on CPU tensors (the interpreter), and every
parameter of at least 1024 elements (instead of 65,536) goes through our kernel, so that the tiny
model's weights do.
"""

from __future__ import annotations

import sys

from mxflux.cli import main
from mxflux.train import adamw_cuda

import triton_interpreter_fix  # beside this script: numpy 2.4 under Triton 3.6's interpreter

triton_interpreter_fix.apply()

if __name__ == "__main__":
    adamw_cuda.on_kernel_device = lambda t: t.device.type == "cpu"
    adamw_cuda.LARGE = 1024
    sys.exit(main(["train", *sys.argv[1:]]))
