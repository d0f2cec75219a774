"""What DenseMamba and DenseRetNet share above the block: input checks, the backbone's forward body (embedding,
cache set-up, the densely connected layers, the final norm), the causal-LM head and the generation glue. Written
once, used by both families; the dense connection itself is :mod:`.dense_connection`, the cache :mod:`.cache`.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
import weakref

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.utils import logging

from ..ops.workspace import Workspace, linear_into
from .cache import check_cache, is_filled, model_output, new_cache, output_cache, record_tokens, takes_cache
from .decode import _plain_linear, decode_linear
from .dense_connection import run_dense_layers
from .loss import causal_lm_loss


logger = logging.get_logger(__name__)

_ID_DTYPES = (torch.int64, torch.int32)


def check_inputs(
    input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int
) -> None:
    """Check the model's token inputs at ``forward`` entry.

    Raises:
        ValueError: both or neither of ``input_ids`` and ``inputs_embeds`` are given; ``input_ids`` is not
            ``(batch, sequence_length)`` with ``batch, sequence_length >= 1``; ``inputs_embeds`` is not
            ``(batch, sequence_length, hidden_size)`` with ``batch, sequence_length >= 1``.
        TypeError: ``input_ids`` is not an int64 / int32 tensor (what ``nn.Embedding`` takes), or ``inputs_embeds``
            is not a floating-point tensor.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in _ID_DTYPES:
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"`input_ids` must be an int64 or int32 tensor, got {got}.")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(
                "`input_ids` must have shape (batch, sequence_length) with batch >= 1 and sequence_length >= 1, "
                f"got {tuple(input_ids.shape)}."
            )
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.dtype.is_floating_point:
            got = inputs_embeds.dtype if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
            raise TypeError(f"`inputs_embeds` must be a floating-point tensor, got {got}.")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or 0 in inputs_embeds.shape[:2]:
            raise ValueError(
                f"`inputs_embeds` must have shape (batch, sequence_length, {hidden_size}) with batch >= 1 and "
                f"sequence_length >= 1, got {tuple(inputs_embeds.shape)}."
            )


def prepare_attention_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor | None:
    """Return the ``(batch, seq_len)`` 0/1 mask of the current tokens, or ``None`` when nothing is padded.

    ``attention_mask`` may also cover earlier (cached) tokens, as ``generate()`` passes it: ``(batch, past + seq_len)``;
    only its last ``seq_len`` columns are used. 0 marks padding, which never enters a recurrent state.

    Raises:
        TypeError: ``attention_mask`` is not a tensor.
        ValueError: it is not 2-D, its batch differs, it is shorter than the input, or it holds a value other than
            0 and 1 (bool, integer or float masks are accepted).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"`attention_mask` must be a tensor of 0 and 1, got {type(attention_mask).__name__}.")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_len:
        raise ValueError(
            f"`attention_mask` must have shape (batch, sequence_length) = ({batch}, >= {seq_len}) with 1 for tokens "
            f"and 0 for padding, got {tuple(attention_mask.shape)}."
        )
    attention_mask = attention_mask[:, -seq_len:]
    if bool((attention_mask == 1).all()):  # the common case (every decoding step): one check, nothing padded
        return None
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (token); got other values.")
    if bool(attention_mask.all()):
        return None
    return attention_mask


PACKING_KEYS = ("cu_seq_lens_q", "seq_idx", "position_ids")


def packed_document_starts(
    batch: int,
    seq_len: int,
    device: torch.device,
    cu_seq_lens_q: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The ``(batch, seq_len)`` bool ``reset`` of packed documents (True at each document's first token), from
    transformers' padding-free inputs (``DataCollatorWithFlattening``), or ``None`` when a row holds one document.

    - ``cu_seq_lens_q``: ``(num_docs + 1,)`` integer cumulative lengths, 0 first, the total last (``batch`` 1);
    - ``seq_idx``: ``(batch, seq_len)`` integer document index, non-decreasing along a row;
    - ``position_ids``: ``(batch, seq_len)`` (or ``(seq_len,)``) positions restarting at 0 for each document, rising
      by 1 inside one: a document starts wherever they restart at 0.

    Each one given is checked, and they must agree. Given none, or describing one document per row, it returns
    ``None`` and the model behaves exactly as without them.

    Raises:
        TypeError: a non-integer tensor.
        ValueError: a shape inconsistent with ``input_ids``, cumulative lengths that are not increasing from 0 to
            the total (an empty document), ``seq_idx`` that decreases, ``position_ids`` that neither restart at 0 nor
            rise by 1, or inputs that disagree. Messages name the argument.
    """
    starts = {}
    if cu_seq_lens_q is not None:
        cu = _integer_tensor("cu_seq_lens_q", cu_seq_lens_q).to(device)
        if cu.dim() != 1 or batch != 1:
            raise ValueError(
                f"`cu_seq_lens_q` must be 1-D (num_docs + 1,) with batch size 1 (a flattened batch), got shape "
                f"{tuple(cu.shape)} with batch {batch}."
            )
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != seq_len or bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(
                f"`cu_seq_lens_q` must rise strictly from 0 to the sequence length {seq_len} (no empty document), "
                f"got {cu.tolist()[:16]}."
            )
        reset = torch.zeros(1, seq_len, dtype=torch.bool, device=device)
        reset[0, cu[:-1].long()] = True
        starts["cu_seq_lens_q"] = reset
    if seq_idx is not None:
        ids = _integer_tensor("seq_idx", seq_idx).to(device)
        if tuple(ids.shape) != (batch, seq_len):
            raise ValueError(f"`seq_idx` must have shape (batch, sequence_length) = {(batch, seq_len)}, got {tuple(ids.shape)}.")
        step = ids[:, 1:] - ids[:, :-1]
        if bool((step < 0).any()):
            raise ValueError("`seq_idx` must not decrease along a row (one index per packed document).")
        starts["seq_idx"] = F.pad(step != 0, (1, 0), value=True)
    if position_ids is not None:
        pos = _integer_tensor("position_ids", position_ids).to(device)
        if pos.dim() == 1:
            pos = pos[None].expand(batch, -1)
        if tuple(pos.shape) != (batch, seq_len):
            raise ValueError(
                f"`position_ids` must have shape (batch, sequence_length) = {(batch, seq_len)}, got {tuple(pos.shape)}."
            )
        restart = pos == 0
        if bool(restart[:, 1:].any()):  # packed: positions must restart at 0 or rise by 1
            if not bool(restart[:, 0].all()) or not bool((restart[:, 1:] | (pos[:, 1:] == pos[:, :-1] + 1)).all()):
                raise ValueError(
                    "`position_ids` of packed documents must start at 0 and, inside a document, rise by 1 "
                    "(they restart at 0 where a document starts)."
                )
            starts["position_ids"] = restart
    if not starts:
        return None
    names, resets = list(starts), list(starts.values())
    for name, other in zip(names[1:], resets[1:]):
        if not torch.equal(other, resets[0]):
            raise ValueError(f"`{names[0]}` and `{name}` describe different document boundaries.")
    reset = resets[0]
    return reset if bool(reset[:, 1:].any()) else None


def _integer_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"`{name}` must be an integer tensor, got {got}.")
    return value


def run_backbone(
    model,
    embeddings: nn.Embedding,
    final_norm: nn.Module,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    cache,
    use_cache: bool | None,
    output_hidden_states: bool | None,
    attention_mask: torch.Tensor | None,
    **packing,
):
    """The body of a DenseSSM backbone's ``forward``, shared by both families: check the inputs, embed, set up
    the cache (a new :class:`~hf_densessm.modeling.cache.DenseSSMCache` when ``use_cache`` and none is given),
    run the densely connected blocks (``model.layers``), count the tokens on the cache, apply the final norm.

    Every block takes the cache as ``cache`` (:mod:`.cache`, "Names").

    Gradient checkpointing in training drops the cache only while gradients are computed (a training forward; one
    warning, as transformers' models give); ``generate()`` runs without gradients and keeps it, so a model in
    ``train()`` mode generates the same tokens as in ``eval()`` mode.

    ``packing``: transformers' padding-free inputs (``cu_seq_lens_q``, ``seq_idx``, ``position_ids``; other keys are
    ignored): several documents in one row, every recurrent state starting from zero at each document
    (:func:`packed_document_starts`). For training and scoring: refused with a cache or with padding.

    Returns:
        ``(last_hidden_state (batch, seq_len, hidden_size), cache or None, hidden_states or None)``; the
        ``hidden_states`` tuple has ``num_hidden_layers + 1`` entries (block inputs, then the normed output).

    Raises:
        ValueError, TypeError: bad inputs (see :func:`check_inputs`, :func:`prepare_attention_mask`,
            :func:`~hf_densessm.modeling.cache.check_cache`).
    """
    config = model.config
    if output_hidden_states is None:
        output_hidden_states = config.output_hidden_states
    check_inputs(input_ids, inputs_embeds, config.hidden_size)
    if inputs_embeds is None:
        inputs_embeds = embeddings(input_ids)
    else:
        inputs_embeds = inputs_embeds.to(embeddings.weight.dtype)
    batch, seq_len = inputs_embeds.shape[:2]
    reset = packed_document_starts(
        batch, seq_len, inputs_embeds.device, **{key: packing.get(key) for key in PACKING_KEYS}
    )
    if reset is not None and (cache is not None or use_cache):
        raise ValueError(
            "Packed documents (`cu_seq_lens_q`, `seq_idx` or restarting `position_ids`) are for training and scoring, "
            "not for decoding: give no `cache` and leave `use_cache` unset or False."
        )
    if use_cache is None:
        use_cache = config.use_cache and not model.training and reset is None
    if model.gradient_checkpointing and model.training and torch.is_grad_enabled() and use_cache:
        logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing; setting `use_cache=False`.")
        use_cache = False
    if cache is not None and use_cache:
        check_cache(cache, config, batch)
    elif use_cache:
        cache = new_cache(config)
    if not use_cache:
        cache = None
    attention_mask = prepare_attention_mask(attention_mask, batch, seq_len)
    if reset is not None and attention_mask is not None:
        raise ValueError("Packed documents need no padding: give no `attention_mask` with zeros alongside them.")
    hidden_states, all_hidden_states = run_dense_layers(
        model.layers,
        inputs_embeds,
        config,
        output_hidden_states,
        cache=cache,
        attention_mask=attention_mask,
        reset=reset,
    )
    record_tokens(cache, inputs_embeds, attention_mask)
    hidden_states = final_norm(hidden_states)
    if output_hidden_states:
        all_hidden_states += (hidden_states,)
    return hidden_states, cache, all_hidden_states


def backbone_output(model, output_class, return_dict, hidden_states, cache, all_hidden_states):
    """A backbone's return value: ``output_class(last_hidden_state, hidden_states)`` with the cache in its cache field
    (:func:`~hf_densessm.modeling.cache.model_output`), or the tuple of the ones that are not ``None`` when
    ``return_dict`` is False (default ``config.return_dict``)."""
    return_dict = return_dict if return_dict is not None else model.config.return_dict
    if not return_dict:
        return tuple(v for v in (hidden_states, cache, all_hidden_states) if v is not None)
    return model_output(output_class, cache, last_hidden_state=hidden_states, hidden_states=all_hidden_states)


def check_logits_to_keep(logits_to_keep, seq_len: int):
    """Return the index that selects the kept positions: an ``int >= 0`` keeps the last that many (0 keeps all), a
    1-D integer tensor keeps those positions.

    Raises:
        TypeError: a ``bool``, a float, or a tensor that is not an integer tensor.
        ValueError: a negative int, a tensor that is not 1-D, or an index outside ``[-seq_len, seq_len)``.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype == torch.bool:
            raise TypeError(f"`logits_to_keep` as a tensor must hold integer positions, got {logits_to_keep.dtype}.")
        if logits_to_keep.dim() != 1:
            raise ValueError(
                f"`logits_to_keep` as a tensor must be 1-D (positions to keep), got shape {tuple(logits_to_keep.shape)}."
            )
        if logits_to_keep.numel() and not bool(((logits_to_keep >= -seq_len) & (logits_to_keep < seq_len)).all()):
            raise ValueError(f"`logits_to_keep` holds positions outside [-{seq_len}, {seq_len}).")
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(
            f"`logits_to_keep` must be an int >= 0 or a 1-D integer tensor, got {logits_to_keep!r} "
            f"({type(logits_to_keep).__name__})."
        )
    if logits_to_keep < 0:
        raise ValueError(f"`logits_to_keep` must be >= 0 (0 keeps every position), got {logits_to_keep}.")
    return slice(-logits_to_keep, None) if logits_to_keep else slice(None)


#: Folders whose frames a warning of ours skips, so that it names the user's line (our package, PyTorch, transformers).
_LIBRARY_DIRS = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (sys.modules[__name__.split(".")[0]], torch, transformers)
)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` (called by the function that calls this) that points at the first frame
    outside :data:`_LIBRARY_DIRS`: the user's call of ``generate()`` or of the model, however deep the library
    frames between (PyTorch's module call, transformers' generation loop)."""
    level, frame = 2, sys._getframe(2)  # stacklevel 2: the caller of the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    return level


#: The compiled decoding step of each model with ``compile_decode_step()`` on, by model (weak keys). Kept outside the
#: model, so that ``copy.deepcopy``, pickling and saving never carry a compiled function bound to another model.
COMPILED_DECODE_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The C kernel step of each DenseMamba model it covers (``hf_densessm.ops.densemamba_step``), or ``(None, key)``
#: where it does not (tried again when the key, the registration count and the head's dtype, changes).
CPU_DECODE_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: ``compile_decode_step(implementation=...)`` values.
DECODE_STEP_IMPLEMENTATIONS = ("auto", "torch_compile")


class DenseSSMCausalLMMixin:
    """The causal-LM head's forward logic and the generation glue shared by both families.

    A subclass has ``self.lm_head`` and ``self.config``. Both families take the cache as ``cache`` and return it in
    their output class's cache field (named by the installed transformers: :mod:`.cache`, "Names"), build it the same
    way and continue generation from a returned cache.
    """

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() would build a plain DynamicCache, which cannot tell the sequence length it asks for; the
        # first forward builds a DenseSSMCache instead (as transformers' own stateful models supply theirs).
        return False

    def _logits_and_loss(
        self,
        hidden_states: torch.Tensor,
        labels: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Logits ``(batch, kept_positions, vocab_size)`` in float32 (float64 for a float64 model) and the next-token loss (labels are shifted
        inside; -100 is ignored); ``logits_to_keep`` as :func:`check_logits_to_keep`."""
        kept = check_logits_to_keep(logits_to_keep, hidden_states.shape[1])
        hidden_states = hidden_states[:, kept, :].to(self.lm_head.weight.dtype)
        if hidden_states.shape[1] == 1:  # a decoding step: the fastest one-row form (decode_linear)
            logits = decode_linear(self.lm_head, hidden_states[:, 0])[:, None]
        elif self._logits_into_workspace(hidden_states):  # training on the CPU: the logits' memory kept between steps
            logits = linear_into(hidden_states, self.lm_head.weight, self.loss_workspace(), "logits")
        else:
            logits = self.lm_head(hidden_states)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = None
        if labels is not None:
            loss = causal_lm_loss(self, logits, labels, **kwargs)  # transformers' ForCausalLMLoss, fused on CPU
        return loss, logits

    def _logits_into_workspace(self, hidden_states: torch.Tensor) -> bool:
        """Whether the LM head writes its logits into :meth:`loss_workspace`
        (:func:`~hf_densessm.ops.workspace.linear_into`): with gradients on, on the CPU, in float32/float64, outside ``torch.compile``, and only when calling the head
        would run nothing but its product (a plain bias-free ``nn.Linear``: no hook, no adapter, no replaced
        ``forward``, :func:`~hf_densessm.modeling.decode._plain_linear`)."""
        head = self.lm_head
        return (
            torch.is_grad_enabled()
            and hidden_states.device.type == "cpu"
            and hidden_states.dtype in (torch.float32, torch.float64)
            and not torch.compiler.is_compiling()
            and _plain_linear(head)
            and head.bias is None
            and head.weight.dtype == hidden_states.dtype
            and head.weight.device.type == "cpu"
        )

    def loss_workspace(self) -> Workspace:
        """The :class:`~hf_densessm.ops.workspace.Workspace` the CPU training step writes its logits and the loss's
        gradient of them into, so that two buffers serve every training step instead of fresh allocations each
        (made on first use, one per model). It keeps the largest of each seen, (batch x length) x vocabulary values
        (262 MB each at 2 x 1024 tokens and a 32000-word vocabulary in float32), as long as the model lives; a
        model that never runs a forward with gradients on the CPU never makes one.
        ``model.loss_workspace().clear()`` frees it now. Kept in the instance's ``__dict__``, never in the
        ``state_dict``; ``copy.deepcopy`` and pickling give an empty one."""
        workspace = self.__dict__.get("_hfd_loss_workspace")
        if workspace is None:
            workspace = self.__dict__["_hfd_loss_workspace"] = Workspace()
        return workspace

    def compile_decode_step(self, enable: bool = True, implementation: str = "auto"):
        """Run every later one-token decoding step (``generate()``'s loop, or a manual loop over a cache) on the CPU
        as one compiled function (``implementation``, below): the embedding, the densely connected blocks' one-token
        paths, the final norm and the LM head, with the cache's states updated in place. Opt-in, per model instance,
        not saved.

        Why: a batch-1 step of a small model is mostly per-operation overhead (about 25 small PyTorch ops and a
        Python frame per block) around reading every weight once. ``torch.compile`` fuses the pointwise work into a
        few C++ loops and leaves the one-row matrix products to PyTorch; DenseMamba's C kernel does the whole step in
        one parallel region. Measured in ``benchmarks/bench_cpu.py`` (docs/benchmarks.md, runs D-Y). The cost of
        ``torch.compile``: the first step of each new batch size or dtype compiles (tens of seconds on a 2-core CPU;
        PyTorch keeps the compiled code on disk for later processes), and a C++ compiler is needed (its CPU
        backend); the C kernel is built once per machine (a few seconds).

        The compiled step runs only where the eager one-token paths would (CPU, no gradients, ``eval()`` mode, one
        token per row given as ``input_ids``, no padding in this step, a cache whose states are all filled, no
        ``labels`` and no ``output_hidden_states``); every other call, and every call after a compilation failure
        (one warning, e.g. no C++ compiler; any other error is raised as the eager model would), runs the eager
        model. The compiled kernels of this package are not used inside the ``torch.compile`` step
        (:func:`hf_densessm.ops.backend.resolve_backend`): it runs their PyTorch references, which the tests check
        against the full forward.

        Which compiled function (``implementation``):

        - ``"auto"`` (default): for a DenseMamba model in float32 or float64 with the default dense connection, this
          package's C kernel of the whole step (:mod:`hf_densessm.ops.densemamba_step`: one call per token, no
          ``torch.compile``, no guard check; built once per machine with the C compiler), wherever
          :func:`~hf_densessm.ops.densemamba_step.unsupported_reason` gives no reason; every other model, dtype and
          configuration (DenseRetNet, bfloat16, a LoRA layer or a hook on a module, ...) gets ``torch.compile``;
        - ``"torch_compile"``: always ``torch.compile``.

        Args:
            enable: ``False`` goes back to the eager step.
            implementation: ``"auto"`` or ``"torch_compile"`` (above).

        Returns:
            The model (so ``model = Model.from_pretrained(...).compile_decode_step()`` reads naturally).

        Raises:
            TypeError: ``enable`` is not a bool.
            ValueError: ``implementation`` is not one of :data:`DECODE_STEP_IMPLEMENTATIONS`.
        """
        if not isinstance(enable, bool):
            raise TypeError(f"`enable` must be a bool, got {enable!r} ({type(enable).__name__}).")
        if implementation not in DECODE_STEP_IMPLEMENTATIONS:
            raise ValueError(
                f"`implementation` must be one of {DECODE_STEP_IMPLEMENTATIONS}, got {implementation!r}."
            )
        self.__dict__["_compile_decode_step"] = enable  # plain flags: copies and pickles of the model carry them
        self.__dict__["_decode_step_implementation"] = implementation
        COMPILED_DECODE_STEPS.pop(self, None)
        CPU_DECODE_STEPS.pop(self, None)
        return self

    def _cpu_kernel_logits(self, input_ids: torch.Tensor, cache) -> torch.Tensor | None:
        """The logits of this step from the family's kernel of the whole step, the cache advanced, or ``None``
        (nothing done) where the family has none or it does not cover this model as it is now. DenseMamba's:
        :meth:`hf_densessm.modeling.modeling_densemamba.DenseMambaForCausalLM._cpu_kernel_logits`."""
        return None

    def _compiled_decode_fn(self):
        """This model's compiled step, built on first use: ``torch.compile`` of a copy of :meth:`_decode_logits`'s code,
        called as ``fn(model, input_ids, cache)``. PyTorch keeps its compiled entries (at most
        ``torch._dynamo.config.recompile_limit``, 8) per code object; a copy per model keeps one model's entries from
        crowding out another's. Kept in :data:`COMPILED_DECODE_STEPS`, not on the model."""
        compiled = COMPILED_DECODE_STEPS.get(self)
        if compiled is None:
            method = DenseSSMCausalLMMixin._decode_logits
            code = method.__code__.replace()
            step = types.FunctionType(code, method.__globals__, method.__name__, method.__defaults__, method.__closure__)
            # cpp_wrapper: the graph's driver (one call per kernel, the matrix products, the size checks) in C++
            # rather than Python; measured 0.2-0.3 ms less per DenseMamba-30M step (docs/benchmarks.md, run G).
            compiled = COMPILED_DECODE_STEPS[self] = torch.compile(step, dynamic=False, options={"cpp_wrapper": True})
        return compiled

    def _decode_logits(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """One decoding step from token ids ``(batch, 1)`` to float32 logits ``(batch, 1, vocab_size)`` over a filled
        ``cache`` (updated in place): what ``forward`` computes on that input, traced by :meth:`compile_decode_step`."""
        backbone = getattr(self, self.base_model_prefix)
        hidden_states = backbone.get_input_embeddings()(input_ids)
        hidden_states, _ = run_dense_layers(
            backbone.layers, hidden_states, self.config, False, cache=cache, attention_mask=None, reset=None
        )
        hidden_states = getattr(backbone, backbone.final_norm_name)(hidden_states)
        return self._logits_and_loss(hidden_states, None, 0)[1]

    def _compiled_step(self, input_ids, inputs_embeds, cache, attention_mask, labels, output_hidden_states,
                       logits_to_keep, return_dict, output_class, kwargs):
        """The return value of this call from the compiled step (:meth:`compile_decode_step`; built as
        :meth:`_lm_return`), the cache advanced by one position; ``None`` (nothing done) when it is off or the call
        is not a plain one-token step."""
        if (
            not self.__dict__.get("_compile_decode_step", False)
            or input_ids is None
            or inputs_embeds is not None
            or labels is not None
            or output_hidden_states
            or self.training
            or torch.is_grad_enabled()
            or not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.shape[1] != 1
            or input_ids.device.type != "cpu"
            or cache is None
            or not (isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep in (0, 1))
            or any(kwargs.get(key) is not None for key in PACKING_KEYS)
        ):
            return None
        check_inputs(input_ids, None, self.config.hidden_size)  # the errors the eager forward raises
        low, high = torch.aminmax(input_ids)
        if low.item() < 0 or high.item() >= self.config.vocab_size:
            return None  # the eager embedding raises its IndexError
        batch = input_ids.shape[0]
        check_cache(cache, self.config, batch)
        if not is_filled(cache, self.config.model_type):
            return None
        if prepare_attention_mask(attention_mask, batch, 1) is not None:
            return None
        logits = self._cpu_kernel_logits(input_ids, cache)
        if logits is not None:
            record_tokens(cache, input_ids)
            return self._lm_return(None, logits, cache, None, return_dict, output_class)
        try:
            logits = self._compiled_decode_fn()(self, input_ids, cache)
        except torch._dynamo.exc.BackendCompilerFailed as error:  # e.g. no C++ compiler (raised before running)
            self.compile_decode_step(False)
            cause = getattr(error, "inner_exception", None) or error
            reason = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
            warnings.warn(
                f"hf_densessm: compile_decode_step could not compile the decoding step ({reason}); the eager step "
                "runs instead.",
                RuntimeWarning,
                stacklevel=_caller_stacklevel(),
            )
            return None
        record_tokens(cache, input_ids)
        return self._lm_return(None, logits, cache, None, return_dict, output_class)

    def _lm_return(self, loss, logits, cache, hidden_states, return_dict, output_class):
        """The head's return value: ``output_class(loss, logits, hidden_states)`` with the cache in its cache field
        (:func:`~hf_densessm.modeling.cache.model_output`), or the tuple of the ones that are not ``None`` when
        ``return_dict`` is False (default ``config.return_dict``)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if not return_dict:
            return tuple(v for v in (loss, logits, cache, hidden_states) if v is not None)
        return model_output(output_class, cache, loss=loss, logits=logits, hidden_states=hidden_states)

    def _causal_lm_output(self, outputs, labels, logits_to_keep, return_dict, output_class, **kwargs):
        """The head's return value from the backbone's ``outputs``: logits and loss (:meth:`_logits_and_loss`), the
        cache, the hidden states (:meth:`_lm_return`)."""
        loss, logits = self._logits_and_loss(outputs.last_hidden_state, labels, logits_to_keep, **kwargs)
        return self._lm_return(loss, logits, output_cache(outputs), outputs.hidden_states, return_dict, output_class)

    @takes_cache("past_key_values", "cache_params")
    def prepare_inputs_for_generation(
        self,
        input_ids,
        attention_mask=None,
        inputs_embeds=None,
        cache=None,
        next_sequence_length=None,
        is_first_iteration=False,
        **kwargs,
    ):
        """As transformers' default, with three differences for recurrent models:

        - the 2-D padding mask is passed through as is: the blocks read it directly (its last ``sequence_length``
          columns) and never need a 4-D attention mask (so the cache is not shown to transformers' mask builder);
        - ``inputs_embeds`` are used for the first step, as transformers' decoder-only models do;
        - a ``cache`` passed in that already holds ``p`` positions while ``input_ids`` holds more is continued: only
          ``input_ids[:, p:]`` is fed (the sequence a previous ``generate()`` returned, given back with its cache).

        The cache goes to ``forward`` as ``cache``; ``generate()`` hands it in under the installed transformers' name
        (:func:`~hf_densessm.modeling.cache.takes_cache`).
        """
        if is_first_iteration and next_sequence_length is None and cache is not None:
            seen = cache.get_seq_length()
            length = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
            if 0 < seen < length:
                next_sequence_length = length - seen
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            attention_mask=None,
            inputs_embeds=inputs_embeds,
            next_sequence_length=next_sequence_length,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        if cache is not None:
            model_inputs["cache"] = cache
        model_inputs["attention_mask"] = attention_mask
        return model_inputs


class DenseSSMForSequenceClassificationMixin(GenericForSequenceClassification):
    """A sequence-classification head for either family: transformers' ``GenericForSequenceClassification``
    (a bias-free ``score: hidden_size -> num_labels`` read at the last non-padding token, ``pad_token_id`` required
    for batches larger than 1, transformers' loss mapping for regression / single- and multi-label), over the
    family's backbone. A subclass sets ``base_model_prefix`` and ``backbone_class``.

    The backbone is built directly (not through ``AutoModel``), so the head also works from a saved folder loaded
    with ``trust_remote_code=True``. Padding never enters a recurrent state, so left- and right-padded batches give
    the same logits.
    """

    backbone_class: type = None

    def __init__(self, config):
        super(GenericForSequenceClassification, self).__init__(config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.backbone_class(config))
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
