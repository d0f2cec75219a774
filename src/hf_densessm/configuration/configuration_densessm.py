"""The config base shared by every DenseSSM family: the dense knobs (:data:`DENSE_KNOBS`; docs/design.md §2), the
runtime setting ``kernel_backend`` and the checks the family configs use (not ``@strict`` fields: docs/design.md §6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from transformers import PretrainedConfig

from ..ops.dispatch import BACKENDS as KERNEL_BACKENDS  # the values of kernel_backend (never saved)

#: Largest width, layer count or vocabulary a config accepts (beyond it the kernels' 32-bit offsets overflow).
MAX_SIZE = 2**24


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` if an ``int`` (not a ``bool``) in ``[minimum, maximum]``; else ``TypeError`` (not an int) or
    ``ValueError`` (out of range), naming ``name`` and the range. The checks below raise likewise."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int {allowed}, got {value!r} ({type(value).__name__}).")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"`{name}` must be an int {allowed}, got {value}.")
    return value


def check_size(name: str, value) -> int:
    """A width, count or vocabulary size: an int in ``[1, MAX_SIZE]``."""
    return check_int(name, value, 1, MAX_SIZE)


def check_positive_float(name: str, value) -> float:
    """``float(value)`` for a finite real number ``> 0`` (``TypeError`` for a non-number or a ``bool``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a positive number, got {value!r} ({type(value).__name__}).")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value}.")
    return float(value)


def check_bool(name: str, value) -> bool:
    """``value`` if a ``bool`` (``'false'`` is a ``TypeError``)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool (True or False), got {value!r} ({type(value).__name__}).")
    return value


def check_choice(name: str, value, allowed: tuple[str, ...]) -> str:
    """``value`` if one of ``allowed`` (else ``ValueError`` listing them)."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.")
    return value


@dataclass(frozen=True)
class Knob:
    """One ``dense_*`` config field: ``kind`` (``int``, ``bool`` or ``str``), ``default`` (``None``: the family's or
    from ``hidden_size``), one-line ``help``, allowed ``choices`` (str) or ``minimum`` (int), ``None`` ``optional``."""

    name: str
    kind: type
    default: object
    help: str
    choices: tuple[str, ...] | None = None
    minimum: int | None = None
    optional: bool = False

    def check(self, value):
        """``value`` if allowed, else ``TypeError``/``ValueError`` naming the knob."""
        if value is None and self.optional:
            return None
        if self.kind is bool:
            return check_bool(self.name, value)
        if self.kind is int:
            return check_int(self.name, value, self.minimum)
        return check_choice(self.name, value, self.choices)


#: The dense-connection knobs of every family, in the docs' order (a family adds :attr:`DenseSSMConfig.family_knobs`).
DENSE_KNOBS: tuple[Knob, ...] = (
    Knob("dense_layers", int, None, "m, how many preceding layers feed each layer (Eq. 10; Table 7); 0 = the base "
         "model; the default is the family's (4 DenseMamba, 2 DenseRetNet)", minimum=0),
    Knob("dense_projection", str, "identity", "Proj of the selective transition (Eq. 15; Table 5)",
         choices=("identity", "linear")),
    Knob("dense_selection", str, "mlp", "Gate of the selective transition, from the layer's normalized input "
         "(Eq. 16; Table 5)", choices=("mlp", "linear", "none")),
    Knob("dense_shared_gate", bool, True, "one gate shared by the m predecessors (True) or one per predecessor "
         "(Table 7, 'Diff. gates')"),
    Knob("dense_fusion", str, "add", "hidden fusion: sum (Eq. 17) or concat + linear reduction (Table 8)",
         choices=("add", "concat")),
    Knob("dense_every", int, 1, "only layers whose index is a multiple fuse (Table 9)", minimum=1),
    Knob("dense_gate_hidden_size", int, None, "hidden width of the 'mlp' gate; None = max(1, hidden_size // 32)",
         minimum=1, optional=True),
)


#: The key of a save's id in ``config.json`` and the weights (``modeling.save_check``); never in ``to_dict``.
SAVE_ID = "_save_id"

#: The paper's optimizer settings (§4.2) as ``TrainingArguments`` keywords (``warmup_steps`` < 1: a fraction).
PAPER_OPTIMIZER = dict(optim="adamw_torch", lr_scheduler_type="polynomial", warmup_steps=0.015, weight_decay=0.01,
                       max_grad_norm=1.0)


def resolve_preset(presets: dict, name, family: str) -> dict:
    """A copy of ``presets[name]``; ``TypeError`` if ``name`` is not a str, ``ValueError`` (listing the known names)
    if it is not a preset of ``family``."""
    if not isinstance(name, str):
        raise TypeError(f"The {family} preset name must be a str, got {name!r} ({type(name).__name__}).")
    if name not in presets:
        raise ValueError(f"Unknown {family} preset {name!r}; known presets: {', '.join(sorted(presets))}.")
    return dict(presets[name])


class DenseSSMConfig(PretrainedConfig):
    """Base of the family configs: sets and checks the :data:`DENSE_KNOBS` in ``kwargs`` (absent ones: the family's
    :attr:`dense_defaults` or the knob's; ``ValueError``/``TypeError`` naming a refused one); a subclass calls
    ``super().__init__(**kwargs)`` after setting ``hidden_size`` and ``num_hidden_layers``."""

    model_type = ""
    #: Family defaults that differ from the knob table's (``dense_layers``: 4 for DenseMamba, 2 for DenseRetNet).
    dense_defaults: ClassVar[dict] = {}
    #: The family's named sizes, for :meth:`from_preset`.
    presets: ClassVar[dict] = {}
    #: The family's own dense knobs, after :data:`DENSE_KNOBS` (DenseMamba's ``dense_target``).
    family_knobs: ClassVar[tuple[Knob, ...]] = ()
    #: The state slots of a block's cache layer the family fills, by kind (docs/design.md §5).
    cache_slots: ClassVar[dict[str, tuple[int, ...]]] = {"conv": (), "recurrent": ()}
    #: Whether its blocks read each row's real-token count (``DenseSSMCache.real_tokens_seen``).
    cache_counts_row_tokens: ClassVar[bool] = False

    def cache_shapes(self, batch: int) -> dict[tuple[str, int], tuple[int, ...]]:
        """``{(kind, slot): shape}`` of each slot of :attr:`cache_slots` for ``batch`` rows (none in the base)."""
        return {}

    def set_checked(self, check, **fields) -> None:
        """Set each of ``fields`` to ``check(name, value)`` (:func:`check_size`, :func:`check_bool`, ...)."""
        for name, value in fields.items():
            setattr(self, name, check(name, value))

    def __init__(
        self, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, kernel_backend="auto", **kwargs
    ):
        token_ids = dict(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        for name, value in token_ids.items():  # None, an int >= 0, or (eos) a list of them
            for v in value if isinstance(value, (list, tuple)) and name == "eos_token_id" else [value]:
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise TypeError(f"`{name}` must be None or an int >= 0 (a list of them for eos), got {value!r}.")
        self.kernel_backend = kernel_backend
        self.set_dense_knobs(kwargs)
        tie_word_embeddings = check_bool("tie_word_embeddings", tie_word_embeddings)
        super().__init__(**token_ids, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def kernel_backend(self) -> str:
        """Which implementation of the ops runs (:data:`KERNEL_BACKENDS`, else ``ValueError``); never saved."""
        return self._kernel_backend

    @kernel_backend.setter
    def kernel_backend(self, value: str) -> None:
        self._kernel_backend = check_choice("kernel_backend", value, KERNEL_BACKENDS)

    def to_dict(self) -> dict:
        """transformers' ``to_dict``, without the runtime ``kernel_backend`` and the save id (:data:`SAVE_ID`)."""
        return {key: value for key, value in super().to_dict().items()
                if key not in ("_kernel_backend", "kernel_backend", SAVE_ID)}

    @property
    def layer_types(self) -> list[str]:
        """One transformers linear-attention cache layer per block (``hf_densessm.modeling.cache``)."""
        return ["linear_attention"] * self.num_hidden_layers

    @classmethod
    def from_preset(cls, name: str, **overrides):
        """A config of one of :attr:`presets`, fields overridden; errors: :func:`resolve_preset`'s, the config's."""
        return cls(**{**resolve_preset(cls.presets, name, cls.__name__.removesuffix("Config")), **overrides})

    @classmethod
    def knobs(cls) -> tuple[Knob, ...]:
        """The family's dense knobs: :data:`DENSE_KNOBS`, then :attr:`family_knobs`."""
        return DENSE_KNOBS + cls.family_knobs

    def set_dense_knobs(self, kwargs: dict) -> None:
        """Pop this family's knobs from ``kwargs``, check and set them; other ``dense_*`` keywords: ``ValueError``."""
        names = [knob.name for knob in self.knobs()]
        if foreign := [name for name in kwargs if name.startswith("dense_") and name not in names]:
            raise ValueError(f"{', '.join(f'`{name}`' for name in foreign)} is not a {self.model_type} knob (only "
                             f"{', '.join(names)}); leave it out.")
        for knob in self.knobs():
            default = self.dense_defaults.get(knob.name, knob.default)
            setattr(self, knob.name, knob.check(kwargs.pop(knob.name, default)))
        if self.dense_gate_hidden_size is None:
            self.dense_gate_hidden_size = max(1, self.hidden_size // 32)
        if self.dense_layers and self.dense_every >= (layers := self.num_hidden_layers):
            raise ValueError(f"`dense_every` ({self.dense_every}) must be smaller than `num_hidden_layers` ({layers}) "
                             "when `dense_layers` > 0: only layers whose index is a multiple of `dense_every` fuse, "
                             "and layer 0 has no predecessors, so no layer would fuse. Use `dense_layers=0` for the "
                             "base model.")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' ``from_dict``; ``ValueError`` for a dict (with ``kwargs``) lacking a dense knob
        (docs/design.md §6). A ``kernel_backend`` in ``config_dict`` is dropped; one in ``kwargs`` applies."""
        config_dict = {key: value for key, value in config_dict.items() if key != "kernel_backend"}
        if missing := [knob.name for knob in cls.knobs() if knob.name not in {**config_dict, **kwargs}]:
            raise ValueError(f"This {cls.model_type} config lacks the dense knob(s) {', '.join(missing)}; their "
                             "defaults would change the function the saved weights compute. Add them to config.json "
                             "with the values the model was built with, or pass them to `from_pretrained` (e.g. "
                             "`dense_layers=4`).")
        return super().from_dict(config_dict, **kwargs)

    def to_diff_dict(self) -> dict:
        """transformers' diff against the defaults, plus every knob (a saved ``config.json`` always carries them)."""
        return {**super().to_diff_dict(), **{knob.name: getattr(self, knob.name) for knob in self.knobs()}}
