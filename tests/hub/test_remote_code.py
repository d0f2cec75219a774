"""The remote code saved folders ship (docs/hub_and_conversion.md, "What a saved folder holds"): generated at
development time by tools/remote_code.py, committed, current; every import form the package may use written flat and
loaded by transformers' own loader; and one set of ops per process, whatever mix of the installed package and loaded
folders (same or other versions) runs in it (docs/design.md §8)."""

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from hf_densessm import hub
from helpers import FAMILIES, micro_model, random_ids

TOOL = Path(__file__).resolve().parents[2] / "tools" / "remote_code.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("remote_code_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_remote_code_is_current(tool):
    """What ``python tools/remote_code.py --check`` (run by .ci/run) checks: regenerating changes nothing."""
    assert tool.stale() == [], "run python tools/remote_code.py --write"


def test_check_names_a_stale_file(tool, tmp_path):
    shutil.copytree(tool.OUTPUT, tmp_path / "remote_code")
    (tmp_path / "remote_code" / "ops_backend.py.txt").write_text("# edited by hand\n")
    (tmp_path / "remote_code" / "extra.py.txt").write_text("")
    assert tool.stale(tmp_path / "remote_code") == ["extra.py.txt", "ops_backend.py.txt"]


# A package using every import form; fakepkg.native stands for a module remote code does not ship.
FAKE_PACKAGE = {
    "__init__.py": "from .sub.helper import double\nfrom . import sub\nVERSION = 3\n",
    "native.py": "VALUE = 'native'\n",
    "sub/__init__.py": "from .helper import double as twice, FACTOR\n",
    "sub/helper.py": "FACTOR = 5\n\n\ndef double(x):\n    return 2 * x\n",
    "sub/user.py": '''"""Every import form."""
import os
import {pkg}.sub.helper as by_path
from . import helper
from .. import sub
from {pkg} import double
from {pkg}.sub import twice, FACTOR
from .helper import (
    FACTOR as factor,  # a comment
)
try:
    from .. import native
except ImportError:
    native = None
try:
    from ..native import VALUE
except (ValueError, ImportError):
    VALUE = "absent"


class Probe:
    values = (by_path.double(1), helper.double(2), sub.twice(3), double(4), twice(5), FACTOR, factor, VALUE)

    def lazy(self):
        from .helper import double

        return double(6), native is None, os.sep
''',
    "sub/root_alias.py": "import {pkg}.sub.helper\n",
    "sub/unguarded.py": "def f():\n    try:\n        pass\n    finally:\n        from ..native import VALUE\n",
    "sub/root_constant.py": "from {pkg} import VERSION\n",
}


@pytest.fixture
def fake_package(tool, tmp_path, monkeypatch):
    """A fresh package of :data:`FAKE_PACKAGE` (a new name each time) and its :class:`Flattener`."""
    pkg = f"fakepkg_{uuid.uuid4().hex[:8]}"
    for name, text in FAKE_PACKAGE.items():
        path = tmp_path / "src" / pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("{pkg}", pkg))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield pkg, tool.Flattener(pkg, {f"{pkg}.native": "it stands for native code"})
    for name in [name for name in sys.modules if name.split(".")[0] == pkg]:
        del sys.modules[name]


def test_every_import_form_is_written_flat_and_loads_with_transformers(fake_package, tmp_path):
    pkg, flattener = fake_package
    texts = flattener.closure({f"{pkg}.sub.user"})
    assert sorted(texts) == ["sub.py", "sub_helper.py", "sub_user.py"]  # no native, no package root
    user = texts["sub_user.py"]
    source = (tmp_path / "src" / pkg / "sub" / "user.py").read_text()
    assert len(user.splitlines()) == len(source.splitlines()) + 1  # the header; line numbers stay the package's
    assert "from .sub_helper import (\n    FACTOR as factor,  # a comment\n)" in user  # only the head rewritten
    assert "from .sub_helper import double as twice; from .sub import FACTOR\n" in user  # resolved re-export
    assert "    raise ImportError('fakepkg" in user.replace(pkg, "fakepkg")
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, text in texts.items():
        (folder / name).write_text(text)
    script = f"""
import json, sys
sys.modules[{pkg!r}] = None  # remote code runs without the package
from transformers.dynamic_module_utils import get_class_from_dynamic_module
Probe = get_class_from_dynamic_module("sub_user.Probe", {str(folder)!r})
print("REPORT" + json.dumps([Probe.__module__, Probe.values, Probe().lazy()]))
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    module, values, lazy = json.loads(result.stdout.split("REPORT", 1)[1])
    assert module.startswith("transformers_modules.folder.")
    assert values == [2, 4, 6, 8, 10, 5, 5, "absent"] and lazy == [12, True, os.sep]


def test_imports_remote_code_cannot_express_fail_the_generator(tool, fake_package):
    pkg, flattener = fake_package
    with pytest.raises(tool.GeneratorError, match=rf"{pkg}.sub.root_alias, line 1: `import {pkg}.sub.helper` binds"):
        flattener.flatten(f"{pkg}.sub.root_alias")
    with pytest.raises(tool.GeneratorError, match=rf"unguarded, line 5: remote code does not ship {pkg}.native"):
        flattener.flatten(f"{pkg}.sub.unguarded")  # a `finally` block does not catch the ImportError
    with pytest.raises(tool.GeneratorError, match="'VERSION' of the package root is not a module, class or function"):
        flattener.flatten(f"{pkg}.sub.root_constant")


def test_a_line_transformers_would_misread_fails_the_generator(tool):
    texts = {"a.py": '"""Docs.\n\nfrom .b import x\n"""\n'}
    with pytest.raises(tool.GeneratorError, match="would load b.py, which is not generated"):
        tool.check_loadable(texts, {"a.py"})


@pytest.mark.parametrize("family", FAMILIES)
def test_remote_code_ships_no_cpp_build_code(family):
    _, files = hub.remote_code(micro_model(family))
    assert not any("cpu_kernel" in name for name in files)
    for name, path in files.items():
        text = path.read_text()
        assert "cpp_extension" not in text and "csrc" not in text, name


def _add_argument_to_op(path: Path, op: str) -> None:
    """Give op ``op`` of the op file ``path`` a new trailing argument with a default: another schema, the same
    results (what a newer version of the op's module may do)."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "attr", getattr(d.func, "id", "")) in ("triton_op", "custom_op")
            and isinstance(d.args[0], ast.Constant) and d.args[0].value.rpartition("::")[2] == op
            for d in node.decorator_list
        ):
            lines = text.splitlines(keepends=True)
            last = node.args.args[-1]
            line = lines[last.end_lineno - 1]
            lines[last.end_lineno - 1] = line[: last.end_col_offset] + ", hf_densessm_test: int = 0" + \
                line[last.end_col_offset :]
            path.write_text("".join(lines))
            return
    raise AssertionError(f"no op {op!r} in {path}")


MIXED_SCRIPT = r"""
import json, sys
import torch
from torch._library.custom_ops import OPDEFS
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module

job = json.loads(sys.argv[1])
expected = torch.load(job["expected"], weights_only=True)
registered, changed, logits = {}, [], {}


def check_registrations():
    # every hf_densessm op is registered once: the object torch keeps for a name never changes
    for name, opdef in OPDEFS.items():
        if name.startswith("hf_densessm::") and registered.setdefault(name, opdef) is not opdef:
            changed.append(name)


def run(name, model):
    check_registrations()
    ids = expected[name + ".ids"]
    with torch.no_grad():
        logits[name] = (model(ids).logits - expected[name + ".logits"]).abs().max().item()
    model.train()
    model(ids, labels=ids).loss.backward()  # through the autograd formulas the first copy registered
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def remote(folder):
    auto_map = json.load(open(folder + "/config.json"))["auto_map"]
    return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], folder).from_pretrained(folder)


# remote code first (the package not imported yet), then the package, then more folders
run("densemamba", AutoModelForCausalLM.from_pretrained(job["densemamba"], trust_remote_code=True))
import hf_densessm
run("package", AutoModelForCausalLM.from_pretrained(job["densemamba"]))
run("denseretnet", remote(job["denseretnet"]))
run("second", remote(job["second"]))
run("modified", remote(job["modified"]))

copies = {}  # each copy of each op module: {module: {op: registered name}}
for module_name, module in list(sys.modules.items()):
    group = getattr(module, "__dict__", {}).get("_ops")  # no module __getattr__ (transformers' imports lazily)
    if type(group).__name__ == "OpGroup":
        copies[module_name] = {op: getattr(group, op)._qualified_op_name for op in group._specs}
print("REPORT" + json.dumps(dict(changed=changed, logits=logits, copies=copies)))
"""


def test_copies_of_the_same_op_code_share_one_set_of_ops(tmp_path):
    """In one process: a DenseMamba folder loaded as remote code, then the package imported and its model run, a
    DenseRetNet folder, a second DenseMamba folder, and one whose causal_conv1d_backward op has another schema (a
    modified copy). No op is registered twice; the folders' copies of an op module (the same code) use one set of
    ops, the package (other code: its own imports, the C++ entries) its own, the modified copy's causal_conv1d group
    its own; every model gives its eager logits and trains."""
    expected, job = {}, {}
    models = {"densemamba": micro_model("densemamba"), "package": micro_model("densemamba"),
              "denseretnet": micro_model("denseretnet"), "second": micro_model("densemamba", seed=1),
              "modified": micro_model("densemamba", seed=2)}
    for name, model in models.items():
        ids = random_ids(2, 5, seed=len(expected))
        with torch.no_grad():
            expected[f"{name}.ids"], expected[f"{name}.logits"] = ids, model(ids).logits
        if name != "package":
            model.save_pretrained(tmp_path / name)
            job[name] = str(tmp_path / name)
    _add_argument_to_op(tmp_path / "modified" / "ops_causal_conv1d.py", "causal_conv1d_backward")
    torch.save(expected, tmp_path / "expected.pt")
    job["expected"] = str(tmp_path / "expected.pt")
    # the C++ kernel on (where it builds): the package's scan chooses it and runs it in its own ops
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_DENSESSM_CPU_KERNEL", None)
    result = subprocess.run([sys.executable, "-c", MIXED_SCRIPT, json.dumps(job)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    assert report["changed"] == []
    assert all(diff <= 1e-5 for diff in report["logits"].values()), report["logits"]
    copies = report["copies"]
    for op_module in ("selective_scan", "causal_conv1d", "retention"):
        names = {module: ops for module, ops in copies.items() if module.endswith(f"ops_{op_module}")
                 or module == f"hf_densessm.ops.{op_module}"}
        assert len(names) == (2 if op_module == "retention" else 4), sorted(names)  # the package's, the folders'
        suffixes = {}  # each copy's ops are one group: "hf_densessm::<op>_<suffix>", one suffix
        for module, ops in names.items():
            suffixes[module] = next(iter(ops.values())).rpartition("_")[2]
            assert ops == {op: f"hf_densessm::{op}_{suffixes[module]}" for op in ops}, ops
        package = suffixes.pop(f"hf_densessm.ops.{op_module}")  # its own: its code differs from remote code's
        modified = {s for m, s in suffixes.items() if m.startswith("transformers_modules.modified.")}
        folders = {s for m, s in suffixes.items() if not m.startswith("transformers_modules.modified.")}
        assert len(folders) == 1 and package not in folders | modified, suffixes  # same code: one set of ops
        if op_module == "causal_conv1d":  # another schema: its own ops
            assert len(modified) == 1 and modified.isdisjoint(folders), suffixes
        else:
            assert modified <= folders, suffixes
