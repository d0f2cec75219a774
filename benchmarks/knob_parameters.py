"""Parameter cost of each dense knob at the paper's 350M sizes (DenseSSM paper Tables 5, 7, 8, 9 compare models "with
parameter adjustments" at nearly equal size), and the gate widths that bring an ablation back to the default's
budget. Models are built on the meta device: nothing is allocated, it runs in seconds.

    python benchmarks/knob_parameters.py            # markdown table on stdout
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

import hf_densessm  # noqa: F401  (registers the models)
from hf_densessm import DenseMambaConfig, DenseRetNetConfig

ROWS = [
    ("base (dense_layers=0)", dict(dense_layers=0)),
    ("default", dict()),
    ("dense_layers=1", dict(dense_layers=1)),
    ("dense_layers=4", dict(dense_layers=4)),
    ('dense_selection="linear"', dict(dense_selection="linear")),
    ('dense_selection="none"', dict(dense_selection="none")),
    ('dense_projection="linear"', dict(dense_projection="linear")),
    ("dense_shared_gate=False", dict(dense_shared_gate=False)),
    ('dense_fusion="concat"', dict(dense_fusion="concat")),
    ("dense_every=2", dict(dense_every=2)),
]
FAMILIES = {
    "denseretnet-350m": (DenseRetNetConfig, []),
    "densemamba-360m": (DenseMambaConfig, [('dense_target="state"', dict(dense_target="state"))]),
}


def count(config_class, preset: str, **overrides) -> int:
    """Parameters of ``preset`` with ``overrides`` (tied weights counted once)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_class.from_preset(preset, **overrides))
    return model.num_parameters()


def matched_gate_width(config_class, preset: str, target: int, **overrides) -> int | None:
    """The ``dense_gate_hidden_size`` whose model is closest to ``target`` parameters with ``overrides``, or
    ``None`` when even width 1 is above it (the knob's own cost is not in the gates)."""
    lo, hi = 1, 4096
    if count(config_class, preset, dense_gate_hidden_size=lo, **overrides) > target:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(config_class, preset, dense_gate_hidden_size=mid, **overrides) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for preset, (config_class, extra) in FAMILIES.items():
        default = count(config_class, preset)
        base = count(config_class, preset, dense_layers=0)
        print(f"\n### {preset}\n")
        print("| knobs | parameters | vs default | dense_gate_hidden_size for the default's budget |")
        print("|---|---|---|---|")
        for label, overrides in ROWS + extra:
            n = count(config_class, preset, **overrides)
            if overrides.get("dense_layers") == 0 or overrides.get("dense_selection") == "none":
                shown = "— (no gate)"
            else:
                matched = matched_gate_width(config_class, preset, default, **overrides)
                shown = "none: over budget at width 1" if matched is None else str(matched)
            print(f"| {label} | {n / 1e6:.2f}M | {(n - default) / 1e6:+.2f}M | {shown} |")
        print(f"\n(base {base / 1e6:.2f}M; default gate width {config_class.from_preset(preset).dense_gate_hidden_size})")


if __name__ == "__main__":
    main()
