"""The causal-LM loss of both families: transformers' ``ForCausalLMLoss``, computed with the cross-entropy kernel
of :mod:`hf_densessm.ops.cross_entropy` on the CPU.

Same contract as ``transformers.loss.loss_utils.ForCausalLMLoss`` (what ``model.loss_function`` is by default):
labels are shifted inside (position ``t`` predicts label ``t + 1``; ``shift_labels`` may be given instead),
``ignore_index`` (-100) positions do not count, and the summed loss is divided by ``num_items_in_batch`` when
``Trainer`` passes it (gradient accumulation), else by the number of counted positions. One difference: float64
logits stay float64 (transformers casts them to float32), so float64 tests compare exactly.

With gradients on, the logits' gradient is written into the model's ``loss_workspace()``, a buffer kept from the
last step and reused when nothing else holds it (:mod:`hf_densessm.ops.workspace`).

A loss function a user set (``model.loss_function = fn``) and non-CPU logits take ``model.loss_function`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from ..ops.cross_entropy import cross_entropy

__all__ = ["causal_lm_loss"]


def causal_lm_loss(
    model,
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` against ``labels`` (module docstring).

    Args:
        model: the causal LM (its ``loss_function``, ``config.vocab_size`` and ``loss_workspace()``).
        logits: ``(batch, seq_len, vocab_size)`` float32 or float64.
        labels: ``(batch, seq_len)`` token ids, ``ignore_index`` where no loss is wanted.
        num_items_in_batch: divisor of the summed loss (``Trainer``'s, int or 0-dim tensor), or ``None`` (mean).
        ignore_index: label value that does not count.
        shift_labels: ``(batch, seq_len)`` already shifted labels, or ``None``.

    Returns:
        The 0-dim loss in ``logits``' dtype.

    Raises:
        ValueError: a label outside ``[0, vocab_size)`` other than ``ignore_index``.
    """
    loss_function = model.loss_function
    if loss_function is not ForCausalLMLoss or logits.device.type != "cpu":
        return loss_function(
            logits=logits, labels=labels, vocab_size=model.config.vocab_size, num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
        )
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    vocab = model.config.vocab_size
    workspace = model.loss_workspace() if torch.is_grad_enabled() and logits.requires_grad else None
    return cross_entropy(
        logits.reshape(-1, vocab), shift_labels.reshape(-1).to(logits.device), ignore_index, divisor=num_items_in_batch,
        workspace=workspace,
    )
