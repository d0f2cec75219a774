"""Test-wide set-up.

Without a GPU, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, numpy emulation on the CPU).
Triton reads the variable when a kernel is defined, so it is set here, before any test module imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
