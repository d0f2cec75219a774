"""Checkpoint conversion (hf_densessm.convert): upcycling a transformers Mamba into DenseMamba (same logits, trainable
gates), the authors' DenseRetNet checkpoints (checked against an independent forward pass written from
docs/design.md §3), Hub repository ids, the command line, and bad input."""

import json
import os
import subprocess
import sys

import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MambaConfig, MambaForCausalLM

from hf_densessm import DenseMambaForCausalLM, DenseRetNetForCausalLM
from hf_densessm.convert import densemamba_from_mamba, denseretnet_from_official
from hf_densessm.convert.__main__ import main
from helpers import VOCAB, random_ids
from test_hub import hub_cache_repo

# ------------------------------------------------------------------------------------------ Mamba -> DenseMamba


@pytest.fixture(scope="module")
def mamba():
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4)
    return MambaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def mamba_folder(mamba, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mamba")
    mamba.save_pretrained(folder)
    return folder


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_upcycled_densemamba_equals_the_mamba(mamba, mamba_folder):
    ids = random_ids(2, 11)
    reference = logits(mamba, ids)
    plain = densemamba_from_mamba(mamba, dense_layers=0)
    for src in (mamba, mamba_folder, str(mamba_folder)):
        dense = densemamba_from_mamba(src, dense_layers=2)
        assert isinstance(dense, DenseMambaForCausalLM) and not dense.training
        assert dense.config.dense_layers == 2 and dense.backbone.layers[1].mixer.dense_u is not None
        out = logits(dense, ids)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)  # float32 rounding of the two scans
        torch.testing.assert_close(out, logits(plain, ids), atol=0, rtol=0)  # closed gates add exactly nothing
    assert dense.lm_head.weight is dense.backbone.embeddings.weight  # still tied


def test_sharded_mamba_checkpoint(mamba, tmp_path):
    mamba.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = random_ids(1, 5)
    torch.testing.assert_close(
        logits(densemamba_from_mamba(tmp_path, dense_layers=1), ids), logits(mamba, ids), atol=1e-5, rtol=1e-5
    )


def _gate_output_layers(model):
    return [
        gate.output_layer()
        for layer in model.backbone.layers
        for connection in (layer.mixer.dense_u, layer.mixer.dense_B)
        if connection is not None
        for gate in connection.gate_modules()
    ]


@pytest.mark.parametrize("shared", [True, False])
def test_upcycled_gates_learn(mamba, shared):
    dense = densemamba_from_mamba(mamba, dense_layers=2, dense_shared_gate=shared).train()
    ids = random_ids(4, 12, seed=5)
    base = logits(dense, ids)
    closed = _gate_output_layers(dense)
    assert closed and all(torch.count_nonzero(layer.weight) == 0 for layer in closed)
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    dense(ids, labels=ids).loss.backward()
    # with a zero last layer the first layer's gradient is zero at step 0; the last layer's is not
    assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0 for layer in closed)
    optimizer.step()
    assert all(torch.count_nonzero(layer.weight) > 0 for layer in closed)
    dense.eval()
    assert (logits(dense, ids) - base).abs().max() > 1e-6


def test_concat_fusion_starts_as_a_no_op_and_learns(mamba):
    dense = densemamba_from_mamba(mamba, dense_layers=2, dense_fusion="concat").train()
    ids = random_ids(2, 9)
    torch.testing.assert_close(logits(dense, ids), logits(mamba, ids), atol=1e-5, rtol=1e-5)
    dense(ids, labels=ids).loss.backward()
    reduce = dense.backbone.layers[2].mixer.dense_u.reduce
    size = reduce.weight.shape[0]
    assert reduce.weight.grad[:, size:].abs().sum() > 0  # the block that starts at zero is learned


def test_gateless_add_cannot_be_upcycled(mamba):
    with pytest.raises(ValueError, match="dense_selection='none' with dense_fusion='add' has no gate"):
        densemamba_from_mamba(mamba, dense_layers=2, dense_selection="none")


def test_only_dense_knobs_are_accepted(mamba):
    with pytest.raises(TypeError, match=r"only the dense knobs .* got \['hidden_size'\]"):
        densemamba_from_mamba(mamba, hidden_size=64)
    with pytest.raises(TypeError, match="must be a transformers Mamba model or a folder"):
        densemamba_from_mamba(42)


def _copy_folder(src, dst):
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def test_bad_mamba_folders(mamba_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist or is not a folder"):
        densemamba_from_mamba(tmp_path / "nowhere")

    no_config = _copy_folder(mamba_folder, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        densemamba_from_mamba(no_config)

    no_weights = _copy_folder(mamba_folder, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights: looked for model.safetensors"):
        densemamba_from_mamba(no_weights)

    other = _copy_folder(mamba_folder, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="has model_type 'llama'; expected 'mamba'"):
        densemamba_from_mamba(other)

    renamed = _copy_folder(mamba_folder, tmp_path / "renamed")
    weights = load_file(renamed / "model.safetensors")
    weights["backbone.layers.1.mixer.extra_proj.weight"] = torch.zeros(2)
    del weights["backbone.layers.3.mixer.D"]
    weights["backbone.norm_f.weight"] = torch.ones(5)
    save_file(weights, renamed / "model.safetensors")
    with pytest.raises(ValueError) as error:
        densemamba_from_mamba(renamed)
    message = str(error.value)
    assert "missing parameters (1):\n  backbone.layers.3.mixer.D" in message
    assert "unexpected parameters (1):\n  backbone.layers.1.mixer.extra_proj.weight" in message
    assert "wrong shapes (1):\n  backbone.norm_f.weight: (5,), expected (32,)" in message


# -------------------------------------------------------------------------------------- the authors' DenseRetNet

OFFICIAL = dict(
    model_type="llama",
    hidden_size=64,
    query_key_dim=32,  # their k_select ends in hidden_size // 2 channels
    num_attention_heads=2,
    num_hidden_layers=3,
    v_factor=2,  # their v_select ends in 2 * hidden_size channels
    dense_block_layers=2,
    rms_norm_eps=1e-6,
    dropout=0.1,
    vocab_size=50,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    # read by nothing in their forward pass
    auto_map={"AutoModelForCausalLM": "modeling_dense_gau_retnet.LlamaForCausalLM"},
    hidden_act="silu",
    max_position_embeddings=2048,
    layernorm_eps=1e-5,
    retnorm=False,
    deepnorm=False,
    torch_dtype="float16",
)


def official_state_dict(config=OFFICIAL, layer0_dense=True, rel_pos=True, seed=0):
    """Random weights under the authors' parameter names and shapes (docs/hub_and_conversion.md; their group_norm
    weight is one vector of d_v / H shared by the heads, their gates d -> d // 32 -> d // 2 and d -> d // 32 -> 2 d)."""
    g = torch.Generator().manual_seed(seed)
    d, dqk, heads = config["hidden_size"], config["query_key_dim"], config["num_attention_heads"]
    dv = int(config["v_factor"] * d)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    def norm(size):
        return 1 + 0.2 * torch.randn(size, generator=g)

    sd = {"model.embed_tokens.weight": w(config["vocab_size"], d, scale=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(d)
        a = p + "self_attn."
        sd[a + "q_proj.weight"] = w(dqk, d)
        sd[a + "k_proj.weight"] = w(dqk, d)
        sd[a + "to_hidden.0.weight"] = w(2 * dv, d)
        sd[a + "to_out.0.weight"] = w(d, dv)
        sd[a + "group_norm.weight"] = norm(dv // heads)
        if i > 0 or layer0_dense:
            sd[a + "k_select.fc1.weight"] = w(d // 32, d)
            sd[a + "k_select.fc2.weight"] = w(d // 2, d // 32, scale=1.0)
            sd[a + "v_select.fc1.weight"] = w(d // 32, d)
            sd[a + "v_select.fc2.weight"] = w(2 * d, d // 32, scale=1.0)
            sd[a + "k_norm.weight"] = norm(dqk)
            sd[a + "v_norm.weight"] = norm(dv)
    sd["model.norm.weight"] = norm(d)
    sd["lm_head.weight"] = w(config["vocab_size"], d)
    if rel_pos:
        head_dim = dqk // heads
        angle = 1.0 / (10000 ** torch.linspace(0, 1, head_dim // 2))
        sd["model.retnet_rel_pos.angle"] = angle.unsqueeze(-1).repeat(1, 2).flatten()
        sd["model.retnet_rel_pos.decay"] = torch.log(1 - 2 ** (-5 - torch.arange(heads, dtype=torch.float)))
    return sd


def write_official(folder, sd, config=OFFICIAL, fmt="bin"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        save_file(sd, folder / "model.safetensors")
    return folder


def reference_logits(sd, config, ids, published_parallel=False):
    """The DenseRetNet forward pass written from docs/design.md §3 on the authors' names, in float64.

    Each head's output at position ``t`` is divided by ``sqrt(s_t)``, ``s_t = sum_{j<=t} gamma^(t-j)`` (the decay
    mask's rows divided by the square root of their sum, as in both published forms). ``published_parallel`` also
    divides the rows of ``q k^T * decay`` by their absolute sum clamped to [1, 5e4], as the published parallel form
    does (not its recurrent form); the per-head RMSNorm absorbs that up to its eps.
    """
    W = {name: t.double() for name, t in sd.items()}
    d, dqk, heads = config["hidden_size"], config["query_key_dim"], config["num_attention_heads"]
    dv, m, eps = int(config["v_factor"] * d), config["dense_block_layers"], config["rms_norm_eps"]
    hd, hv = dqk // heads, dv // heads
    batch, length = ids.shape

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    theta = 10000.0 ** -torch.linspace(0, 1, hd // 2, dtype=torch.float64)
    angles = (torch.arange(length, dtype=torch.float64)[:, None] * theta).repeat_interleave(2, dim=-1)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

    def theta_shift(x):  # rotate every channel pair (2j, 2j+1) by n * theta_j
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos + rotated * sin

    gamma = 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float64))
    t = torch.arange(length, dtype=torch.float64)
    exponent = (t[:, None] - t[None, :]).clamp(min=0)
    decay = torch.where(t[:, None] >= t[None, :], gamma[:, None, None] ** exponent, torch.zeros(()))  # (H, T, T)
    decay = decay / decay.sum(-1, keepdim=True).sqrt()  # o_t / sqrt(s_t)

    x = W["model.embed_tokens.weight"][ids]
    history = []  # pre-fusion (k, v) of the layers below, oldest first
    for i in range(config["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        h = rms(x, W[f"model.layers.{i}.input_layernorm.weight"])
        q = F.silu(h @ W[a + "q_proj.weight"].T)
        k = F.silu(h @ W[a + "k_proj.weight"].T) * hd**-0.5
        v, g = F.silu(h @ W[a + "to_hidden.0.weight"].T).chunk(2, dim=-1)
        features = (k, v)
        if i >= 1:  # Eq. 20-23, one gate shared by the m predecessors
            gate_k = F.silu(F.silu(h @ W[a + "k_select.fc1.weight"].T) @ W[a + "k_select.fc2.weight"].T)
            gate_v = F.silu(F.silu(h @ W[a + "v_select.fc1.weight"].T) @ W[a + "v_select.fc2.weight"].T)
            for k_past, v_past in history[-m:]:
                k = k + gate_k * k_past
                v = v + gate_v * v_past
            k, v = rms(k, W[a + "k_norm.weight"]), rms(v, W[a + "v_norm.weight"])
        history.append(features)
        qh = theta_shift(q.view(batch, length, heads, hd))
        kh = theta_shift(k.view(batch, length, heads, hd))
        scores = torch.einsum("bthd,bshd->bhts", qh, kh) * decay  # o_t = sum_s gamma^(t-s) (q_t . k_s) v_s
        if published_parallel:
            scores = scores / scores.abs().sum(-1, keepdim=True).clamp(min=1, max=5e4)
        o = torch.einsum("bhts,bshv->bthv", scores, v.view(batch, length, heads, hv))
        o = rms(o, W[a + "group_norm.weight"]).reshape(batch, length, dv)  # per-head RMSNorm
        x = x + (o * g) @ W[a + "to_out.0.weight"].T
    return rms(x, W["model.norm.weight"]) @ W["lm_head.weight"].T


@pytest.mark.parametrize("fmt, layer0_dense, rel_pos", [("bin", True, True), ("safetensors", False, False)])
def test_official_denseretnet_computes_the_published_function(tmp_path, fmt, layer0_dense, rel_pos):
    sd = official_state_dict(layer0_dense=layer0_dense, rel_pos=rel_pos)
    model = denseretnet_from_official(write_official(tmp_path, sd, fmt=fmt))
    assert isinstance(model, DenseRetNetForCausalLM) and not model.training
    config = model.config
    assert (config.dense_layers, config.dropout, config.query_key_dim, config.value_dim) == (2, 0.1, 32, 128)
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.hidden_proj.weight, sd["model.layers.1.self_attn.to_hidden.0.weight"])
    assert torch.equal(attn.o_proj.weight, sd["model.layers.1.self_attn.to_out.0.weight"])
    assert torch.equal(attn.dense_v.gate.fc2.weight, sd["model.layers.1.self_attn.v_select.fc2.weight"])
    assert torch.equal(attn.group_norm.weight, sd["model.layers.1.self_attn.group_norm.weight"])  # shared by heads
    assert model.model.layers[0].self_attn.dense_k is None and not hasattr(model.model.layers[0].self_attn, "k_norm")

    ids = torch.randint(3, OFFICIAL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    ours = logits(model, ids)
    assert torch.isfinite(ours).all() and torch.equal(ours, logits(model, ids))
    torch.testing.assert_close(ours.double(), reference_logits(sd, OFFICIAL, ids), atol=2e-5, rtol=1e-5)
    published = reference_logits(sd, OFFICIAL, ids, published_parallel=True)
    torch.testing.assert_close(ours.double(), published, atol=2e-3, rtol=1e-3)  # equal up to the norm's eps
    # the dense connection matters in this checkpoint: closing the gates changes the function
    closed = {k: torch.zeros_like(v) if "_select.fc2" in k else v for k, v in sd.items()}
    assert (reference_logits(sd, OFFICIAL, ids) - reference_logits(closed, OFFICIAL, ids)).abs().max() > 1e-2


def test_official_denseretnet_m1_tied(tmp_path):
    config = {**OFFICIAL, "dense_block_layers": 1, "tie_word_embeddings": True, "dropout": 0.0}
    sd = official_state_dict(config)
    del sd["lm_head.weight"]
    model = denseretnet_from_official(write_official(tmp_path, sd, config, fmt="safetensors"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(3, 50, (1, 7), generator=torch.Generator().manual_seed(1))
    tied = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
    torch.testing.assert_close(logits(model, ids).double(), reference_logits(tied, config, ids), atol=2e-5, rtol=1e-5)


def test_official_denseretnet_bad_input(tmp_path):
    sd = official_state_dict()

    extra = {**sd, "model.layers.1.self_attn.extra.weight": torch.zeros(3), "score.weight": torch.zeros(2, 64)}
    del extra["model.layers.2.self_attn.k_norm.weight"]
    extra["model.layers.1.self_attn.group_norm.weight"] = torch.ones(128)
    with pytest.raises(ValueError) as error:
        denseretnet_from_official(write_official(tmp_path / "names", extra))
    message = str(error.value)
    assert "missing parameters (1):\n  model.layers.2.self_attn.k_norm.weight" in message
    assert "unexpected parameters (2):\n  model.layers.1.self_attn.extra.weight\n  score.weight" in message
    assert "model.layers.1.self_attn.group_norm.weight: (128,), expected (64,)" in message

    # layer 0 has no predecessors: only its k_select / v_select / k_norm / v_norm are optional
    no_layer1_gate = dict(sd)
    del no_layer1_gate["model.layers.1.self_attn.v_select.fc1.weight"]
    with pytest.raises(ValueError, match=r"missing parameters \(1\):\n  model.layers.1.self_attn.v_select.fc1.weight"):
        denseretnet_from_official(write_official(tmp_path / "layer1", no_layer1_gate))

    wrong_angles = {**sd, "model.retnet_rel_pos.angle": sd["model.retnet_rel_pos.angle"] * 2}
    with pytest.raises(ValueError, match="model.retnet_rel_pos.angle of .* differs from the published definition"):
        denseretnet_from_official(write_official(tmp_path / "angles", wrong_angles))

    for change, pattern in (
        ({"model_type": "mamba"}, "has model_type 'mamba'; expected 'llama' with the DenseRetNet keys"),
        ({"model_type": "denseretnet"}, "already an hf_densessm model"),
        ({"dense_block_layers": 0}, r"`dense_block_layers` of .* must be an int >= 1"),
    ):
        with pytest.raises(ValueError, match=pattern):
            denseretnet_from_official(write_official(tmp_path / "config", sd, {**OFFICIAL, **change}))
    llama = {k: v for k, v in OFFICIAL.items() if k not in ("query_key_dim", "dense_block_layers")}
    with pytest.raises(
        ValueError, match="not an authors' DenseRetNet config: missing query_key_dim, dense_block_layers"
    ):
        denseretnet_from_official(write_official(tmp_path / "llama", sd, llama))

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        denseretnet_from_official(tmp_path / "broken")
    (tmp_path / "broken" / "config.json").write_text(json.dumps(OFFICIAL))
    (tmp_path / "broken" / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="Cannot read the weights file .*pytorch_model.bin"):
        denseretnet_from_official(tmp_path / "broken")


def test_hub_repository_ids(monkeypatch, mamba, mamba_folder, tmp_path):
    """Both converters take a Hub repository id (read here from a Hub cache snapshot, offline), as
    ``from_pretrained`` does; an id the Hub does not have is transformers' ``OSError``."""
    official = write_official(tmp_path / "official", official_state_dict(), fmt="safetensors")
    hub_cache_repo(tmp_path / "hub", "densessm-test/mamba-micro", mamba_folder)
    hub_cache_repo(tmp_path / "hub", "densessm-test/official-micro", official)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ids = random_ids(2, 6).clamp(max=OFFICIAL["vocab_size"] - 1)
    dense = densemamba_from_mamba("densessm-test/mamba-micro", dense_layers=1)
    torch.testing.assert_close(logits(dense, ids), logits(mamba, ids), atol=1e-5, rtol=1e-5)
    retnet = denseretnet_from_official("densessm-test/official-micro")
    torch.testing.assert_close(logits(retnet, ids), logits(denseretnet_from_official(official), ids), atol=0, rtol=0)
    with pytest.raises(OSError):
        densemamba_from_mamba("densessm-test/absent")


# --------------------------------------------------------------------------------------------------- command line


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "hf_densessm.convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )


def test_cli_converts_both_kinds_into_hub_folders(mamba, mamba_folder, tmp_path):
    """``python -m hf_densessm.convert`` in a subprocess (mamba), and its ``main`` (official-denseretnet)."""
    official = write_official(tmp_path / "official", official_state_dict(), fmt="bin")
    result = run_cli("mamba", mamba_folder, tmp_path / "dm", "--dense-layers", "2", "--no-dense-shared-gate")
    assert result.returncode == 0, result.stderr
    assert "DenseMambaForCausalLM" in result.stdout and "dense_layers=2" in result.stdout
    assert main(["official-denseretnet", str(official), str(tmp_path / "dr")]) == 0  # in-process: one start is enough

    ids = random_ids(2, 8)
    for name, cls in (("dm", "DenseMambaForCausalLM"), ("dr", "DenseRetNetForCausalLM")):
        folder = tmp_path / name
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"].endswith(f".{cls}")
        assert (folder / "model.safetensors").is_file() and (folder / "README.md").is_file()
    dm = AutoModelForCausalLM.from_pretrained(tmp_path / "dm")
    assert dm.config.dense_shared_gate is False
    torch.testing.assert_close(logits(dm, ids), logits(mamba, ids), atol=1e-5, rtol=1e-5)
    dr = AutoModelForCausalLM.from_pretrained(tmp_path / "dr")
    ids = ids.clamp(max=OFFICIAL["vocab_size"] - 1)
    torch.testing.assert_close(
        logits(dr, ids).double(), reference_logits(official_state_dict(), OFFICIAL, ids), atol=2e-5, rtol=1e-5
    )


def test_cli_errors_write_nothing(tmp_path, capsys):
    assert main(["mamba", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "error: Checkpoint folder" in capsys.readouterr().err
    (tmp_path / "retnet").mkdir()
    (tmp_path / "retnet" / "config.json").write_text(json.dumps(OFFICIAL))
    assert main(["mamba", str(tmp_path / "retnet"), str(tmp_path / "out")]) == 1
    assert "has no weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:
        main(["mamba", "src", "out", "--dense-fusion", "sideways"])
    assert exit_.value.code == 2


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "mamba" in out and "official-denseretnet" in out and "trust_remote_code=True" in out
