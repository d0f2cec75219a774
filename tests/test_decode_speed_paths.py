"""The fast decoding paths (``DenseMambaMixer._decode_step``, ``DenseRetNetRetention._decode_step``,
``decode_linear``, the LM head's one-row product, ``retention_state_update_torch``) compute the function of the
full forward: logits of prefill + token-by-token decoding equal the full forward's within the dtype's rounding, in
float32 and bfloat16, with and without a left-padded batch, with and without the dense connection (and DenseMamba's
``dense_target="state"``). Correctness only; speed is measured by ``benchmarks/bench_decode.py``.
"""

import pytest
import torch
from torch import nn

from helpers import micro_model, output_cache, random_ids
from helpers import decode_step_by_step as _decode_logits
from hf_densessm.modeling import decode
from hf_densessm.modeling.modeling_densemamba import DenseMambaMixer
from hf_densessm.modeling.decode import cached_from_parameters, decode_linear
from hf_densessm.modeling.modeling_denseretnet import DenseRetNetRetention, DenseRetNetThetaShift

# (family, overrides): both families without and with the dense connection, DenseMamba's Eq. 14 mode too
VARIANTS = [
    ("densemamba", dict(dense_layers=0)),
    ("densemamba", dict(dense_layers=2)),
    ("densemamba", dict(dense_layers=2, dense_target="state")),
    ("denseretnet", dict(dense_layers=0)),
    ("denseretnet", dict(dense_layers=2)),
]
IDS = [f"{family}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for family, o in VARIANTS]

# max |decode - forward| / max |forward| allowed: float32 rounding, and a few bfloat16 roundings (2^-8 each) of
# intermediate values that the step and the chunked scan round at different places
RELATIVE_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def _count_fast_steps(monkeypatch):
    """Count the calls of both families' fast decoding steps."""
    calls = []
    for cls in (DenseMambaMixer, DenseRetNetRetention):
        original = cls._decode_step

        def counted(self, *args, _original=original, **kwargs):
            calls.append(type(self).__name__)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "_decode_step", counted)
    return calls


def _assert_close_relative(actual, expected, dtype, where=""):
    scale = expected.abs().max().item()
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= RELATIVE_TOL[dtype] * scale, f"{where}: max |decode - forward| = {diff:.3g}, max |logit| {scale:.3g}"


@pytest.mark.parametrize("small_numel", [None, 0], ids=["default", "no-float32-copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family,overrides", VARIANTS, ids=IDS)
def test_decode_equals_full_forward(family, overrides, dtype, small_numel, monkeypatch):
    if small_numel is not None:  # every 16-bit product through torch.mv / W @ x^T instead of float32 copies
        monkeypatch.setattr(decode, "SMALL_WEIGHT_NUMEL", small_numel)
    model = micro_model(family, **overrides).to(dtype)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
    calls = _count_fast_steps(monkeypatch)
    decoded = _decode_logits(model, ids, None, prefill=5)
    assert decoded.dtype == full.dtype == torch.float32
    assert len(calls) == 7 * model.config.num_hidden_layers  # every decoding step took the fast path
    _assert_close_relative(decoded, full, dtype, f"{family} {overrides} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family,overrides", VARIANTS, ids=IDS)
def test_left_padded_batch_of_8_decodes_each_row_as_alone(family, overrides, dtype, monkeypatch):
    """A left-padded batch of 8 (prompts of 3-10 tokens): the decoding steps (no padding in them) take the fast
    path, and every row's logits equal the full forward over the padded batch and that row decoded alone."""
    model = micro_model(family, **overrides).to(dtype)
    length, prefill = 14, 10
    ids = random_ids(8, length, seed=3)
    mask = torch.ones(8, length, dtype=torch.long)
    for row in range(8):
        mask[row, : 7 - row] = 0  # row r: 7 - r padding tokens on the left
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    calls = _count_fast_steps(monkeypatch)
    decoded = _decode_logits(model, ids, mask, prefill)
    assert len(calls) == (length - prefill) * model.config.num_hidden_layers
    real = mask.bool()
    _assert_close_relative(decoded[real], full[real], dtype, f"batch {family} {overrides} {dtype}")
    for row in (0, 7):  # the fully padded-out rows of the prefill and the unpadded one, alone
        alone = _decode_logits(model, ids[row : row + 1, 7 - row :], None, prefill - (7 - row))
        _assert_close_relative(decoded[row, 7 - row :], alone[0], dtype, f"row {row} alone")


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_decode_follows_in_place_weight_updates(family):
    """Values kept between steps (float32 weight copies, Mamba's A and D) follow in-place updates of the
    parameters (an optimizer step, ``load_state_dict``): decoding after an update equals the updated model's
    full forward."""
    model = micro_model(family).to(torch.bfloat16)
    ids = random_ids(2, 8)
    _decode_logits(model, ids, None, prefill=4)  # fills the kept values
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.mul_(0.5 if "A_log" not in name else 1.1)
        full = model(ids).logits
    _assert_close_relative(_decode_logits(model, ids, None, prefill=4), full, torch.bfloat16, "after update")


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_decode_with_gradients_takes_the_general_path(family, monkeypatch):
    model = micro_model(family)
    ids = random_ids(1, 6)
    calls = _count_fast_steps(monkeypatch)
    out = model(ids[:, :4], use_cache=True)
    cache = output_cache(out)
    step = model(ids[:, 4:5], use_cache=True, cache=cache)
    assert not calls and step.logits.requires_grad
    with torch.no_grad():
        full = model(ids[:, :5]).logits
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", [(600, 512, True), (64, 96, False), (96, 16, True)])
def test_decode_linear_equals_the_module(shape, rows):
    out_features, in_features, bias = shape
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        got = decode_linear(layer, x)
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2**-7)


def test_decode_linear_calls_wrapped_or_hooked_layers():
    """A subclass (e.g. a LoRA layer), a layer with a forward hook, or gradients: the module itself is called."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    x = torch.randn(1, 16).to(torch.bfloat16)
    with torch.no_grad():
        wrapped = Scaled(16, 8).to(torch.bfloat16)
        torch.testing.assert_close(decode_linear(wrapped, x), wrapped(x))
        hooked = nn.Linear(16, 8).to(torch.bfloat16)
        hooked.register_forward_hook(lambda module, args, out: out * 0)
        assert torch.equal(decode_linear(hooked, x), torch.zeros(1, 8, dtype=torch.bfloat16))
    plain = nn.Linear(16, 8).to(torch.bfloat16)
    assert decode_linear(plain, x).requires_grad  # with gradients: the module's graph


def test_cached_from_parameters_rebuilds_after_in_place_update():
    owner = nn.Linear(4, 4)
    built = []

    def build():
        built.append(1)
        return owner.weight.detach() * 2

    with torch.no_grad():
        first = cached_from_parameters(owner, "double", build, owner.weight)
        assert cached_from_parameters(owner, "double", build, owner.weight) is first and len(built) == 1
        owner.weight.add_(1)
        second = cached_from_parameters(owner, "double", build, owner.weight)
    assert len(built) == 2 and torch.equal(second, owner.weight * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_theta_shift_rotation_equals_forward(dtype):
    shift = DenseRetNetThetaShift(head_dim=16, rope_theta=10000.0)
    x = torch.randn(3, 1, 2, 16, dtype=dtype)
    positions = torch.tensor([[0], [5], [1234]])
    rotated = shift.rotate(x, shift.rotation(positions, dtype)[:, :, None])
    torch.testing.assert_close(rotated, shift(x, positions))


@pytest.mark.parametrize("family", ["densemamba", "denseretnet"])
def test_decode_of_a_model_cast_under_inference_mode(family):
    """Parameters cast under ``torch.inference_mode`` are inference tensors (no version counter): nothing is kept
    for them, and decoding still equals the full forward."""
    model = micro_model(family)
    ids = random_ids(2, 8)
    with torch.inference_mode():
        model = model.to(torch.bfloat16)
        assert next(model.parameters()).is_inference()
        full = model(ids).logits
        decoded = _decode_logits(model, ids, None, prefill=4)
    _assert_close_relative(decoded, full, torch.bfloat16, "inference-mode cast")
