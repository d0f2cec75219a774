"""Test-wide set-up.

Without a GPU, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, numpy emulation on the CPU).
Triton reads the variable when a kernel is defined, so it is set here, before any test module imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    """Register the marks that transformers' own test mixins put on their tests
    (``tests/models/test_transformers_common.py`` runs them), so that pytest does not warn of unknown marks."""
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test",
                 "slow", "is_training_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' own test mixins")
