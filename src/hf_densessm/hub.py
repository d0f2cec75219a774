"""Self-contained Hub folders: what ``save_pretrained`` / ``push_to_hub`` write for a DenseSSM model.

A saved folder is a complete model repository that loads with ``trust_remote_code=True`` where ``hf_densessm`` is
not installed (DESIGN.md §5):

- ``config.json`` with ``auto_map`` (``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM``),
- the weights as safetensors (tied ``lm_head`` handled by transformers),
- the modeling code: every package module the model needs, kernels included, as flat files
  (``modeling/modeling_densemamba.py`` -> ``modeling_densemamba.py``, ``ops/selective_scan/naive.py`` ->
  ``ops_selective_scan_naive.py``, ``ops/selective_scan/__init__.py`` -> ``ops_selective_scan.py``) whose package
  imports are rewritten to same-folder relative imports: transformers' remote-code loader copies only the class's
  file and the files it imports that way (``dynamic_module_utils.get_relative_import_files``),
- a model card ``README.md`` (architecture, config knobs, how to load).

The module list is not kept by hand: it is the closure of the package imports (read with ``ast``) of the model's
and config's modules, lazy imports inside functions included (the Triton kernels). Top-level imports of optional
packages (``triton``) are wrapped in ``try``: on a Hub download transformers' ``check_imports`` requires every other
import to be installed, and the kernel files are only imported when a Triton backend runs.

Saving is atomic: everything is written to a temporary folder next to the target, which then replaces the target
(entries of an old target that the new save does not write, e.g. a tokenizer, are kept). A failed save leaves the
target absent or as it was. The same code runs inside a loaded remote-code bundle, so a model loaded with
``trust_remote_code=True`` saves a complete folder too.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from transformers.utils import logging

logger = logging.get_logger(__name__)

# The package this file belongs to: "hf_densessm", or the transformers_modules package of a loaded bundle.
ROOT_PACKAGE = __name__.rpartition(".")[0]
ROOT_DIR = Path(__file__).resolve().parent
BUNDLE_MARKER = "# hf_densessm bundle:"  # first line of every bundled code file
CARD_MARKER = "<!-- hf_densessm model card -->"
OPTIONAL_PACKAGES = ("triton",)  # imported only when a kernel runs; never required to load a bundle
# transformers' own patterns for the files a remote-code module needs (dynamic_module_utils.get_relative_imports)
_TRANSFORMERS_RELATIVE_IMPORTS = (
    re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
    re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE),
)
_IMPORT_HEAD = re.compile(r"from\s+[\w.]+\s+import")
AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")


class BundleError(RuntimeError):
    """The package's code cannot be bundled into a flat remote-code folder (the message says which import)."""


def flat_module_name(module: str) -> str:
    """The flat file stem (no ``.py``) of package module ``module`` inside a saved folder.

    ``hf_densessm.modeling.modeling_densemamba`` -> ``modeling_densemamba``; ``hf_densessm.configuration.dense`` ->
    ``configuration_dense``; ``hf_densessm.ops.selective_scan.naive`` -> ``ops_selective_scan_naive``;
    ``hf_densessm.ops.selective_scan`` (a package) -> ``ops_selective_scan``. A file whose name already starts
    with its folder's name drops the folder. Inside a loaded bundle the names are already flat and stay as they are.

    Raises:
        BundleError: ``module`` is not a module of this package, or is the package root itself.
    """
    if not module.startswith(ROOT_PACKAGE + "."):
        raise BundleError(f"{module!r} is not a module of {ROOT_PACKAGE!r} (only the package root cannot be bundled).")
    parts = module[len(ROOT_PACKAGE) + 1 :].split(".")
    if len(parts) > 1 and parts[-1].startswith(parts[-2] + "_"):
        del parts[-2]
    return "_".join(parts)


def _module_file(module: str) -> Path:
    """The source file of package module ``module`` (``x/y.py`` or ``x/y/__init__.py``)."""
    base = ROOT_DIR.joinpath(*module[len(ROOT_PACKAGE) + 1 :].split("."))
    for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise BundleError(f"Cannot find the source of {module!r} under {ROOT_DIR}.")


def _resolve_import(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The package module a ``from ... import`` statement of ``module`` imports from, or ``None`` if external."""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        target = f"{package}.{node.module}" if node.module else package
    elif node.module == ROOT_PACKAGE or (node.module or "").startswith(ROOT_PACKAGE + "."):
        target = node.module
    else:
        return None
    if not target.startswith(ROOT_PACKAGE + "."):
        raise BundleError(
            f"{module}, line {node.lineno}: `from {'.' * node.level}{node.module or ''} import ...` imports the "
            f"package root {ROOT_PACKAGE!r}, which is not bundled; import from the defining module instead."
        )
    return target


def _optional_import_groups(tree: ast.Module) -> list[tuple[int, int]]:
    """Line spans ``(first, last)`` (1-based) of runs of top-level imports of :data:`OPTIONAL_PACKAGES`."""
    groups: list[tuple[int, int]] = []
    previous = None
    for index, node in enumerate(tree.body):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        if names and all(name.split(".")[0] in OPTIONAL_PACKAGES for name in names):
            if previous == index - 1:
                groups[-1] = (groups[-1][0], node.end_lineno)
            else:
                groups.append((node.lineno, node.end_lineno))
            previous = index
    return groups


def _bundled_source(module: str) -> tuple[str, set[str]]:
    """The text of ``module`` as a flat bundle file, and the package modules it imports.

    Package imports become ``from .<flat name> import ...``; top-level imports of optional packages are wrapped in
    ``try`` (re-raising with the file's name); a header line marks the file as generated.

    Raises:
        BundleError: an import form the flat layout cannot express (``import hf_densessm.x``, ``from . import
            submodule``) or an import of the package root.
    """
    path = _module_file(module)
    is_package = path.name == "__init__.py"
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    lines = text.splitlines(keepends=True)
    needed: set[str] = set()
    heads = []  # (line index, column, flat name) of every package import to rewrite
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT_PACKAGE or alias.name.startswith(ROOT_PACKAGE + "."):
                    raise BundleError(
                        f"{module}, line {node.lineno}: `import {alias.name}` cannot be bundled; use a relative "
                        "`from .x import name` instead."
                    )
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_import(node, module, is_package)
            if target is None:
                continue
            target_file = _module_file(target)
            if target_file.name == "__init__.py":
                for alias in node.names:
                    if (target_file.parent / f"{alias.name}.py").is_file() or (
                        target_file.parent / alias.name
                    ).is_dir():
                        raise BundleError(
                            f"{module}, line {node.lineno}: importing the submodule {alias.name!r} with "
                            f"`from ... import {alias.name}` cannot be bundled; import names from it instead."
                        )
            needed.add(target)
            heads.append((node.lineno - 1, node.col_offset, flat_module_name(target)))
    for index, column, flat in sorted(heads, reverse=True):
        line = lines[index]
        match = _IMPORT_HEAD.match(line, column)
        if match is None:
            raise BundleError(f"{module}, line {index + 1}: cannot parse the import statement {line.strip()!r}.")
        lines[index] = line[:column] + f"from .{flat} import" + line[match.end() :]
    for first, last in reversed(_optional_import_groups(tree)):
        body = "".join("    " + line if line.strip() else line for line in lines[first - 1 : last])
        lines[first - 1 : last] = [
            f"try:  # {', '.join(OPTIONAL_PACKAGES)}: needed only when a kernel of this file runs\n",
            body,
            "except ImportError as error:\n",
            f'    raise ImportError("{flat_module_name(module)}.py holds Triton kernels and needs the `triton` '
            'package") from error\n',
        ]
    source = "".join(lines)
    if not source.startswith(BUNDLE_MARKER):
        origin = path.relative_to(ROOT_DIR).as_posix()
        source = (
            f"{BUNDLE_MARKER} {ROOT_PACKAGE}/{origin}, imports made flat by hf_densessm.hub; edit the package.\n"
            + source
        )
    return source, needed


def _package_class(cls: type) -> type:
    """The first class in ``cls``'s MRO that is defined in this package."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(ROOT_PACKAGE + "."):
            return klass
    raise BundleError(f"{cls.__name__} is not a model class of {ROOT_PACKAGE!r}.")


def hub_auto_map(model) -> dict[str, str]:
    """The ``auto_map`` of a saved folder: ``{"AutoConfig": "configuration_x.XConfig", "AutoModel":
    "modeling_x.XModel", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}`` (flat module names, as bundled).

    The classes come from the model's module: the one whose name ends in ``ForCausalLM`` and the base model (name
    ending in ``Model``, not ``PreTrainedModel``); the config class is the model class's ``config_class``.

    Raises:
        BundleError: the model's module does not define exactly one of each.
    """
    cls = _package_class(type(model))
    if cls is not type(model):
        logger.warning(
            f"{type(model).__name__} is defined outside {ROOT_PACKAGE}; the saved folder's remote code is that of "
            f"{cls.__name__}."
        )
    module = sys.modules[cls.__module__]
    defined = {
        name: obj for name, obj in vars(module).items() if isinstance(obj, type) and obj.__module__ == module.__name__
    }
    found = {}
    for auto, test in (
        ("AutoModel", lambda n: n.endswith("Model") and not n.endswith("PreTrainedModel")),
        ("AutoModelForCausalLM", lambda n: n.endswith("ForCausalLM")),
    ):
        names = [name for name in defined if test(name)]
        if len(names) != 1:
            raise BundleError(f"{module.__name__} must define exactly one class for {auto}, found {names}.")
        found[auto] = f"{flat_module_name(module.__name__)}.{names[0]}"
    config_class = cls.config_class
    return {
        "AutoConfig": f"{flat_module_name(config_class.__module__)}.{config_class.__name__}",
        **found,
    }


def bundle_sources(model) -> dict[str, str]:
    """The code files of ``model``'s saved folder: ``{file name: text}``, the closure of the package imports of
    the model's and its config's modules (lazy kernel imports included), flattened.

    Raises:
        BundleError: two modules would share a flat name, an import cannot be bundled (see
            :func:`_bundled_source`), or a bundled file would make transformers look for a file that is not
            bundled (e.g. a docstring line that reads like ``from .x import``).
    """
    cls = _package_class(type(model))
    pending = [cls.__module__, cls.config_class.__module__]
    sources: dict[str, str] = {}
    seen: dict[str, str] = {}  # flat name -> module
    while pending:
        module = pending.pop()
        flat = flat_module_name(module)
        if flat in seen:
            if seen[flat] != module:
                raise BundleError(f"{seen[flat]!r} and {module!r} would both be bundled as {flat}.py.")
            continue
        seen[flat] = module
        sources[flat], needed = _bundled_source(module)
        pending.extend(needed)
    for flat, source in sources.items():
        for pattern in _TRANSFORMERS_RELATIVE_IMPORTS:
            for name in pattern.findall(source):
                if name not in sources:
                    raise BundleError(
                        f"{flat}.py has a line transformers reads as an import of .{name}, which is not bundled."
                    )
    return {f"{flat}.py": source for flat, source in sorted(sources.items())}


def write_bundle(model, folder: str | os.PathLike) -> dict[str, str]:
    """Write the code files of ``model`` into ``folder`` and set ``auto_map`` in its ``config.json`` (which
    ``config.save_pretrained`` must have written). Returns the ``auto_map``.

    Raises:
        FileNotFoundError: ``folder`` has no ``config.json``.
        BundleError: see :func:`bundle_sources`, :func:`hub_auto_map`.
    """
    folder = Path(folder)
    auto_map = hub_auto_map(model)
    for name, source in bundle_sources(model).items():
        (folder / name).write_text(source, encoding="utf-8")
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return auto_map


# ---------------------------------------------------------------------------------------------------------- card

_FAMILIES = {
    "densemamba": dict(
        title="DenseMamba",
        architecture=(
            "DenseMamba is Mamba (Gu & Dao 2023; the Mamba-1 block of transformers' `MambaMixer`) with the dense "
            "hidden connection of DenseSSM (He et al. 2024, [arXiv:2403.00818](https://arxiv.org/abs/2403.00818), "
            "§3.3, Table 2). Each block's selective-scan state inputs are fused with those of the `m` blocks below: "
            "`u' = u + sum_i Gate_u(x) * u^(l-i)` and `B' = B + sum_i Gate_B(x) * B^(l-i)`, gates computed from the "
            "block's normalized input `x` (the selective transition and hidden fusion, Eq. 10-17), while `dt` and "
            "`C` come from the un-fused `u`. The dense inputs of a step come from lower layers of the same step, "
            "so decoding keeps the standard Mamba cache and costs O(1) per token. With `dense_layers = 0` the "
            "model is exactly transformers' `MambaForCausalLM` (same parameter names and logits)."
        ),
        knobs=(
            ("hidden_size", "model width `d_model`"),
            ("num_hidden_layers", "number of Mamba blocks"),
            ("state_size", "SSM state size `N` per channel"),
            ("expand", "`intermediate_size = expand * hidden_size`"),
            ("conv_kernel", "width of the causal depthwise convolution"),
            ("time_step_rank", "rank of `dt_proj`"),
            ("vocab_size", "vocabulary size"),
            ("tie_word_embeddings", "`lm_head` tied to the embeddings"),
        ),
    ),
    "denseretnet": dict(
        title="DenseRetNet",
        architecture=(
            "DenseRetNet is RetNet with GAU-style retention blocks (token and channel mixing in one block, no FFN) "
            "and the dense KV connection of DenseSSM (He et al. 2024, "
            "[arXiv:2403.00818](https://arxiv.org/abs/2403.00818), "
            '§3.3 "Extension to RetNet", Table 3). In each block `q = SiLU(W_q x)`, `k = SiLU(W_k x) / sqrt(d_qk/H)`, '
            "`[v, g] = split(SiLU(W_h x))`; blocks with predecessors fuse the keys and values of the `m` blocks "
            "below, `k' = RMSNorm(k + sum_i SiLU(G_k(x)) * k^(l-i))` and likewise `v'` (Eq. 20-23); rotary theta "
            "shift on `q`, `k'`; multi-scale retention `S_t = gamma_h S_(t-1) + k'_t^T v'_t`, `o_t = q_t S_t` with "
            "`gamma_h = 1 - 2^(-5-h)` (Eq. 18, 19, 24); per-head RMSNorm; `W_o(norm(o) * g)`. Training and prefill "
            "run the chunkwise form, decoding the recurrent form (O(1) per token)."
        ),
        knobs=(
            ("hidden_size", "model width `d`"),
            ("num_hidden_layers", "number of retention blocks"),
            ("num_attention_heads", "retention heads `H`, each with its own decay"),
            ("query_key_dim", "total query/key width `d_qk`"),
            ("v_factor", "value/gate width `d_v = v_factor * d`"),
            ("rms_norm_eps", "epsilon of every RMSNorm"),
            ("dropout", "dropout on each block's output"),
            ("vocab_size", "vocabulary size"),
            ("tie_word_embeddings", "`lm_head` tied to the embeddings"),
        ),
    ),
}
_DENSE_KNOBS = (
    ("dense_layers", "`m`, how many preceding layers feed each layer (0: the plain base model)"),
    ("dense_projection", "`Proj` of Eq. 15: identity or linear (Table 5)"),
    ("dense_selection", "`Gate` of Eq. 16: mlp, linear or none (Table 5)"),
    ("dense_shared_gate", "one gate shared by the `m` predecessors, or one each (Table 7)"),
    ("dense_fusion", "hidden fusion: add (Eq. 17) or concat + linear reduction (Table 8)"),
    ("dense_every", "dense connection on every k-th layer (Table 9)"),
    ("dense_gate_hidden_size", "hidden width of the MLP gate"),
    ("kernel_backend", "auto (Triton on CUDA, PyTorch otherwise), triton or torch"),
)
_CITATION = """@article{he2024densessm,
  title   = {DenseMamba: State Space Models with Dense Hidden Connection for Efficient Large Language Models},
  author  = {He, Wei and Han, Kai and Tang, Yehui and Wang, Chengcheng and Yang, Yujie and Guo, Tianyu and Wang, Yunhe},
  journal = {arXiv preprint arXiv:2403.00818},
  year    = {2024}
}"""


def model_card(model, files: list[str], repo_id: str | None = None, tags: list[str] | None = None) -> str:
    """The ``README.md`` text of a saved DenseSSM folder: Hub metadata, architecture, every config knob with its
    value, how to load and generate (with and without the package), the files, the citation.

    Args:
        model: the saved model (its ``config`` and parameter count are described).
        files: the folder's file names, listed in the card.
        repo_id: the Hub repository (or folder) shown in the loading example; a placeholder when ``None``.
        tags: extra Hub tags.

    Raises:
        BundleError: no card template for ``model.config.model_type``.
    """
    config = model.config
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise BundleError(f"No model card template for model_type {config.model_type!r}.")
    where = repo_id or "path/to/this/folder"
    all_tags = ["densessm", config.model_type] + [t for t in (tags or []) if t]
    rows = "\n".join(
        f"| `{name}` | `{getattr(config, name, None)!r}` | {meaning} |"
        for name, meaning in family["knobs"] + _DENSE_KNOBS
    )
    code = [name for name in files if name.endswith(".py")]
    weights = [name for name in files if name.endswith((".safetensors", ".safetensors.index.json"))]
    bos = config.bos_token_id if config.bos_token_id is not None else 0
    count = model.num_parameters()
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
{chr(10).join(f"- {tag}" for tag in dict.fromkeys(all_tags))}
---
{CARD_MARKER}

# {family["title"]} ({size} parameters)

{family["architecture"]}

## Configuration

| field | value | meaning |
|---|---|---|
{rows}

## How to load

The modeling code is in this repository, so no package is needed:

```python
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)
input_ids = torch.tensor([[{bos}, 450, 4996]])  # token ids from the model's tokenizer
out = model.generate(input_ids, max_new_tokens=32)  # greedy, sampling, beam search, left-padded batches
```

With the `hf_densessm` package installed, `import hf_densessm` registers `{config.model_type}` with the `Auto`
classes and the same call works without `trust_remote_code` (the package's classes are then used). On CUDA with
`triton` installed the fused Triton kernels run; elsewhere the vectorized PyTorch path does
(`kernel_backend` in the config).

## Files

- `config.json`: the configuration, with `auto_map` pointing at the bundled classes
  ({", ".join(f"`{auto}`" for auto in AUTO_CLASSES)}).
- {", ".join(f"`{name}`" for name in weights) or "no weights"}: the weights (safetensors).
- {", ".join(f"`{name}`" for name in code)}: the modeling code, generated from the `hf_densessm` package with
  its imports made flat (edit the package, not these files).

## Citation

```bibtex
{_CITATION}
```
"""


def write_model_card(
    model, folder: str | os.PathLike, repo_id: str | None = None, tags: list[str] | None = None
) -> Path:
    """Write :func:`model_card` as ``folder/README.md`` (listing the files already in ``folder``); returns its path."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md")
    path = folder / "README.md"
    path.write_text(model_card(model, files, repo_id=repo_id, tags=tags), encoding="utf-8")
    return path


# -------------------------------------------------------------------------------------------------- atomic save


def _is_stale(path: Path, variant: str | None) -> bool:
    """Whether an entry of an old save is replaced (not kept) by a new save: weights of the same variant
    (``model[-0000k-of-0000n].safetensors``, its index) and generated code files / model card."""
    v = re.escape(f".{variant}") if variant else ""
    if re.fullmatch(rf"model{v}(-\d{{5}}-of-\d{{5}})?\.safetensors|model\.safetensors\.index{v}\.json", path.name):
        return True
    if path.is_file() and path.suffix in (".py", ".md"):
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
        return head.startswith(BUNDLE_MARKER) or CARD_MARKER in head
    return False


@contextlib.contextmanager
def staged_folder(save_directory: str | os.PathLike, variant: str | None = None):
    """Write a folder atomically: yields an empty staging folder next to ``save_directory``; on a clean exit the
    staging folder replaces ``save_directory``, keeping the entries of an old ``save_directory`` that the new
    content does not have (unless :func:`_is_stale`); on an exception it is deleted and ``save_directory`` is left
    absent or as it was.

    Yields ``(staging: Path, previous: Path | None)``, ``previous`` the existing target folder, if any.

    When the current working directory is inside ``save_directory`` (``save_pretrained(".")``), the folder cannot
    be swapped; the new entries are then moved in one by one (each move is atomic, the whole is not).

    Raises:
        NotADirectoryError: ``save_directory`` exists and is not a folder.
    """
    target = Path(os.path.realpath(save_directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"Cannot save into {str(save_directory)!r}: it exists and is not a folder.")
    target.parent.mkdir(parents=True, exist_ok=True)
    previous = target if target.exists() else None
    staging = target.with_name(f".{target.name}.saving-{uuid.uuid4().hex[:8]}")
    staging.mkdir()  # (not tempfile.mkdtemp, whose mode 0700 the saved folder would keep)
    try:
        yield staging, previous
        if previous is None:
            os.rename(staging, target)
        elif Path.cwd() == target or target in Path.cwd().parents:
            _move_entries_in(staging, target, variant)
        else:
            _swap_in(staging, target, variant)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, target: Path, variant: str | None) -> None:
    """Move the old target's kept entries into ``staging``, then swap ``staging`` in; undo on failure."""
    moved: list[str] = []
    backup = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        for entry in sorted(target.iterdir()):
            if not (staging / entry.name).exists() and not _is_stale(entry, variant):
                os.rename(entry, staging / entry.name)
                moved.append(entry.name)
        os.rename(target, backup)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(backup, target)
            raise
    except BaseException:
        for name in moved:
            os.rename(staging / name, target / name)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _move_entries_in(staging: Path, target: Path, variant: str | None) -> None:
    """Fallback of :func:`staged_folder` when the target cannot be swapped: replace entry by entry."""
    for entry in target.iterdir():
        if not (staging / entry.name).exists() and _is_stale(entry, variant):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    for entry in staging.iterdir():
        destination = target / entry.name
        if destination.is_dir() and not destination.is_symlink():
            shutil.rmtree(destination)
        os.replace(entry, destination)


# ------------------------------------------------------------------------------------------------------- mixin


class DenseSSMHubMixin:
    """Makes ``save_pretrained`` / ``push_to_hub`` of a DenseSSM model write a self-contained, atomic Hub folder.

    A base class of ``DenseMambaPreTrainedModel`` and ``DenseRetNetPreTrainedModel`` (before ``PreTrainedModel``).
    """

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        **kwargs,
    ):
        """``PreTrainedModel.save_pretrained``, plus the bundled modeling code, ``auto_map`` and the model card,
        all written atomically (see :func:`staged_folder`). Arguments as transformers'; ``push_to_hub=True``
        (with ``repo_id``, ``commit_message``, ``private``, ``token``, ... as transformers takes them) then runs
        :meth:`push_to_hub`. Processes with ``is_main_process=False``, ``distributed_checkpoint=True`` saves and
        adapter saves (a model with PEFT adapters loaded saves only the adapters) are left to transformers unchanged.

        An existing ``README.md`` that this package did not write (a card you edited) is kept.

        Raises:
            NotADirectoryError: ``save_directory`` is a file.
            BundleError: the code cannot be bundled (a packaging bug; nothing is written).
        """
        if (
            not is_main_process
            or kwargs.get("distributed_checkpoint", False)
            or getattr(self, "_hf_peft_config_loaded", False)
        ):
            return super().save_pretrained(
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                push_to_hub=push_to_hub,
                **kwargs,
            )
        hub_kwargs = {
            key: kwargs.pop(key)
            for key in ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")
            if key in kwargs
        }
        with staged_folder(save_directory, kwargs.get("variant")) as (staging, previous):
            super().save_pretrained(staging, is_main_process=True, state_dict=state_dict, **kwargs)
            write_bundle(self, staging)
            old_card = previous / "README.md" if previous is not None else None
            if old_card is None or not old_card.is_file() or _is_stale(old_card, None):
                write_model_card(self, staging)
        if push_to_hub:
            repo_id = hub_kwargs.pop("repo_id", Path(save_directory).resolve().name)
            self.push_to_hub(
                repo_id, token=kwargs.get("token"), max_shard_size=kwargs.get("max_shard_size", "50GB"), **hub_kwargs
            )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ):
        """Upload the model to the Hub repository ``repo_id`` (created if needed) as one commit: the folder
        :meth:`save_pretrained` writes, with the model card naming ``repo_id``. Same arguments and return value
        (the commit info) as transformers' ``push_to_hub``; the difference is the card: transformers replaces
        ``README.md`` by a generic template, here the DenseSSM card is uploaded, unless the repository already has
        a ``README.md`` (kept, as transformers keeps it).

        Raises:
            huggingface_hub errors: no network, no token, no write access.
        """
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
        has_card = api.file_exists(repo_id, "README.md", revision=revision)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [tag for tag in (getattr(self, "model_tags", None) or []) if tag not in tags]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "repo"
            self.save_pretrained(folder, max_shard_size=max_shard_size)
            if has_card:
                (folder / "README.md").unlink(missing_ok=True)
            else:
                write_model_card(self, folder, repo_id=repo_id, tags=tags)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                commit_message=commit_message or "Upload model",
                commit_description=commit_description,
                revision=revision,
                create_pr=create_pr,
            )


__all__ = [
    "BundleError",
    "DenseSSMHubMixin",
    "bundle_sources",
    "flat_module_name",
    "hub_auto_map",
    "model_card",
    "staged_folder",
    "write_bundle",
    "write_model_card",
]
