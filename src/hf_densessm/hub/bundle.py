"""The remote code of a saved folder: the package modules the model needs as flat files, their package imports made
same-folder ones, and the ``auto_map`` (why: docs/hub_and_conversion.md, "What a saved folder holds")."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_imports
from transformers.models.auto import modeling_auto

ROOT_PACKAGE = __name__.split(".")[0]  # "hf_densessm"
ROOT_DIR = Path(__file__).resolve().parent.parent  # src/hf_densessm
PUBLISHING_PACKAGE = __name__.rpartition(".")[0]  # "hf_densessm.hub": never bundled (a model runs without it)
BUNDLE_MARKER = "# hf_densessm bundle:"  # first line of every bundled code file
_IMPORT_HEAD = re.compile(r"from\s+[\w.]+\s+import")


class BundleError(RuntimeError):
    """The package's code cannot be bundled into a flat remote-code folder (the message says which import)."""


def flat_module_name(module: str) -> str:
    """The flat file stem (no ``.py``) of package module ``module`` inside a saved folder, e.g.
    ``hf_densessm.modeling.cache`` -> ``modeling_cache``, ``hf_densessm.ops.selective_scan`` -> ``ops_selective_scan``;
    a file whose name starts with its folder's name drops the folder (``modeling_densemamba``).

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


def _within(name: str, package: str) -> bool:
    """Whether the dotted ``name`` is ``package`` or a module under it."""
    return name == package or name.startswith(package + ".")


def _resolve_import(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The package module a ``from ... import`` statement of ``module`` imports from, or ``None`` if external."""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
    elif _within(node.module or "", ROOT_PACKAGE):
        target = node.module
    else:
        return None
    if target == ROOT_PACKAGE:
        raise BundleError(
            f"{module}, line {node.lineno}: `from {'.' * node.level}{node.module or ''} import ...` imports the "
            f"package root {ROOT_PACKAGE!r}, which is not bundled; import from the defining module instead."
        )
    return target


def _bundled_source(module: str) -> tuple[str, set[str]]:
    """The text of ``module`` as a flat bundle file, and the package modules it imports.

    Package imports become ``from .<flat name> import ...``; a header line marks the file as generated.

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
                if _within(alias.name, ROOT_PACKAGE):
                    raise BundleError(
                        f"{module}, line {node.lineno}: `import {alias.name}` cannot be bundled; use a relative "
                        "`from .x import name` instead."
                    )
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_import(node, module, is_package)
            if target is None:
                continue
            if _within(target, PUBLISHING_PACKAGE):
                # left as it is, lazy and inside `try` (docs/hub_and_conversion.md, "What a checkpoint ships")
                if node.level:
                    raise BundleError(
                        f"{module}, line {node.lineno}: import the publishing code {PUBLISHING_PACKAGE!r} absolutely "
                        "and inside `try`, so that a saved folder loads and saves without it."
                    )
                continue
            target_file = _module_file(target)
            if target_file.name == "__init__.py":
                for alias in node.names:
                    submodule = target_file.parent / alias.name
                    if submodule.with_suffix(".py").is_file() or submodule.is_dir():
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
    origin = path.relative_to(ROOT_DIR).as_posix()
    header = f"{BUNDLE_MARKER} {ROOT_PACKAGE}/{origin}, imports made flat by hf_densessm.hub; edit the package.\n"
    return header + "".join(lines), needed


def auto_classes(model) -> dict[str, type]:
    """``{"AutoConfig": config class, "AutoModel": base model class, "AutoModelForCausalLM": ..., ...}``: the
    config class of ``model`` and every class of this package registered for it with an ``AutoModel*`` class.

    Raises:
        BundleError: ``model``'s config class is not one of this package's, or no ``AutoModel*`` class maps it to
            a class of this package.
    """
    config_class = type(model.config)
    if not config_class.__module__.startswith(ROOT_PACKAGE + "."):
        raise BundleError(f"{config_class.__name__} is not a config class of {ROOT_PACKAGE!r}.")
    found: dict[str, type] = {"AutoConfig": config_class}
    for name, auto in sorted(vars(modeling_auto).items()):
        mapping = getattr(auto, "_model_mapping", None) if name.startswith("AutoModel") else None
        if mapping is not None and config_class in mapping:
            cls = mapping[config_class]
            if cls.__module__.startswith(ROOT_PACKAGE + "."):
                found[name] = cls
    if len(found) == 1:
        raise BundleError(
            f"No AutoModel class of transformers maps {config_class.__name__} to a class of {ROOT_PACKAGE}."
        )
    return found


def hub_auto_map(model) -> dict[str, str]:
    """The ``auto_map`` of ``model``'s saved folder: ``{"AutoConfig": "configuration_x.XConfig", "AutoModel":
    "modeling_x.XModel", "AutoModelForCausalLM": "modeling_x.XForCausalLM", ...}`` (flat module names, as bundled).

    Raises:
        BundleError: see :func:`auto_classes`.
    """
    return {auto: f"{flat_module_name(cls.__module__)}.{cls.__name__}" for auto, cls in auto_classes(model).items()}


def bundle_sources(model) -> dict[str, str]:
    """The code files of ``model``'s saved folder: ``{file name: text}``, the closure of the package imports of
    the modules of :func:`auto_classes` (lazy kernel imports included), flattened.

    Raises:
        BundleError: two modules would share a flat name, or an import cannot be bundled (see :func:`_bundled_source`).
    """
    pending = sorted({cls.__module__ for cls in auto_classes(model).values()})
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
        pending.extend(sorted(needed))
    return {f"{flat}.py": source for flat, source in sorted(sources.items())}


def write_bundle(model, folder: str | os.PathLike) -> dict[str, str]:
    """Write the code files of ``model`` (:func:`bundle_sources`) into ``folder`` and set ``auto_map`` in its
    ``config.json`` (which ``config.save_pretrained`` must have written). Returns the ``auto_map``.

    Raises:
        FileNotFoundError: ``folder`` has no ``config.json``.
        BundleError: see :func:`bundle_sources`, :func:`hub_auto_map`; or a written file has a line transformers'
            ``get_relative_imports`` reads as an import of a file that is not bundled (e.g. a docstring line that
            reads like ``from .x import``).
    """
    folder = Path(folder)
    auto_map = hub_auto_map(model)
    sources = bundle_sources(model)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for name, source in sources.items():
        (folder / name).write_text(source, encoding="utf-8")
    for name in sources:
        for imported in get_relative_imports(folder / name):
            if f"{imported}.py" not in sources:
                raise BundleError(f"{name} has a line transformers reads as an import of .{imported}, not bundled.")
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return auto_map


def file_head(path: str | os.PathLike, size: int) -> str:
    """The first ``size`` characters of ``path`` if it is a regular file (not a symlink), else ``""``."""
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        return ""
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read(size)


def is_bundled_code(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a code file a save of this package generated (its first line is :data:`BUNDLE_MARKER`)."""
    return Path(path).suffix == ".py" and file_head(path, len(BUNDLE_MARKER)) == BUNDLE_MARKER
