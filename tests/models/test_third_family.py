"""A third family touches only the places docs/contributing.md lists ("Adding a family"): in a copy of the package,
a throwaway family (DenseMamba's blocks with the state target by default, registered as its own ``model_type``) is
added by two new files, one line each in ``configuration/__init__.py`` and ``modeling/__init__.py``, and the
generated remote code; nothing shared is edited. It then builds through the Auto classes, trains a step, generates
over its cache, refuses another family's cache, saves and loads with the package and as remote code without it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFIG_FILE = '''"""A throwaway third family for tests/models/test_third_family.py."""

from .configuration_densemamba import DenseMambaConfig


class DenseMambaStateConfig(DenseMambaConfig):
    """DenseMamba with the paper's state-level fusion (Eq. 14) by default."""

    model_type = "densemambastate"
    dense_defaults = {"dense_layers": 2, "dense_target": "state"}
    presets = {}

    def __init__(self, **kwargs):  # a config class defines __init__: transformers 5.24 rewrites one that does not
        super().__init__(**kwargs)
'''

MODELING_FILE = '''"""A throwaway third family for tests/models/test_third_family.py."""

from ..configuration.configuration_densemambastate import DenseMambaStateConfig
from .modeling_densemamba import (
    DenseMambaForCausalLM, DenseMambaForSequenceClassification, DenseMambaModel, DenseMambaPreTrainedModel,
)


class DenseMambaStatePreTrainedModel(DenseMambaPreTrainedModel):
    config_class = DenseMambaStateConfig


class DenseMambaStateModel(DenseMambaModel):
    config_class = DenseMambaStateConfig


class DenseMambaStateForCausalLM(DenseMambaForCausalLM):
    config_class = DenseMambaStateConfig
    backbone_class = DenseMambaStateModel


class DenseMambaStateForSequenceClassification(DenseMambaForSequenceClassification):
    config_class = DenseMambaStateConfig
    backbone_class = DenseMambaStateModel


__all__ = [
    "DenseMambaStateForCausalLM", "DenseMambaStateForSequenceClassification", "DenseMambaStateModel",
    "DenseMambaStatePreTrainedModel",
]
'''

PACKAGE_SCRIPT = r"""
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
import hf_densessm
from hf_densessm.modeling.cache_names import output_cache

config = AutoConfig.for_model("densemambastate", vocab_size=97, hidden_size=32, num_hidden_layers=3, state_size=8)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
ids = torch.randint(3, 97, (2, 9))
loss = model(ids, labels=ids).loss
loss.backward()
model.eval()
with torch.no_grad():
    out = model(ids, use_cache=True)
    cache = output_cache(out)
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    plain = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    other = hf_densessm.DenseRetNetForCausalLM(hf_densessm.DenseRetNetConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, query_key_dim=16)).eval()
    try:
        model(ids[:, :1], cache=output_cache(other(ids, use_cache=True)), use_cache=True)
        refused = False
    except ValueError:
        refused = True
model.save_pretrained(sys.argv[1])
loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1])
classifier = AutoModelForSequenceClassification.from_config(config)
with torch.no_grad():
    same = torch.allclose(loaded(ids).logits, out.logits, rtol=1.3e-6, atol=1e-5)  # fp32: weights at other addresses
torch.save({"ids": ids, "logits": out.logits, "generated": generated}, sys.argv[2])
state = {f"{kind}{slot}": list(shape) for (kind, slot), shape in config.cache_shapes(2).items()}
held = {f"conv0": list(cache.layers[0].conv_states[0].shape), "recurrent0": list(cache.layers[0].recurrent_states[0].shape)}
print("REPORT" + json.dumps(dict(
    target=config.dense_target, loss=loss.item(), grads=all(p.grad is not None for n, p in model.named_parameters()
                                                              if ".dense_" in n),
    cache_ok=state == held, generated=torch.equal(generated, plain), refused=refused, same=same,
    classifier=type(classifier).__name__, auto_map=json.load(open(sys.argv[1] + "/config.json"))["auto_map"],
)))
"""

REMOTE_SCRIPT = r"""
import json, sys
sys.modules["hf_densessm"] = None
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]
import torch
from transformers import AutoModelForCausalLM
expected = torch.load(sys.argv[2], weights_only=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
with torch.no_grad():
    diff = (model(expected["ids"]).logits - expected["logits"]).abs().max().item()  # its PyTorch path
    generated = torch.equal(model.generate(expected["ids"], max_new_tokens=4, do_sample=False), expected["generated"])
print("REPORT" + json.dumps(dict(cls=type(model).__name__, close=diff < 1e-4, generated=generated)))
"""


def _add_line(path: Path, after: str, line: str) -> None:
    """Insert ``line`` after the first line of ``path`` that starts with ``after`` (the edits a contributor makes)."""
    lines = path.read_text().splitlines(keepends=True)
    index = next(i for i, text in enumerate(lines) if text.startswith(after))
    lines.insert(index + 1, line + "\n")
    path.write_text("".join(lines))


def _report(script: str, *args, env) -> dict:
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.split("REPORT", 1)[1])


@pytest.mark.skipif(not (ROOT / "tools" / "remote_code.py").is_file(), reason="needs the repository's tools/")
def test_a_third_family_touches_only_the_listed_places(tmp_path):
    copy = tmp_path / "repo"
    for part in ("src", "tools"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    package = copy / "src" / "hf_densessm"
    before = {p.relative_to(package): p.read_bytes() for p in package.rglob("*") if p.is_file()}
    # the listed places: two new files, one import per family list, the generated remote code
    (package / "configuration" / "configuration_densemambastate.py").write_text(CONFIG_FILE)
    (package / "modeling" / "modeling_densemambastate.py").write_text(MODELING_FILE)
    _add_line(package / "configuration" / "__init__.py", "from .configuration_denseretnet import",
              "from .configuration_densemambastate import DenseMambaStateConfig")
    init = package / "configuration" / "__init__.py"
    init.write_text(init.read_text().replace('"DenseRetNetConfig"]', '"DenseRetNetConfig", "DenseMambaStateConfig"]'))
    modeling_init = package / "modeling" / "__init__.py"
    _add_line(modeling_init, "from .modeling_denseretnet import *", "from .modeling_densemambastate import *  # noqa")
    modeling_init.write_text(modeling_init.read_text()
                             .replace("from . import modeling_densemamba, modeling_denseretnet",
                                      "from . import modeling_densemamba, modeling_densemambastate, modeling_denseretnet")
                             .replace("FAMILIES = (modeling_densemamba, modeling_denseretnet)",
                                      "FAMILIES = (modeling_densemamba, modeling_denseretnet, modeling_densemambastate)"))
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    subprocess.run([sys.executable, str(copy / "tools" / "remote_code.py"), "--write"], check=True, env=env,
                   capture_output=True, timeout=600)
    changed = sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()
                     and "__pycache__" not in p.parts and before.get(p.relative_to(package)) != p.read_bytes())
    listed = {"configuration/__init__.py", "modeling/__init__.py", "configuration/configuration_densemambastate.py",
              "modeling/modeling_densemambastate.py"}
    assert {c for c in changed if not c.startswith("hub/remote_code/")} == listed
    manifest = json.loads((package / "hub" / "remote_code" / "manifest.json").read_text())
    assert "modeling_densemambastate.py" in manifest["families"]["densemambastate"]["files"]

    folder = tmp_path / "saved"
    report = _report(PACKAGE_SCRIPT, str(folder), str(tmp_path / "expected.pt"), env=env)
    assert report["target"] == "state" and report["grads"] and report["cache_ok"] and report["generated"]
    assert report["refused"] and report["same"] and report["classifier"] == "DenseMambaStateForSequenceClassification"
    assert report["auto_map"]["AutoModelForCausalLM"] == "modeling_densemambastate.DenseMambaStateForCausalLM"
    remote = _report(REMOTE_SCRIPT, str(folder), str(tmp_path / "expected.pt"), env={**os.environ, "PYTHONPATH": ""})
    assert remote == dict(cls="DenseMambaStateForCausalLM", close=True, generated=True)
