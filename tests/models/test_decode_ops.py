"""One eager decoding step dispatches a bounded number of operators per block (issue 36, item 4): a count, not a
timing, from ``benchmarks/profile_cpu_decode.py``'s counter (views, and ops that return no tensor, not counted; the
package's ops counted as their bodies' operators). The bounds are the counts of the micro models (m = 2) after the
step lost its layer-invariant terms and unused launches; before it they were 44 (DenseMamba) and 91 (DenseRetNet)
per block. On the CPU with the C++ decoding step (docs/kernels.md, "The C++ CPU kernel"), DenseMamba's state update
and conv step are one operator each: 29 per block (42 with the PyTorch step)."""

import sys
from pathlib import Path

import pytest
import torch

from hf_densessm.ops.dispatch import choose

from helpers import FAMILIES, micro_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from profile_cpu_decode import decode_ops  # noqa: E402

# (per block, outside the blocks: the embedding, the final norm, the head, the terms every block shares)
BOUNDS = {"densemamba": (42, 13), "denseretnet": (61, 36)}
CPP_STEP_BOUNDS = {"densemamba": (29, 13), "denseretnet": (61, 36)}  # the C++ decoding step (DenseMamba's ops)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_ops_per_block(family):
    cpp_step = choose("selective_state_update", torch.device("cpu"), state_size=16, step=True) == "cpp"
    per_block, outside = (CPP_STEP_BOUNDS if cpp_step else BOUNDS)[family]
    counts = decode_ops(micro_model(family))
    ops = [block["ops"] for block in counts["per_block"]]
    assert max(ops) <= per_block, (ops, [block["by_op"] for block in counts["per_block"]])
    assert counts["outside"]["ops"] <= outside, counts["outside"]
    # the shared terms are computed once per forward, whatever the depth
    deeper = decode_ops(micro_model(family, num_hidden_layers=6))
    assert deeper["outside"] == counts["outside"] and deeper["per_block"][:4] == counts["per_block"]
