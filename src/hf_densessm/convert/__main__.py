"""Command line of :mod:`hf_densessm.convert` (docs/hub_and_conversion.md, "Command line"):

    python -m hf_densessm.convert mamba SRC OUT [--dense-layers N ...]   # upcycle a transformers Mamba
    python -m hf_densessm.convert official-denseretnet SRC OUT            # the authors' DenseRetNet
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..configuration import DenseMambaConfig
from . import DENSE_ARGUMENTS, densemamba_from_mamba, denseretnet_from_official


def build_parser() -> argparse.ArgumentParser:
    """The ``argparse`` parser of ``python -m hf_densessm.convert`` (commands ``mamba``, ``official-denseretnet``)."""
    parser = argparse.ArgumentParser(prog="python -m hf_densessm.convert", description="Convert a checkpoint into an "
                                     "hf_densessm model and write a Hub-ready folder (weights, config with auto_map, "
                                     "bundled modeling code, model card) that loads with trust_remote_code=True.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mamba = commands.add_parser("mamba", help="upcycle a transformers Mamba checkpoint into DenseMamba (same logits at "
                                "conversion)", description="Upcycle a transformers Mamba checkpoint (e.g. "
                                "state-spaces/mamba-130m-hf) into DenseMamba whose dense gates start closed (the "
                                "Mamba's function); fine-tune it to learn the dense connection.")
    for knob in DenseMambaConfig.knobs():
        default = DenseMambaConfig.dense_defaults.get(knob.name, knob.default)
        option, help_text = "--" + knob.name.replace("_", "-"), f"{knob.help} (default {default})"
        kind = dict(action=argparse.BooleanOptionalAction) if knob.kind is bool else dict(type=knob.kind)
        mamba.add_argument(option, choices=knob.choices, default=None, help=help_text, **kind)

    official = commands.add_parser("official-denseretnet", help="convert a checkpoint of the authors' published "
                                   "DenseRetNet", description="Convert a checkpoint of the authors' published "
                                   "DenseRetNet (their config.json with dense_block_layers and pytorch_model.bin or "
                                   "safetensors weights) into DenseRetNetForCausalLM.")
    for command, what in ((mamba, "the Mamba's"), (official, "the authors'")):
        source = f"folder or Hub repository id with {what} config.json and weights"
        command.add_argument("src", metavar="SRC", help=source)
        command.add_argument("out", metavar="OUT", help="folder to write, kill-safely (files of an existing OUT "
                             "that the save does not own are kept)")
        command.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                             help="dtype of the saved weights (default float32)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status (0 on success, 1 when
    the conversion fails, with the error on stderr and OUT untouched; 2 for bad arguments, from argparse)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mamba":
            knobs = {name: getattr(args, name) for name in DENSE_ARGUMENTS if getattr(args, name) is not None}
            model = densemamba_from_mamba(args.src, **knobs)
        else:
            model = denseretnet_from_official(args.src)
        model.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    except (OSError, ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {type(model).__name__}, {model.num_parameters() / 1e6:.2f}M parameters, "
          f"{model.config.num_hidden_layers} layers, dense_layers={model.config.dense_layers}, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
