"""Generate the remote code that saved folders ship (docs/hub_and_conversion.md, "What a saved folder holds").

    python tools/remote_code.py --write   # after changing the package: regenerate src/hf_densessm/hub/remote_code/
    python tools/remote_code.py --check   # exit status 1, naming the stale files, unless that folder is current (CI)

transformers loads remote code from one flat folder and follows only same-folder relative imports (``from .x import``,
found with a regular expression). For each model type the package registers, this takes the package modules of its
``auto_map`` classes and, recursively, every package module they import (lazy imports included), except
:data:`NOT_SHIPPED`; it writes each as one flat file (``ops/selective_scan/chunk.py`` ->
``ops_selective_scan_chunk.py``) whose package imports are flat imports, every other line unchanged.
``save_pretrained`` copies these files verbatim (docs/design.md §8).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's package, whatever else is installed
from hf_densessm.hub import BUNDLE_MARKER  # noqa: E402  (the first line of every generated file)

OUTPUT = ROOT / "src" / "hf_densessm" / "hub" / "remote_code"
#: Package modules (and packages) remote code does not ship, with the reason: shipped code imports them only inside
#: ``try: ... except ImportError:``, and the generated file raises that ImportError in place of the import.
NOT_SHIPPED = {
    "hf_densessm.hub": "it is the publishing code; a model loaded as remote code saves with transformers' methods",
    "hf_densessm.ops.cpu_kernel": "it builds C++ code, which remote code never does; the PyTorch path runs instead",
}
_HEAD = re.compile(r"from\s+[\w.]+\s+import")
_MISSING = object()


class GeneratorError(RuntimeError):
    """The package's code cannot be written as flat remote-code files (the message names the module, line and why)."""


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


class Flattener:
    """Writes the modules of package ``root`` as flat files; ``not_shipped``: as :data:`NOT_SHIPPED`."""

    def __init__(self, root: str, not_shipped: dict[str, str]):
        self.root = root
        self.not_shipped = not_shipped
        self.root_dir = Path(importlib.import_module(root).__file__).parent

    def flat_name(self, module: str) -> str:
        """``root.modeling.cache`` -> ``modeling_cache``; a file named after its folder drops the folder
        (``root.modeling.modeling_densemamba`` -> ``modeling_densemamba``); a package is its ``__init__.py``."""
        parts = module[len(self.root) + 1 :].split(".")
        if len(parts) > 1 and parts[-1].startswith(parts[-2] + "_"):
            del parts[-2]
        return "_".join(parts)

    def closure(self, modules: set[str]) -> dict[str, str]:
        """``{flat file name: text}`` of ``modules`` and every shipped package module they import, recursively.

        Raises:
            GeneratorError: two modules would share a flat name, or an import cannot be written flat.
        """
        pending, texts, origin = sorted(modules), {}, {}
        while pending:
            module = pending.pop()
            name = f"{self.flat_name(module)}.py"
            if origin.setdefault(name, module) != module:
                raise GeneratorError(f"{origin[name]} and {module} would both be written as {name}.")
            if name not in texts:
                texts[name], needed = self.flatten(module)
                pending.extend(sorted(needed))
        return dict(sorted(texts.items()))

    def flatten(self, module: str) -> tuple[str, set[str]]:
        """The flat text of ``module`` and the package modules it needs. Each package import statement is written
        anew (on its first line, the lines it spanned left blank, so line numbers stay the package's):
        ``from .<flat> import names`` for names, ``from .<flat> import __name__ as x; from . import <flat> as x``
        for a module (the first statement makes transformers ship the file), ``raise ImportError(...)`` for a module
        of ``not_shipped`` (only inside a ``try`` that catches ``ImportError``). A name imported from a package
        ``__init__`` that re-exports a class or function is imported from the module defining it.

        Raises:
            GeneratorError: ``import root.x`` without ``as`` (it binds ``root``, which remote code does not have), a
                name of the package root that is not a module, class or function of a shipped module, a not-shipped
                module imported outside such a ``try``.
        """
        path = Path(importlib.util.find_spec(module).origin)
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        lines = text.splitlines(keepends=True)
        needed: set[str] = set()
        edits = []
        for node in ast.walk(tree):
            where = f"{module}, line {getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                pieces = self._import(node, where)
            elif isinstance(node, ast.ImportFrom):
                pieces = self._import_from(node, package, where)
            else:
                continue
            if pieces is None:
                continue
            if any(piece[0] == "raise" for piece in pieces) and not _guarded(node, parents):
                raise GeneratorError(
                    f"{where}: remote code does not ship {next(p[1] for p in pieces if p[0] == 'raise')}: import it "
                    "inside `try: ... except ImportError:` (where remote code lacks it)."
                )
            needed |= {piece[1] for piece in pieces if piece[0] in ("from", "module")}
            edits.append((node, pieces))
        for node, pieces in sorted(edits, key=lambda edit: (edit[0].lineno, edit[0].col_offset), reverse=True):
            first, last = node.lineno - 1, node.end_lineno - 1
            head = _HEAD.match(lines[first], node.col_offset)
            if isinstance(node, ast.ImportFrom) and len(pieces) == 1 and pieces[0][2] == node.names and head:
                lines[first] = lines[first][: node.col_offset] + f"from .{self.flat_name(pieces[0][1])} import" + \
                    lines[first][head.end() :]
                continue
            statement = "; ".join(self._render(piece) for piece in pieces)
            rest = lines[last][node.end_col_offset :]
            lines[first : last + 1] = [lines[first][: node.col_offset] + statement + rest] + ["\n"] * (last - first)
        origin = path.relative_to(self.root_dir.parent).as_posix()
        header = (f"{BUNDLE_MARKER} generated from {origin} by tools/remote_code.py, its package imports made flat; "
                  "edit that file, then run `python tools/remote_code.py --write`.\n")
        return header + "".join(lines), needed

    def _module(self, module: str, bound: str, where: str) -> tuple:
        """The piece importing package module ``module`` as the name ``bound``."""
        reason = self._reason(module)
        if reason:
            return ("raise", module, reason)
        if module == self.root or importlib.util.find_spec(module) is None:
            raise GeneratorError(f"{where}: {module} is the package root or no module: import names from its modules.")
        return ("module", module, bound)

    def _reason(self, module: str) -> str | None:
        return next((why for name, why in self.not_shipped.items() if _within(module, name)), None)

    def _import(self, node: ast.Import, where: str) -> list[tuple] | None:
        if not any(_within(alias.name, self.root) for alias in node.names):
            return None
        pieces = []
        for alias in node.names:
            if not _within(alias.name, self.root):
                pieces.append(("keep", f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")))
            elif alias.asname is None:
                raise GeneratorError(
                    f"{where}: `import {alias.name}` binds the name {self.root!r}, which remote code does not have: "
                    f"write `import {alias.name} as name` or `from {alias.name} import name`."
                )
            else:
                pieces.append(self._module(alias.name, alias.asname, where))
        return pieces

    def _import_from(self, node: ast.ImportFrom, package: str, where: str) -> list[tuple] | None:
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else \
            node.module
        if not _within(base, self.root):
            return None
        if self._reason(base):
            return [("raise", base, self._reason(base))]
        is_package = base == self.root or Path(importlib.util.find_spec(base).origin).name == "__init__.py"
        pieces = []
        for alias in node.names:
            bound = alias.asname or alias.name
            owner, name = base, alias.name
            if is_package and alias.name != "*":
                value = getattr(importlib.import_module(base), alias.name, _MISSING)
                if value is _MISSING or isinstance(value, ModuleType):
                    module = f"{base}.{alias.name}" if value is _MISSING else value.__name__
                    pieces.append(self._module(module, bound, where))
                    continue
                defined_in = getattr(value, "__module__", None) or ""
                if (inspect.isclass(value) or inspect.isfunction(value)) and _within(defined_in, self.root) and \
                        getattr(importlib.import_module(defined_in), value.__name__, None) is value:
                    owner, name = defined_in, value.__name__
            if owner == self.root:
                raise GeneratorError(f"{where}: {alias.name!r} of the package root is not a module, class or function "
                                     "of a shipped module: import it from the module that defines it.")
            if self._reason(owner):
                pieces.append(("raise", owner, self._reason(owner)))
                continue
            alias = ast.alias(name=name, asname=bound if bound != name else None)
            if pieces and pieces[-1][0] == "from" and pieces[-1][1] == owner:
                pieces[-1][2].append(alias)
            else:
                pieces.append(("from", owner, [alias]))
        if len(pieces) == 1 and pieces[0][0] == "from" and pieces[0][1] == base and \
                [(a.name, a.asname) for a in pieces[0][2]] == [(a.name, a.asname) for a in node.names]:
            pieces[0] = ("from", base, node.names)  # unchanged names: only the statement's head is rewritten
        return pieces

    def _render(self, piece: tuple) -> str:
        kind, module, detail = piece
        if kind == "keep":
            return module
        if kind == "raise":
            return f"raise ImportError({f'{module} is not shipped with remote code: {detail}'!r})"
        flat = self.flat_name(module)
        if kind == "module":
            return f"from .{flat} import __name__ as {detail}; from . import {flat} as {detail}"
        names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in detail)
        return f"from .{flat} import {names}"


def _guarded(node: ast.AST, parents: dict) -> bool:
    """Whether ``node`` runs inside the body of a ``try`` (in the same function) that catches ``ImportError``."""
    child, parent = node, parents.get(node)
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if any(t is None or getattr(t, "id", "") in ("ImportError", "Exception", "BaseException")
                       for t in types):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def check_loadable(texts: dict[str, str], class_files: set[str]) -> None:
    """Check with transformers' own reader (``get_relative_import_files``) that the files reached from
    ``class_files`` are exactly ``texts`` (no file missing, no line, e.g. in a docstring, read as an import of a
    file that is not there).

    Raises:
        GeneratorError: otherwise.
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    with tempfile.TemporaryDirectory() as tmp:
        for name, text in texts.items():
            Path(tmp, name).write_text(text, encoding="utf-8")
        reached = set(class_files)
        for name in class_files:
            try:
                reached |= {Path(path).name for path in get_relative_import_files(Path(tmp, name))}
            except FileNotFoundError as error:
                raise GeneratorError(f"transformers would load {Path(error.filename).name}, which is not generated "
                                     "(a line that reads like `from .x import`?).") from error
    if reached != set(texts):
        raise GeneratorError(f"transformers would load {sorted(reached - set(texts))} (not generated) and not "
                             f"{sorted(set(texts) - reached)} (generated).")


def generate() -> dict[str, str]:
    """``{file name: text}`` of :data:`OUTPUT`: ``manifest.json`` (per model type its ``auto_map`` and code files)
    and each code file as ``<flat name>.py.txt``.

    Raises:
        GeneratorError: see :meth:`Flattener.closure`, :func:`check_loadable`.
    """
    import hf_densessm
    from transformers import PreTrainedConfig
    from transformers.models.auto import modeling_auto

    if not Path(hf_densessm.__file__).is_relative_to(ROOT / "src"):
        raise GeneratorError(f"imported hf_densessm from {hf_densessm.__file__}, not from {ROOT / 'src'}.")
    flattener = Flattener("hf_densessm", NOT_SHIPPED)
    configs = [value for value in vars(hf_densessm).values()
               if inspect.isclass(value) and issubclass(value, PreTrainedConfig) and value.model_type]
    families, files = {}, {}
    for config in sorted(configs, key=lambda config: config.model_type):
        classes = {"AutoConfig": config}
        for name, auto in sorted(vars(modeling_auto).items()):
            mapping = getattr(auto, "_model_mapping", None) if name.startswith("AutoModel") else None
            if mapping is not None and config in mapping and _within(mapping[config].__module__, "hf_densessm"):
                classes[name] = mapping[config]
        texts = flattener.closure({cls.__module__ for cls in classes.values()})
        check_loadable(texts, {f"{flattener.flat_name(cls.__module__)}.py" for cls in classes.values()})
        auto_map = {auto: f"{flattener.flat_name(cls.__module__)}.{cls.__name__}" for auto, cls in classes.items()}
        families[config.model_type] = {"auto_map": auto_map, "files": list(texts)}
        files.update({f"{name}.txt": text for name, text in texts.items()})
    manifest = {"generated_by": "python tools/remote_code.py --write (do not edit)", "families": families}
    return {"manifest.json": json.dumps(manifest, indent=2, sort_keys=True) + "\n", **dict(sorted(files.items()))}


def stale(output: Path = OUTPUT) -> list[str]:
    """The file names of ``output`` that differ from :func:`generate`'s, are missing or are extra."""
    wanted = generate()
    present = {path.name: path.read_text(encoding="utf-8") for path in output.glob("*")} if output.is_dir() else {}
    return sorted(name for name in wanted.keys() | present.keys() if wanted.get(name) != present.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help=f"regenerate {OUTPUT.relative_to(ROOT)}")
    action.add_argument("--check", action="store_true", help="exit 1 if it is not up to date")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        if names:
            print(f"{OUTPUT.relative_to(ROOT)} is stale ({', '.join(names)}): run python tools/remote_code.py --write",
                  file=sys.stderr)
        return 1 if names else 0
    wanted = generate()
    OUTPUT.mkdir(exist_ok=True)
    for path in OUTPUT.glob("*"):
        if path.name not in wanted:
            path.unlink()
    for name, text in wanted.items():
        if not (OUTPUT / name).is_file() or (OUTPUT / name).read_text(encoding="utf-8") != text:
            (OUTPUT / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(wanted)} files to {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
