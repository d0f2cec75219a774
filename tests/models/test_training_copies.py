"""An eager training step copies no activation (issue 35, item 3): no ``clone``, ``copy_`` or ``_to_copy`` of a tensor
the size of a layer's activations anywhere in the model's forward and backward, outside the ops' own inputs (the
ops' bodies are opaque to the dispatch mode; their copies are counted by tests/ops/test_retention.py and
tests/ops/test_selective_scan_cpu_kernel.py)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import FAMILIES, micro_model, random_ids

COPIES = (torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.copy_)


class _Copies(TorchDispatchMode):
    """Records ``(op, shape)`` of every copy of a tensor of at least ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in COPIES and args[0].numel() >= self.numel:
            self.seen.append((func.overloadpacket.__name__, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [64, 100], ids=["whole-chunks", "remainder"])
def test_an_eager_training_step_copies_no_activation(family, length):
    """Hidden size 64, 2 heads (DenseRetNet's value dim 128: each head's q/k/v a strided slice of the projections),
    the dense connection on; any copy of at least one ``(batch, length, hidden_size)`` tensor's elements is
    reported. Before issue 35's fix DenseRetNet copied the retention output (forward) and gradients (backward) in
    every layer."""
    model = micro_model(family, hidden_size=64, **({"query_key_dim": 32} if family == "denseretnet" else {})).train()
    ids = random_ids(2, length)
    copies = _Copies(ids.numel() * model.config.hidden_size)
    with copies:
        model(ids, labels=ids).loss.backward()
    assert copies.seen == [], copies.seen
