"""transformers' own common model tests, taken from the source distribution (sdist) of the installed release.

Nothing of transformers is kept in this repository: the first run downloads the sdist of exactly the installed
release from PyPI (``pip download --no-deps --no-binary :all: transformers==<version>``), unpacks its ``tests/``
folder into ``~/.cache/hf_densessm/transformers-tests/<version>/`` (``$XDG_CACHE_HOME`` is honoured), and later runs
reuse it. :func:`load` imports it as the package :data:`PACKAGE` and returns the mixins
(``ModelTesterMixin``, ``GenerationTesterMixin``, ``ConfigTester``, ``TrainingTesterMixin``) and helpers
(``ids_tensor``) that ``tests/models/test_transformers_common.py`` runs against both families.

**What the sdist ships.** transformers 5.17 to 5.24 ship ``tests/test_modeling_common.py``,
``tests/test_configuration_common.py`` and ``tests/test_training_mixin.py``, but none of the sub-folders of
``tests/``: not ``generation/test_utils.py`` (``GenerationTesterMixin``), ``exporters/test_export.py``
(``ExportTesterMixin``, a base class of ``ModelTesterMixin``) nor ``utils/test_configuration_utils.py``
(``config_common_kwargs``, read by ``ConfigTester.check_config_arguments_init``), which the first two import
(:data:`NOT_SHIPPED`). So that the rest can be imported and run, each of these is replaced by a
:class:`NotShipped` module whose names are an empty mixin (no tests) or, for data, an object that raises on any use;
``Loaded.not_shipped`` lists them, and the tests that need them skip with that reason. A release whose sdist ships
one of them gets the real module. ``HF_DENSESSM_TRANSFORMERS_SOURCE`` may name a transformers source tree of the
installed release (a checkout of its tag): its complete ``tests/`` folder is then used instead of the sdist's, and
nothing is replaced.

**When the sdist cannot be had** (no network, no ``pip``), :func:`load` raises :class:`Unavailable`, and
:func:`load_or_skip` skips the calling test module with its message, unless ``HF_DENSESSM_REQUIRE_TRANSFORMERS_TESTS=1``
is set (meant for CI), where it raises instead, so that the run fails.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import transformers

#: Set to ``1`` to turn "transformers' tests could not be fetched" from a skip into a failure (meant for CI).
REQUIRE_ENV = "HF_DENSESSM_REQUIRE_TRANSFORMERS_TESTS"

#: A transformers source tree of the installed release whose ``tests/`` folder is used instead of the sdist's.
SOURCE_ENV = "HF_DENSESSM_TRANSFORMERS_SOURCE"

#: The name under which transformers' ``tests/`` folder is imported (its modules import each other relatively).
PACKAGE = "transformers_own_tests"

#: Modules that ``test_modeling_common.py`` / ``test_configuration_common.py`` import but transformers' sdists do not
#: ship, with the names imported from each and what is lost without them.
NOT_SHIPPED = {
    "generation.test_utils": (("GenerationTesterMixin",), "GenerationTesterMixin's generate() tests"),
    "exporters.test_export": (("ExportTesterMixin",), "ExportTesterMixin's torch.export / ONNX / ExecuTorch tests"),
    "utils.test_configuration_utils": (("config_common_kwargs",), "ConfigTester.check_config_arguments_init"),
}


class Unavailable(RuntimeError):
    """transformers' test sources for the installed release could not be obtained (the message says why)."""


def required() -> bool:
    """Whether :data:`REQUIRE_ENV` asks for a failure, rather than a skip, when the tests cannot be obtained."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def cache_dir(version: str) -> Path:
    """Where the ``tests/`` folder of transformers ``version``'s sdist is unpacked and kept between runs."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "hf_densessm" / "transformers-tests" / version


def _download_sdist(version: str, into: Path) -> Path:
    """Download transformers ``version``'s sdist into ``into`` with pip; return the archive's path.

    Raises:
        Unavailable: pip failed (offline, no such release, no pip) or produced no archive.
    """
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
        "--retries", "1", "--timeout", "20", "--disable-pip-version-check", f"transformers=={version}",
        "--dest", str(into),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise Unavailable(f"`{' '.join(command)}` did not run: {error}") from error
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"`{' '.join(command)}` failed (exit {done.returncode}): {' / '.join(tail)}")
    archives = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if not archives:
        raise Unavailable(f"pip downloaded no transformers-{version}.tar.gz into {into}.")
    return archives[0]


def _unpack_tests(archive: Path, version: str, into: Path) -> None:
    """Extract the sdist's ``transformers-<version>/tests/`` folder into ``into`` (as ``into/tests``).

    Raises:
        Unavailable: the archive has no ``tests/test_modeling_common.py``.
    """
    prefix = f"transformers-{version}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        if not any(m.name == prefix + "test_modeling_common.py" for m in members):
            raise Unavailable(f"{archive.name} ships no tests/test_modeling_common.py.")
        for member in members:
            member.name = "tests/" + member.name[len(prefix):]
        tar.extractall(into, members=members, filter="data")


def fetch_tests(version: str | None = None) -> Path:
    """The ``tests/`` folder of transformers ``version`` (default: the installed one), from :data:`SOURCE_ENV` when
    set, else from the sdist, downloaded and unpacked on first use into :func:`cache_dir` (atomically: a folder that
    exists is complete).

    Raises:
        Unavailable: the sdist could not be downloaded or unpacked, or :data:`SOURCE_ENV` names no ``tests/``
            folder of this release.
    """
    version = version or transformers.__version__
    source = os.environ.get(SOURCE_ENV)
    if source:
        return _source_tests(Path(source), version)
    target = cache_dir(version)
    tests = target / "tests"
    if (tests / "test_modeling_common.py").is_file():
        return tests
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{version}-") as scratch:
        scratch = Path(scratch)
        archive = _download_sdist(version, scratch / "download")
        staged = scratch / "unpacked"
        _unpack_tests(archive, version, staged)
        (staged / "tests" / "__init__.py").touch()  # a package: its modules import each other relatively
        try:
            staged.rename(target)
        except OSError:  # another process unpacked it first
            if not (tests / "test_modeling_common.py").is_file():
                raise
    return tests


def _source_tests(source: Path, version: str) -> Path:
    """The ``tests/`` folder of the transformers source tree ``source``, checked to be of release ``version``."""
    tests = source / "tests"
    init = source / "src" / "transformers" / "__init__.py"
    if not (tests / "test_modeling_common.py").is_file() or not init.is_file():
        raise Unavailable(f"{SOURCE_ENV}={source} is not a transformers source tree (no tests/test_modeling_common.py "
                          "or src/transformers/__init__.py).")
    if f'__version__ = "{version}"' not in init.read_text():
        raise Unavailable(f"{SOURCE_ENV}={source} is not transformers {version}, the installed release.")
    return tests


class NotShipped(types.ModuleType):
    """Stands in for a module of transformers' ``tests/`` that its sdist does not ship (:data:`NOT_SHIPPED`), so
    that the modules importing it can be imported: a mixin name is an empty class (it adds no tests), any other
    name an object that raises :class:`Unavailable` when used."""

    def __init__(self, name: str, names: tuple[str, ...], lost: str):
        super().__init__(name, f"Not in transformers' sdist: {lost} are not run.")
        for attribute in names:
            if attribute.endswith("Mixin"):
                setattr(self, attribute, type(attribute, (), {"__doc__": self.__doc__, "__module__": name}))
            else:
                setattr(self, attribute, _Missing(f"{name}.{attribute}"))


class _Missing:
    """A value from a module that was not shipped: every use raises :class:`Unavailable`."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attribute):
        raise Unavailable(f"{object.__getattribute__(self, '_name')} is not in transformers' sdist.")

    def __iter__(self):
        raise Unavailable(f"{self._name} is not in transformers' sdist.")


@dataclass
class Loaded:
    """What :func:`load` imported: transformers' test mixins and helpers, where they came from, and which modules
    of :data:`NOT_SHIPPED` were replaced (dotted names relative to ``tests/``, mapped to what is lost)."""

    tests: Path
    ModelTesterMixin: type
    GenerationTesterMixin: type
    ExportTesterMixin: type
    ConfigTester: type
    TrainingTesterMixin: type
    ids_tensor: object
    not_shipped: dict[str, str] = field(default_factory=dict)


def load() -> Loaded:
    """Import transformers' common test modules of the installed release (:func:`fetch_tests`) as :data:`PACKAGE`.

    Raises:
        Unavailable: they could not be obtained (see :func:`fetch_tests`).
    """
    tests = fetch_tests()
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, tests / "__init__.py",
                                                      submodule_search_locations=[str(tests)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    not_shipped = {}
    for relative, (names, lost) in NOT_SHIPPED.items():
        if (tests / (relative.replace(".", "/") + ".py")).is_file():
            continue
        not_shipped[relative] = lost
        parent, _, _ = relative.rpartition(".")
        parent_name = f"{PACKAGE}.{parent}"
        if parent_name not in sys.modules and not (tests / parent).is_dir():
            subpackage = types.ModuleType(parent_name, "A sub-folder of transformers' tests/ not in its sdist.")
            subpackage.__path__ = []
            sys.modules[parent_name] = subpackage
        sys.modules.setdefault(f"{PACKAGE}.{relative}", NotShipped(f"{PACKAGE}.{relative}", names, lost))
    modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    training = importlib.import_module(f"{PACKAGE}.test_training_mixin")
    generation = importlib.import_module(f"{PACKAGE}.generation.test_utils")
    return Loaded(
        tests=tests,
        ModelTesterMixin=modeling.ModelTesterMixin,
        GenerationTesterMixin=generation.GenerationTesterMixin,
        ExportTesterMixin=importlib.import_module(f"{PACKAGE}.exporters.test_export").ExportTesterMixin,
        ConfigTester=configuration.ConfigTester,
        TrainingTesterMixin=training.TrainingTesterMixin,
        ids_tensor=modeling.ids_tensor,
        not_shipped=not_shipped,
    )


def load_or_skip() -> Loaded:
    """:func:`load`, for a test module's top level: when the tests cannot be obtained, skip the module with the
    reason, or, where :func:`required`, raise.

    Raises:
        RuntimeError: they could not be obtained and :data:`REQUIRE_ENV` is set.
    """
    try:
        return load()
    except Unavailable as error:
        if required():
            raise RuntimeError(
                f"transformers' common model tests are required ({REQUIRE_ENV}=1) but could not be obtained: {error}"
            ) from error
        pytest.skip(f"transformers' common model tests could not be obtained: {error} (with {REQUIRE_ENV}=1 this "
                    "is a failure)", allow_module_level=True)
