"""The dense hidden connection, whole (DenseSSM paper §3.3, Eq. 10-17, Tables 7-9; docs/design.md §2): gate, selective
transition, hidden fusion, init and the layer loop that hands pre-fusion features up to the next ``m`` layers."""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F
from torch import nn


def dense_predecessor_count(layer_idx: int, dense_layers: int, dense_every: int) -> int:
    """Number of preceding layers whose features layer ``layer_idx`` fuses: ``min(l, m)`` when ``l > 0`` is a multiple
    of ``dense_every`` (Table 9), else 0."""
    return 0 if dense_layers == 0 or layer_idx % dense_every else min(layer_idx, dense_layers)


def _dense_linear(in_features: int, out_features: int, role: str) -> nn.Linear:
    """A bias-free ``Linear`` tagged with its :func:`init_dense_linear` role."""
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.dense_init = role
    return layer


@torch.no_grad()
def init_dense_linear(module: nn.Module, init, gate_std: float | None = None) -> bool:
    """Initialize ``module`` (``init``: ``transformers.initialization``) if it is a dense ``Linear``, and say so: gates
    normal(0, ``gate_std``) if given, else Xavier-uniform (gain 2^-2.5); projections, reduction ``[I, 0]``."""
    role = getattr(module, "dense_init", None)
    if role is None:
        return False
    if role != "gate":  # "identity" and "concat"
        init.eye_(module.weight)
    elif gate_std is not None:
        init.normal_(module.weight, mean=0.0, std=gate_std)
    else:
        init.xavier_uniform_(module.weight, gain=2**-2.5)  # DenseMamba's gates (docs/design.md §4)
    return True


class DenseGate(nn.Module):
    """``Gate(x)`` of Eq. 16: ``"mlp"`` ``SiLU(fc2(SiLU(fc1(x))))``, ``"linear"`` ``SiLU(fc(x))`` (docs/design.md §2),
    ``(..., hidden_size) -> (..., feature_size)``, same dtype. ``ValueError`` for another ``selection``."""

    def __init__(self, hidden_size: int, feature_size: int, gate_hidden_size: int, selection: str):
        super().__init__()
        self.selection = selection
        if selection == "mlp":
            self.fc1 = _dense_linear(hidden_size, gate_hidden_size, "gate")
            self.fc2 = _dense_linear(gate_hidden_size, feature_size, "gate")
        elif selection == "linear":
            self.fc = _dense_linear(hidden_size, feature_size, "gate")
        else:
            raise ValueError(f"`dense_selection` must be 'mlp' or 'linear' for a gate, got {selection!r}.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.fc2(F.silu(self.fc1(x))) if self.selection == "mlp" else self.fc(x))

    def output_layer(self) -> nn.Linear:
        """The gate's last linear layer (zero it to make the dense connection an exact no-op)."""
        return self.fc2 if self.selection == "mlp" else self.fc


class DenseHiddenConnection(nn.Module):
    """Selective transition + hidden fusion (Eq. 10-17) of one feature in one layer with ``num_predecessors`` lower
    layers (the other arguments: the dense knobs). ``forward(x, feature, predecessors)``: ``x`` ``(..., hidden_size)``,
    ``feature`` ``(..., feature_size)``, ``num_predecessors`` tensors like it, nearest first (else ``ValueError``) ->
    the fused feature in ``feature``'s dtype."""

    def __init__(self, hidden_size: int, feature_size: int, num_predecessors: int, projection: str, selection: str,
                 shared_gate: bool, fusion: str, gate_hidden_size: int):
        super().__init__()
        self.num_predecessors = num_predecessors
        self.fusion = fusion
        self.selection = selection
        self.shared_gate = shared_gate
        if selection != "none" and shared_gate:
            self.gate = DenseGate(hidden_size, feature_size, gate_hidden_size, selection)
        elif selection != "none":
            self.gates = nn.ModuleList(DenseGate(hidden_size, feature_size, gate_hidden_size, selection)
                                       for _ in range(num_predecessors))
        self.projections = nn.ModuleList(_dense_linear(feature_size, feature_size, "identity")
                                         for _ in range(num_predecessors)) if projection == "linear" else None
        if fusion == "concat":
            self.reduce = _dense_linear((num_predecessors + 1) * feature_size, feature_size, "concat")

    def gate_modules(self) -> list[DenseGate]:
        """The gates of this connection (one if shared), in predecessor order."""
        return [] if self.selection == "none" else [self.gate] if self.shared_gate else list(self.gates)

    def forward(self, x: torch.Tensor, feature: torch.Tensor, predecessors: list[torch.Tensor]) -> torch.Tensor:
        if len(predecessors) != self.num_predecessors:
            raise ValueError(f"DenseHiddenConnection expects {self.num_predecessors} predecessor features, got "
                             f"{len(predecessors)}.")
        if self.selection != "none" and self.shared_gate and self.projections is None and self.fusion == "add":
            # the defaults: sum_i g * f_i = g * sum_i f_i, summed first and gated once (one fused region compiled)
            total = sum(predecessors[1:], predecessors[0])
            return torch.addcmul(feature, total.to(feature.dtype), self.gate(x).to(feature.dtype))
        shared = self.gate(x) if self.selection != "none" and self.shared_gate else None
        selected = []
        for i, f in enumerate(predecessors):
            if self.projections is not None:
                f = self.projections[i](f)  # Eq. 15
            if self.selection != "none":
                f = f * (shared if shared is not None else self.gates[i](x))  # Eq. 16
            selected.append(f)
        if self.fusion == "add":  # Eq. 17
            return sum(selected, feature)
        return self.reduce(torch.cat([feature, *selected], dim=-1))  # Table 8, "Concat"

    @torch.no_grad()
    def zero_gates(self) -> None:
        """Make the connection an exact no-op, still trainable: zero each gate's output layer (``SiLU(0) = 0``).
        Raises ``ValueError`` for ``selection="none"`` (no gate)."""
        if self.selection == "none":
            raise ValueError("`dense_selection='none'` has no gate, so the dense connection cannot start as a no-op.")
        for gate in self.gate_modules():
            gate.output_layer().weight.zero_()


def build_dense_connection(config, layer_idx: int, feature_size: int) -> DenseHiddenConnection | None:
    """The :class:`DenseHiddenConnection` of ``feature_size`` for layer ``layer_idx`` of ``config``, or ``None`` when
    the layer has no predecessors."""
    if not (n := dense_predecessor_count(layer_idx, config.dense_layers, config.dense_every)):
        return None
    return DenseHiddenConnection(config.hidden_size, feature_size, n, config.dense_projection, config.dense_selection,
                                 config.dense_shared_gate, config.dense_fusion, config.dense_gate_hidden_size)


def split_dense_inputs(dense_inputs: tuple[torch.Tensor, ...], num_features: int) -> list[list[torch.Tensor]]:
    """Split a block's flat ``dense_inputs`` into ``num_features`` lists of ``n`` tensors, nearest first;
    ``ValueError`` if ``len(dense_inputs)`` is not a multiple of ``num_features``."""
    if len(dense_inputs) % num_features:
        raise ValueError(f"Expected {num_features} features per predecessor, got {len(dense_inputs)} tensors.")
    n = len(dense_inputs) // num_features
    return [list(dense_inputs[i * n : (i + 1) * n]) for i in range(num_features)]


def run_dense_layers(layers: nn.ModuleList, hidden_states: torch.Tensor, config, output_hidden_states: bool,
                     **layer_kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Run the blocks from the embeddings ``(batch, seq_len, hidden_size)``: ``block(hidden_states, *dense_inputs,
    **layer_kwargs) -> (hidden_states, *features)``, ``dense_inputs`` grouped by feature, nearest first. Returns the
    last block's output and, if ``output_hidden_states``, every block's input (embeddings first)."""
    m = config.dense_layers
    history: deque[tuple[torch.Tensor, ...]] = deque(maxlen=m)  # m = 0: keeps nothing
    all_hidden_states = () if output_hidden_states else None
    for layer_idx, block in enumerate(layers):
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        n = dense_predecessor_count(layer_idx, m, config.dense_every)
        nearest_first = [history[-j] for j in range(1, n + 1)]
        dense_inputs = [layer[f] for f in range(len(history[-1]) if n else 0) for layer in nearest_first]
        hidden_states, *features = block(hidden_states, *dense_inputs, **layer_kwargs)
        history.append(tuple(features))
    return hidden_states, all_hidden_states
