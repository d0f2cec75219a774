"""The model card (``README.md``) of a saved folder, from the model's own documentation: the modeling module's
docstring, the ``Args:`` of the config class's docstring and each dense knob's help (``DENSE_KNOBS``)."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

from huggingface_hub import ModelCardData

CARD_MARKER = "<!-- hf_densessm model card -->"
CITATION = """@article{he2024densessm,
  title   = {DenseMamba: State Space Models with Dense Hidden Connection for Efficient Large Language Models},
  author  = {He, Wei and Han, Kai and Tang, Yehui and Wang, Chengcheng and Yang, Yujie and Guo, Tianyu and Wang, Yunhe},
  journal = {arXiv preprint arXiv:2403.00818},
  year    = {2024}
}"""


def _markdown(text: str) -> str:
    """reStructuredText inline code (````x````) and roles (``:class:`~a.B```) as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def field_docs(config_class: type) -> dict[str, str]:
    """``{field: meaning}`` from the ``Args:`` section of ``config_class``'s docstring (Google style: ``name
    (type, defaults to x): meaning`` indented 4 spaces, continuation lines deeper; ``a, b (type): meaning``
    documents both)."""
    section = re.search(r"^Args:\n(.*?)(?=^\S|\Z)", inspect.cleandoc(config_class.__doc__ or ""), re.M | re.S)
    docs = {}
    for entry in re.split(r"\n(?=    \S)", section.group(1).strip("\n")) if section else []:
        names, _, meaning = " ".join(entry.split()).partition(": ")
        for name in re.sub(r"\s*\(.*\)\s*$", "", names).split(","):
            docs[name.strip()] = _markdown(meaning)
    return docs


def config_rows(config) -> list[tuple[str, object, str]]:
    """``(field, value, meaning)`` for every argument of the config class's ``__init__`` (the family's fields,
    with their docstring meaning), then every dense knob of the family (with its :class:`Knob` help)."""
    docs = field_docs(type(config))
    parameters = inspect.signature(type(config).__init__).parameters.values()
    rows = [(p.name, getattr(config, p.name, None), docs.get(p.name, ""))
            for p in parameters if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
    rows += [(knob.name, getattr(config, knob.name), _markdown(knob.help)) for knob in type(config).knobs()]
    return rows


def model_card(model, files: list[str], repo_id: str | None = None, tags: list[str] | None = None) -> str:
    """The ``README.md`` text of a saved DenseSSM folder: Hub metadata, the architecture (the modeling module's
    docstring), every config field with its value and meaning, how to load, the files, the citation.

    Args:
        model: the saved model (its class, ``config`` and parameter count are described).
        files: the folder's file names, listed in the card.
        repo_id: the Hub repository (or folder) shown in the loading example; a placeholder when ``None``.
        tags: extra Hub tags.
    """
    config = model.config
    family = type(config).__name__.removesuffix("Config")
    where = repo_id or "path/to/this/folder"
    all_tags = list(dict.fromkeys(["densessm", config.model_type, *(tag for tag in tags or [] if tag)]))
    metadata = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=all_tags).to_yaml()
    architecture = _markdown(inspect.cleandoc(sys.modules[type(model).__module__].__doc__ or ""))
    rows = "\n".join(f"| `{name}` | `{value!r}` | {meaning} |" for name, value, meaning in config_rows(config))
    code = ", ".join(f"`{name}`" for name in files if name.endswith(".py"))
    weights = ", ".join(f"`{name}`" for name in files if name.endswith((".safetensors", ".safetensors.index.json")))
    bos = config.bos_token_id if config.bos_token_id is not None else 0
    count = model.num_parameters()
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"
    return f"""---
{metadata}
---
{CARD_MARKER}

# {family} ({size} parameters, `{type(model).__name__}`)

{architecture}

## Configuration

| field | value | meaning |
|---|---|---|
{rows}

## How to load

```python
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)
out = model.generate(torch.tensor([[{bos}, 450, 4996]]), max_new_tokens=32)  # ids from the model's tokenizer
```

The modeling code is in this repository ({code}); it needs only `torch` and `transformers` (`triton` for the fused
CUDA kernels). With the `hf_densessm` package installed, `import hf_densessm` registers `{config.model_type}` and the
same call works without `trust_remote_code`. Weights: {weights or "none"}.

## Citation

```bibtex
{CITATION}
```
"""


def write_model_card(model, folder: str | os.PathLike, repo_id: str | None = None, tags: list[str] | None = None):
    """Write :func:`model_card` as ``folder/README.md`` (listing the files already in ``folder``); returns its path."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md")
    path = folder / "README.md"
    path.write_text(model_card(model, files, repo_id=repo_id, tags=tags), encoding="utf-8")
    return path


def file_head(path: str | os.PathLike, size: int) -> str:
    """The first ``size`` characters of ``path`` if it is a regular file (not a symlink), else ``""``."""
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        return ""
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read(size)


def is_generated_card(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a model card this package wrote (it holds :data:`CARD_MARKER`), not one a person wrote."""
    return CARD_MARKER in file_head(path, 4096)
