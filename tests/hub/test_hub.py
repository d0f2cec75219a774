"""Saved folders are self-contained Hub repositories (hf_densessm.hub): the remote code, auto_map and model card;
loading with trust_remote_code where hf_densessm (and triton) cannot be imported, from a folder and from a Hub
cache; atomic saves; what push_to_hub uploads (with a stand-in for the Hub API)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

from hf_densessm import hub
from helpers import FAMILIES, micro_model, random_ids

MODELING = {"densemamba": "modeling_densemamba", "denseretnet": "modeling_denseretnet"}
OPS = {"densemamba": "selective_scan", "denseretnet": "retention"}
# What a remote-code file may import at top level: what transformers itself needs, and the standard library.
ALLOWED_IMPORTS = {"torch", "transformers", "huggingface_hub"} | set(sys.stdlib_module_names)
NON_CODE_FILES = {"config.json", "generation_config.json", "model.safetensors", "README.md"}


def expected_files(family):
    """What a save of a ``family`` micro model writes: the non-code files and the generated remote code (whose
    contents test_bundled_code_is_flat_and_needs_nothing_optional checks)."""
    return NON_CODE_FILES | set(hub.remote_code(micro_model(family))[1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Both families saved once: {family: (model, folder)}."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for family in FAMILIES:
        model = micro_model(family)
        model.save_pretrained(root / family)
        out[family] = (model, root / family)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_holds_config_weights_code_and_card(saved, family):
    model, folder = saved[family]
    assert {p.name for p in folder.iterdir()} == expected_files(family)
    config = json.loads((folder / "config.json").read_text())
    cls = type(model).__name__
    # every Auto class the package registers the family with (heads such as sequence classification included)
    assert config["auto_map"] == hub.remote_code(model)[0]
    assert config["auto_map"].items() >= {
        "AutoConfig": f"configuration_{family}.{type(model.config).__name__}",
        "AutoModel": f"{MODELING[family]}.{cls.replace('ForCausalLM', 'Model')}",
        "AutoModelForCausalLM": f"{MODELING[family]}.{cls}",
    }.items()
    heads = {auto: target for auto, target in config["auto_map"].items() if auto != "AutoConfig"}
    assert all(target.startswith(f"{MODELING[family]}.") for target in heads.values())
    assert config["model_type"] == family
    assert folder.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not the 0700 of a temporary folder


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("family", FAMILIES)
def test_bundled_code_is_flat_and_needs_nothing_optional(saved, family):
    model, folder = saved[family]
    code = sorted(folder.glob("*.py"))
    # transformers copies the class's file and what it imports relatively: that must be every bundled file
    reached = {Path(p).name for p in get_relative_import_files(folder / f"{MODELING[family]}.py")}
    assert reached | {f"{MODELING[family]}.py"} == {p.name for p in code}
    generated = hub.remote_code(model)[1]
    for path in code:
        text = path.read_text()
        assert text.startswith(hub.BUNDLE_MARKER) and path.read_bytes() == generated[path.name].read_bytes()  # verbatim
        relative = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom) and node.level]
        modules = [node.module or alias.name for node in relative for alias in node.names]
        assert all(node.level == 1 for node in relative) and {f"{m}.py" for m in modules} <= set(generated), path.name
        # on a Hub download transformers requires every import outside try blocks to be installed
        assert set(get_imports(path)) <= ALLOWED_IMPORTS, (path.name, set(get_imports(path)) - ALLOWED_IMPORTS)
    # the Triton kernels are bundled (imported lazily by the op's dispatch); `import triton` only inside the `try`
    # of ops_triton_utils.py, from which the kernel files take it
    utils = (folder / "ops_triton_utils.py").read_text()
    assert "\n    import triton\n" in utils and "triton" not in get_imports(folder / "ops_triton_utils.py")
    kernel = folder / f"ops_{OPS[family]}_chunk.py"
    assert "from .ops_triton_utils import" in kernel.read_text() and "triton" not in get_imports(kernel)


@pytest.mark.parametrize("family", FAMILIES)
def test_bundle_holds_the_model_code(saved, family):
    """The bundle is the model's code: its family's modeling, configuration and op files, the shared modules."""
    _, folder = saved[family]
    code = {p.name for p in folder.glob("*.py")}
    assert {f"modeling_{family}.py", f"configuration_{family}.py", "configuration_densessm.py"} <= code
    assert {f"ops_{OPS[family]}.py", f"ops_{OPS[family]}_chunk.py", f"ops_{OPS[family]}_fused_recurrent.py"} <= code
    other = "denseretnet" if family == "densemamba" else "densemamba"
    assert f"modeling_{other}.py" not in code and not any(name.startswith(f"ops_{OPS[other]}") for name in code)
    assert all(hub.is_bundled_code(folder / name) for name in code)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_ships_no_publishing_code(saved, family):
    _, folder = saved[family]
    assert not any(name.name.startswith("hub") for name in folder.glob("*.py"))
    other = "denseretnet" if family == "densemamba" else "densemamba"
    assert not any(other in name.name for name in folder.glob("*.py"))  # nor the other family's code


@pytest.mark.parametrize("family", FAMILIES)
def test_model_card_describes_architecture_knobs_and_loading(saved, family):
    model, folder = saved[family]
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and hub.CARD_MARKER in card
    assert "arXiv:2403.00818" in card and 'from_pretrained("path/to/this/folder", trust_remote_code=True)' in card
    for knob in ("dense_layers", "dense_selection", "dense_fusion", "dense_every", "hidden_size", "num_hidden_layers"):
        assert f"| `{knob}` | `{getattr(model.config, knob)!r}` |" in card
    assert f"`{MODELING[family]}.py`" in card and "`model.safetensors`" in card


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folder_loads_with_the_package_too(saved, family):
    model, folder = saved[family]
    ids = random_ids(2, 7)
    for kwargs in ({}, {"trust_remote_code": True}):  # the registered package classes win over the bundled code
        loaded = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        assert type(loaded) is type(model)
        with torch.no_grad():
            # fp32 tolerance, not bitwise: the loaded weights lie at other addresses, and oneDNN's matmul rounds by
            # address (a copy of one Linear weight at a 12-byte offset moves these logits by 2.4e-7)
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


REMOTE_SCRIPT = """
import json, sys
sys.modules["hf_densessm"] = None  # the package is installed (editable): make it unimportable
sys.modules["triton"] = None       # and load as a machine without triton would
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]
try:
    import hf_densessm
    raise SystemExit("hf_densessm is importable")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM

expected = torch.load(sys.argv[1], weights_only=True)
report = {}
for family, where in json.loads(sys.argv[2]).items():
    for source in ("folder", "hub"):
        model = AutoModelForCausalLM.from_pretrained(where[source], trust_remote_code=True)
        ids = expected[family + ".ids"]
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, max_new_tokens=5, do_sample=False)
        report[f"{family}.{source}"] = dict(
            cls=type(model).__module__ + "." + type(model).__name__,
            config_class=type(model).config_class.__module__ + "." + type(model).config_class.__name__,
            config=type(model.config).__module__ + "." + type(model.config).__name__,
            state=sorted(model.state_dict()),
            logits_diff=(logits - expected[family + ".logits"]).abs().max().item(),
            generated=torch.equal(generated, expected[family + ".generated"]),
        )
    model.save_pretrained(where["resave"])  # a remote-code model saves a complete folder too
report["leaked"] = [name for name, module in sys.modules.items() if "hf_densessm" in name and module is not None]
print("REPORT" + json.dumps(report))
"""


def hub_cache_repo(cache: Path, repo_id: str, folder: Path) -> None:
    """Lay ``folder`` out as a Hub cache snapshot of ``repo_id`` (what a download leaves), for offline loading."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in folder.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_remote_code_loads_and_generates_without_the_package(saved, tmp_path):
    expected, where = {}, {}
    for family, (model, folder) in saved.items():
        ids = random_ids(2, 6, seed=3)
        with torch.no_grad():
            expected[f"{family}.ids"] = ids
            expected[f"{family}.logits"] = model(ids).logits
            expected[f"{family}.generated"] = model.generate(ids, max_new_tokens=5, do_sample=False)
        repo_id = f"densessm-test/{family}-micro"
        hub_cache_repo(tmp_path / "hub", repo_id, folder)
        where[family] = dict(folder=str(folder), hub=repo_id, resave=str(tmp_path / f"resaved-{family}"))
    torch.save(expected, tmp_path / "expected.pt")
    # stand-in compilers first on the PATH: running the remote code must build nothing (it ships no C++ source or
    # build code, so the scan runs its PyTorch path)
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("cc", "c++", "gcc", "g++", "ninja"):
        (tools / tool).write_text(f"#!/bin/sh\necho {tool} >> {tmp_path / 'compiler-called'}\nexit 1\n")
        (tools / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}",
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONPATH": "",
    }
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path / "expected.pt"), json.dumps(where)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (tmp_path / "compiler-called").exists() and not (tmp_path / "extensions").exists()
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    assert report.pop("leaked") == []
    for family, (model, folder) in saved.items():
        for source in ("folder", "hub"):
            entry = report[f"{family}.{source}"]
            assert entry["cls"].startswith("transformers_modules.") and entry["cls"].endswith(
                f".{MODELING[family]}.{type(model).__name__}"
            )
            # the model's config_class is the bundled configuration file's class, in the model's own package
            package = entry["cls"].rsplit(".", 2)[0]
            assert entry["config_class"] == f"{package}.configuration_{family}.{type(model.config).__name__}"
            assert entry["config"].startswith("transformers_modules.") and entry["config"].endswith(
                type(model.config).__name__
            )
            assert entry["state"] == sorted(model.state_dict())
            # same weights, same code, another process: equal up to float32 rounding (the BLAS may block a product
            # differently from run to run; the CPU kernels split channels between threads)
            assert entry["logits_diff"] <= 1e-5
            assert entry["generated"]
        resaved = Path(where[family]["resave"])  # by transformers' custom_object_save: everything but the card
        assert {p.name for p in resaved.iterdir()} == {p.name for p in folder.iterdir()} - {"README.md"}
        assert json.loads((resaved / "config.json").read_text())["auto_map"] == hub.remote_code(model)[0]
        for path in folder.glob("*.py"):
            assert (resaved / path.name).read_bytes() == path.read_bytes(), path.name


def _fail(*args, **kwargs):
    raise RuntimeError("simulated failure mid-save")


def test_failed_save_leaves_no_folder(tmp_path, monkeypatch):
    model = micro_model("densemamba")
    monkeypatch.setattr(hub, "write_model_card", _fail)  # after weights, config and code are written
    with pytest.raises(RuntimeError, match="simulated failure"):
        model.save_pretrained(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_old_folder_and_a_good_save_keeps_other_files(tmp_path, monkeypatch):
    target = tmp_path / "out"
    micro_model("densemamba", seed=0).save_pretrained(target)
    (target / "tokenizer.json").write_text("{}")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    # what saves of earlier versions shipped: the C++ kernel's build code, generated (its first line says so)
    (target / "ops_cpu_kernel.py").write_text(f"{hub.BUNDLE_MARKER} hf_densessm/ops/cpu_kernel.py\n")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    newer = micro_model("densemamba", seed=1)
    with monkeypatch.context() as patch:
        patch.setattr(hub, "write_bundle", _fail)
        with pytest.raises(RuntimeError, match="simulated failure"):
            newer.save_pretrained(target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    newer.save_pretrained(target)
    names = {p.name for p in target.iterdir()}
    assert names == expected_files("densemamba") | {"tokenizer.json"}  # stale shard and code of old saves removed
    assert (target / "model.safetensors").read_bytes() != before["model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    torch.testing.assert_close(reloaded.lm_head.weight, newer.lm_head.weight, atol=0, rtol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_edited_card_is_kept(tmp_path):
    target = tmp_path / "out"
    model = micro_model("denseretnet")
    model.save_pretrained(target)
    (target / "README.md").write_text("# my own card\n")
    model.save_pretrained(target)
    assert (target / "README.md").read_text() == "# my own card\n"


def test_save_into_the_working_directory(tmp_path, monkeypatch):
    target = tmp_path / "out"
    micro_model("densemamba", seed=0).save_pretrained(target)
    (target / "notes.txt").write_text("kept")
    monkeypatch.chdir(target)
    newer = micro_model("densemamba", seed=1)
    newer.save_pretrained(".")
    assert Path.cwd() == target.resolve() and (target / "notes.txt").read_text() == "kept"
    assert {p.name for p in target.iterdir()} == expected_files("densemamba") | {"notes.txt"}
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    torch.testing.assert_close(reloaded.lm_head.weight, newer.lm_head.weight, atol=0, rtol=0)


class FakeHubApi:
    """Stands in for ``huggingface_hub.HfApi``: records the calls and what the uploaded folder holds."""

    calls: list = []
    has_card = False

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False):
        FakeHubApi.calls.append(("create_repo", repo_id, private))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, branch, exist_ok=False):
        FakeHubApi.calls.append(("create_branch", repo_id, branch))

    def file_exists(self, repo_id, filename, revision=None):
        return FakeHubApi.has_card

    def upload_folder(self, repo_id, folder_path, commit_message, commit_description, revision, create_pr):
        files = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        FakeHubApi.calls.append(("upload_folder", repo_id, commit_message, revision, create_pr, files))
        return "commit-info"


@pytest.mark.parametrize("has_card", [False, True])
def test_push_to_hub_uploads_the_saved_folder_with_the_card(monkeypatch, has_card):
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHubApi)
    monkeypatch.setattr(FakeHubApi, "calls", [])
    monkeypatch.setattr(FakeHubApi, "has_card", has_card)
    model = micro_model("denseretnet")
    assert model.push_to_hub("me/tiny-denseretnet", commit_message="first", tags=["demo"]) == "commit-info"
    (name, repo_id, message, revision, create_pr, files) = FakeHubApi.calls[-1]
    assert (name, repo_id, message, revision, create_pr) == (
        "upload_folder",
        "me/tiny-denseretnet",
        "first",
        None,
        False,
    )
    assert set(files) == expected_files("denseretnet") - ({"README.md"} if has_card else set())
    assert (
        json.loads(files["config.json"])["auto_map"]["AutoModelForCausalLM"]
        == "modeling_denseretnet.DenseRetNetForCausalLM"
    )
    if not has_card:
        card = files["README.md"].decode()
        assert 'from_pretrained("me/tiny-denseretnet", trust_remote_code=True)' in card and "- demo\n" in card


def test_save_pretrained_with_push_to_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHubApi)
    monkeypatch.setattr(FakeHubApi, "calls", [])
    micro_model("densemamba").save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/dm", private=True)
    assert FakeHubApi.calls[0] == ("create_repo", "me/dm", True)
    assert FakeHubApi.calls[-1][0] == "upload_folder" and set(FakeHubApi.calls[-1][-1]) == expected_files("densemamba")
    assert {p.name for p in (tmp_path / "out").iterdir()} == expected_files("densemamba")
