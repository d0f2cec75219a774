"""How ``tests/models/transformers_release_tests.py`` obtains transformers' own test modules: the sdist's ``tests/`` folder
kept between runs, a source tree checked to be of the installed release, stand-ins for the modules the sdist does
not ship, and, when nothing can be fetched, a skip, or a failure where ``HF_DENSESSM_REQUIRE_TRANSFORMERS_TESTS=1``."""

import pytest

import transformers_release_tests as release_tests


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty cache folder (``$XDG_CACHE_HOME``) and no source tree."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(release_tests.SOURCE_ENV, raising=False)
    return tmp_path / "cache"


def test_offline_download_is_unavailable(empty_cache, tmp_path, monkeypatch):
    """With no package index reachable, fetching raises Unavailable naming the pip command, and leaves no folder
    in the cache that a later run would take for a complete one."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an empty folder: no archive to find
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(release_tests.Unavailable, match="pip download"):
        release_tests.fetch_tests("5.24.0")
    assert not release_tests.cache_dir("5.24.0").exists()


def test_unpacked_tests_are_reused(empty_cache, monkeypatch):
    """A release's unpacked tests/ folder is used as it is: nothing is downloaded again."""
    tests = release_tests.cache_dir("5.24.0") / "tests"
    tests.mkdir(parents=True)
    (tests / "test_modeling_common.py").write_text("")

    def no_download(*args):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(release_tests, "_download_sdist", no_download)
    assert release_tests.fetch_tests("5.24.0") == tests


def test_source_tree_of_another_release_is_refused(empty_cache, tmp_path, monkeypatch):
    """HF_DENSESSM_TRANSFORMERS_SOURCE must be a source tree of the installed release."""
    (tmp_path / "src" / "transformers").mkdir(parents=True)
    (tmp_path / "src" / "transformers" / "__init__.py").write_text('__version__ = "5.16.0"\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_modeling_common.py").write_text("")
    monkeypatch.setenv(release_tests.SOURCE_ENV, str(tmp_path))
    with pytest.raises(release_tests.Unavailable, match="not transformers 5.24.0"):
        release_tests.fetch_tests("5.24.0")
    (tmp_path / "src" / "transformers" / "__init__.py").write_text('__version__ = "5.24.0"\n')
    assert release_tests.fetch_tests("5.24.0") == tmp_path / "tests"


@pytest.mark.parametrize("require", ["", "1"])
def test_unavailable_skips_or_fails(monkeypatch, require):
    """When the tests cannot be obtained, the module skips with the reason; with the variable set, it raises."""

    def unavailable():
        raise release_tests.Unavailable("no network")

    monkeypatch.setattr(release_tests, "load", unavailable)
    monkeypatch.setenv(release_tests.REQUIRE_ENV, require)
    expected = RuntimeError if require else pytest.skip.Exception
    with pytest.raises(expected, match="no network"):
        release_tests.load_or_skip()


def test_stand_ins_for_modules_not_shipped():
    """A stand-in's mixin adds no tests, and its data raises when used (never an empty value a check could pass on)."""
    module = release_tests.NotShipped("m", ("GenerationTesterMixin", "config_common_kwargs"), "what is lost")
    assert not [name for name in dir(module.GenerationTesterMixin) if name.startswith("test")]
    with pytest.raises(release_tests.Unavailable, match="m.config_common_kwargs"):
        list(module.config_common_kwargs)
    with pytest.raises(release_tests.Unavailable):
        module.config_common_kwargs.items()
