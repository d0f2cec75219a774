"""The dense hidden connection of DenseSSM: selective transition and hidden fusion, one module for both families.

Source: DenseSSM paper (He et al. 2024, arXiv 2403.00818) §3.3:
    selective transition (Eq. 10, 15, 16): ``phi(f^{l-i}) = Proj(f^{l-i}) * Gate(x^l)``
    hidden fusion (Eq. 11, 17):            ``f'^l = f^l + sum_{i=1..m} phi(f^{l-i})``  ("add")
                                           ``f'^l = W [f^l; phi(f^{l-1}); ...]``       ("concat", Table 8)
DenseRetNet fuses its keys and values with it (Eq. 20-23), DenseMamba the scan inputs ``u`` and ``B``
(DESIGN.md §3). The features handed up are each layer's *pre-fusion* features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GATE_INIT_GAIN = 2**-2.5  # Xavier-uniform gain of the gate MLPs (the published DenseRetNet's init, DESIGN.md §2)


def dense_predecessor_count(layer_idx: int, dense_layers: int, dense_every: int) -> int:
    """Number of preceding layers whose features layer ``layer_idx`` fuses.

    Layer 0 has none; layer ``l`` has ``min(l, m)`` when ``l`` is a multiple of ``dense_every`` (paper Table 9),
    else none. Returns an ``int`` in ``[0, dense_layers]``.
    """
    if layer_idx == 0 or dense_layers == 0 or layer_idx % dense_every:
        return 0
    return min(layer_idx, dense_layers)


class DenseGate(nn.Module):
    """``Gate(x)`` of Eq. 16, computed from a layer's normalized input ``x``.

    ``"mlp"``: ``SiLU(fc2(SiLU(fc1(x))))`` with bias-free ``fc1: hidden_size -> gate_hidden_size`` and
    ``fc2: gate_hidden_size -> feature_size`` (the published DenseRetNet's ``k_select``/``v_select``);
    ``"linear"``: ``SiLU(fc(x))``. Input ``(..., hidden_size)``, output ``(..., feature_size)``, same dtype.
    A zero ``fc2`` (or ``fc``) weight makes the gate exactly 0, so the dense connection adds nothing.
    """

    def __init__(self, hidden_size: int, feature_size: int, gate_hidden_size: int, selection: str):
        super().__init__()
        self.selection = selection
        if selection == "mlp":
            self.fc1 = nn.Linear(hidden_size, gate_hidden_size, bias=False)
            self.fc2 = nn.Linear(gate_hidden_size, feature_size, bias=False)
        elif selection == "linear":
            self.fc = nn.Linear(hidden_size, feature_size, bias=False)
        else:
            raise ValueError(f"`dense_selection` must be 'mlp' or 'linear' for a gate, got {selection!r}.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selection == "mlp":
            return F.silu(self.fc2(F.silu(self.fc1(x))))
        return F.silu(self.fc(x))

    def output_layer(self) -> nn.Linear:
        """The gate's last linear layer (zero it to make the dense connection an exact no-op)."""
        return self.fc2 if self.selection == "mlp" else self.fc


class DenseHiddenConnection(nn.Module):
    """Selective transition + hidden fusion of one feature (e.g. ``k``, ``v``, ``u`` or ``B``) in one layer.

    Args:
        hidden_size: width of the gate input ``x`` (the block's normalized input).
        feature_size: width of the fused feature.
        num_predecessors: ``n``, how many lower layers feed this one (``1 <= n <= m``).
        projection: ``"identity"`` | ``"linear"`` (Eq. 15; one bias-free ``Linear`` per predecessor, initialized to
            the identity).
        selection: ``"mlp"`` | ``"linear"`` | ``"none"`` (Eq. 16).
        shared_gate: one gate for all predecessors, or one per predecessor (Table 7).
        fusion: ``"add"`` (Eq. 17) | ``"concat"`` (Table 8; ``reduce: (n+1)*feature_size -> feature_size``,
            initialized to pass ``f^l`` through unchanged).
        gate_hidden_size: width of the MLP gate.

    Shapes: ``forward(x, feature, predecessors)`` takes ``x`` ``(..., hidden_size)``, ``feature``
    ``(..., feature_size)`` and a list of ``n`` tensors shaped like ``feature``, nearest layer first
    (``f^{l-1}, f^{l-2}, ...``); returns the fused feature ``(..., feature_size)`` in ``feature``'s dtype.

    Raises:
        ValueError: ``predecessors`` does not hold exactly ``num_predecessors`` tensors.
    """

    def __init__(
        self,
        hidden_size: int,
        feature_size: int,
        num_predecessors: int,
        projection: str,
        selection: str,
        shared_gate: bool,
        fusion: str,
        gate_hidden_size: int,
    ):
        super().__init__()
        self.num_predecessors = num_predecessors
        self.fusion = fusion
        self.selection = selection
        self.shared_gate = shared_gate
        if selection != "none":
            if shared_gate:
                self.gate = DenseGate(hidden_size, feature_size, gate_hidden_size, selection)
            else:
                self.gates = nn.ModuleList(
                    DenseGate(hidden_size, feature_size, gate_hidden_size, selection) for _ in range(num_predecessors)
                )
        self.projections = (
            nn.ModuleList(nn.Linear(feature_size, feature_size, bias=False) for _ in range(num_predecessors))
            if projection == "linear"
            else None
        )
        if fusion == "concat":
            self.reduce = nn.Linear((num_predecessors + 1) * feature_size, feature_size, bias=False)

    def gate_modules(self) -> list[DenseGate]:
        """The gates of this connection (one if shared), in predecessor order."""
        if self.selection == "none":
            return []
        return [self.gate] if self.shared_gate else list(self.gates)

    def forward(self, x: torch.Tensor, feature: torch.Tensor, predecessors: list[torch.Tensor]) -> torch.Tensor:
        if len(predecessors) != self.num_predecessors:
            raise ValueError(
                f"DenseHiddenConnection expects {self.num_predecessors} predecessor features, got {len(predecessors)}."
            )
        shared = self.gate(x) if self.selection != "none" and self.shared_gate else None
        selected = []
        for i, f in enumerate(predecessors):
            if self.projections is not None:
                f = self.projections[i](f)  # Eq. 15
            if self.selection != "none":
                f = f * (shared if shared is not None else self.gates[i](x))  # Eq. 16
            selected.append(f)
        if self.fusion == "add":  # Eq. 17
            for f in selected:
                feature = feature + f
            return feature
        return self.reduce(torch.cat([feature, *selected], dim=-1))  # Table 8, "Concat"

    @torch.no_grad()
    def init_weights(self, init, gate_gain: float = GATE_INIT_GAIN) -> None:
        """Initialize in place with ``init`` (``transformers.initialization``, which skips loaded weights):
        Xavier-uniform with gain ``gate_gain`` on the gates (DESIGN.md §2), identity projections, and a concat
        reduction that passes ``f^l`` through."""
        for gate in self.gate_modules():
            for layer in gate.modules():
                if isinstance(layer, nn.Linear):
                    init.xavier_uniform_(layer.weight, gain=gate_gain)
        if self.projections is not None:
            for proj in self.projections:
                init.eye_(proj.weight)
        if self.fusion == "concat":
            size = self.reduce.weight.shape[0]
            weight = torch.zeros_like(self.reduce.weight)
            weight[:, :size] = torch.eye(size, dtype=weight.dtype, device=weight.device)
            init.copy_(self.reduce.weight, weight)

    @torch.no_grad()
    def zero_gates(self) -> None:
        """Make the connection an exact no-op while keeping it trainable: zero each gate's output layer
        (``SiLU(0) = 0``). Used to upcycle a pretrained base model. Raises ``ValueError`` for ``selection="none"``,
        which has no gate to close."""
        if self.selection == "none":
            raise ValueError("`dense_selection='none'` has no gate, so the dense connection cannot start as a no-op.")
        for gate in self.gate_modules():
            gate.output_layer().weight.zero_()


def build_dense_connection(config, layer_idx: int, feature_size: int) -> DenseHiddenConnection | None:
    """The :class:`DenseHiddenConnection` of ``feature_size`` for layer ``layer_idx`` of a DenseSSM ``config``
    (any config with the dense knobs), or ``None`` when the layer has no predecessors."""
    n = dense_predecessor_count(layer_idx, config.dense_layers, config.dense_every)
    if n == 0:
        return None
    return DenseHiddenConnection(
        hidden_size=config.hidden_size,
        feature_size=feature_size,
        num_predecessors=n,
        projection=config.dense_projection,
        selection=config.dense_selection,
        shared_gate=config.dense_shared_gate,
        fusion=config.dense_fusion,
        gate_hidden_size=config.dense_gate_hidden_size,
    )


def dense_predecessors(history: list, layer_idx: int, config) -> list:
    """The predecessor features layer ``layer_idx`` fuses, nearest first, taken from ``history`` (the pre-fusion
    features of layers ``0 .. layer_idx - 1`` in order; entries may be tuples of several features)."""
    n = dense_predecessor_count(layer_idx, config.dense_layers, config.dense_every)
    return [history[layer_idx - i] for i in range(1, n + 1)]
