"""The forms the one-token decoding steps compute in: one-row products (:func:`decode_linear`) and values derived
from parameters, kept between steps (:func:`cached_from_parameters`). Used by both families' decoding steps and the
dense connection's gates; every form computes what the module computes, to the dtype's rounding
(``tests/test_decode_speed_paths.py``, ``tests/test_compile_decode_step.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["SMALL_WEIGHT_NUMEL", "cached_from_parameters", "decode_linear"]


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is exactly an ``nn.Linear`` whose call would run nothing but ``F.linear``: no subclass
    or wrapper (a LoRA layer, a quantized layer), no hooks of its own or global ones, no replaced ``forward``
    (accelerate's offloading hooks)."""
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
        and not _module._global_forward_hooks
        and not _module._global_forward_pre_hooks
    )


#: Weights up to this many elements are multiplied in float32 in a 16-bit decoding step (:func:`decode_linear`).
SMALL_WEIGHT_NUMEL = 1 << 18


def decode_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for the few rows of one decoding step, in the fastest form for that shape on the CPU.

    In bfloat16 (and float16) the CPU's general matrix-matrix path, which ``F.linear`` takes, is slow for a few
    rows (measured on the 2-core AVX-512 / AMX Xeon here, one thread, one row: the 32000 x 512 LM head 2.3 ms with
    ``F.linear``, 1.5 ms with ``torch.mv``; the 2048 x 512 ``in_proj`` 146 us against 86 us; a 64 x 1024
    ``x_proj`` 26 us in bfloat16, 6 us in float32; eight rows: ``W @ x^T`` 1.6 ms against 2.5 ms for the LM head).
    So for a plain ``nn.Linear`` (:func:`_plain_linear`) in a 16-bit dtype on a CPU, without gradients:

    - a weight of at most :data:`SMALL_WEIGHT_NUMEL` elements is applied in float32, from a float32 copy kept while
      the weight is unchanged (:func:`cached_from_parameters`; at most 1 MiB per weight);
    - a larger weight: ``torch.mv`` / ``torch.addmv`` for one row, ``W @ x^T`` (``torch.addmm`` with a bias) for
      several.

    While ``torch.compile`` traces a step (:meth:`~hf_densessm.modeling.modeling_densessm.DenseSSMCausalLMMixin.compile_decode_step`),
    a weight of at most :data:`SMALL_WEIGHT_NUMEL` elements, in any dtype, is applied as a product and a sum over
    ``in`` in float32 (float64 for float64) instead: the compiler fuses that into the surrounding loops, where a
    matrix-product call costs 10-30 us per small layer (measured: the dense gates' 512 x 16 and 16 x 1024 layers,
    0.8 ms of a DenseMamba-30M step); larger weights keep the forms above.

    Every form accumulates in float32 and rounds the output once, as ``F.linear`` does, so they agree with it to the
    dtype's rounding. Everything else (float32 and float64, where ``F.linear`` is as fast; CUDA; a LoRA or otherwise
    wrapped layer; gradients) calls the module.

    Args:
        module: the layer (usually an ``nn.Linear`` with ``weight (out, in)``, optional ``bias (out,)``).
        x: ``(rows, in)`` (``(..., in)`` also taken; only the compiled form and the module call use the extra
            dimensions), the layer's dtype.

    Returns:
        ``(rows, out)`` contiguous, in ``x``'s dtype, as ``module(x)``.
    """
    if torch.is_grad_enabled() or not _plain_linear(module) or module.weight.dtype != x.dtype:
        return module(x)
    weight, bias = module.weight, module.bias
    if torch.compiler.is_compiling() and weight.numel() <= SMALL_WEIGHT_NUMEL and x.device.type == "cpu":
        acc = torch.promote_types(x.dtype, torch.float32)
        out = (x.to(acc)[..., None, :] * weight.to(acc)).sum(-1)
        return (out if bias is None else out + bias.to(acc)).to(x.dtype)
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.device.type != "cpu":
        return module(x)
    if weight.numel() <= SMALL_WEIGHT_NUMEL:
        weight32 = cached_from_parameters(module, "weight_float32", weight.float, weight)
        bias32 = None if bias is None else cached_from_parameters(module, "bias_float32", bias.float, bias)
        return F.linear(x.float(), weight32, bias32).to(x.dtype)
    if x.shape[0] == 1:
        out = torch.mv(weight, x[0]) if bias is None else torch.addmv(bias, weight, x[0])
        return out[None]
    out = weight @ x.t() if bias is None else torch.addmm(bias[:, None], weight, x.t())
    return out.t().contiguous()


def cached_from_parameters(owner: nn.Module, name: str, build, *tensors: torch.Tensor) -> torch.Tensor:
    """``build()``, computed once and kept on ``owner`` until one of ``tensors`` (the parameters it is derived from)
    changes: another storage, dtype, device or shape, or an in-place update (every optimizer step, ``copy_``,
    ``load_state_dict`` bumps a tensor's version counter). Used by the decoding steps for values that depend only
    on parameters (e.g. Mamba's ``A = -exp(A_log)``), and only without gradients, so no autograd graph is cut.

    Args:
        owner: the module that keeps the value (in ``owner._decode_derived``, not a parameter or a buffer: never
            saved, never moved by ``.to()``; the key makes a moved or cast parameter rebuild it).
        name: the value's name on ``owner``.
        build: a function of no arguments returning the tensor.
        tensors: the parameters the value is computed from.

    Returns:
        The tensor ``build()`` returns (the kept one while the parameters are unchanged). Parameters that are
        inference tensors (cast or created under ``torch.inference_mode``) keep no version counter, so an in-place
        update of them could not be seen: for them ``build()`` runs on every call and nothing is kept.
    """
    if torch.compiler.is_compiling() or any(t.is_inference() for t in tensors):
        return build()
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device, t.shape) for t in tensors)
    store = owner.__dict__.setdefault("_decode_derived", {})
    entry = store.get(name)
    if entry is None or entry[0] != key:
        entry = store[name] = (key, build())
    return entry[1]
