"""The paper's training settings for its presets (docs/design.md §7). Outside ``configuration/`` so that a saved
checkpoint's bundled code carries its own family's config module only."""

from __future__ import annotations

from .configuration.configuration_densemamba import DENSEMAMBA_PAPER_TRAINING
from .configuration.configuration_densessm import resolve_preset
from .configuration.configuration_denseretnet import DENSERETNET_PAPER_TRAINING

__all__ = ["paper_training_arguments"]


def paper_training_arguments(preset: str) -> dict:
    """The paper's training settings for a paper preset, as keywords of ``transformers.TrainingArguments``:
    ``learning_rate``, ``adam_beta1``, ``adam_beta2`` (Tables 2 and 3) and :data:`PAPER_OPTIMIZER` (§4.2).

    ``TrainingArguments(output_dir, **paper_training_arguments("densemamba-360m"), ...)``; the paper's batch of
    0.5M tokens at length 2048 is ``per_device_train_batch_size * gradient_accumulation_steps * processes = 256``.

    Raises:
        ValueError: ``preset`` is not one of the paper's presets (the message lists them).
    """
    return resolve_preset({**DENSEMAMBA_PAPER_TRAINING, **DENSERETNET_PAPER_TRAINING}, preset, "paper-trained")
