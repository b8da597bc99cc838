"""hf: workloads say which transformers they need, and what is wrong with the one installed, in one line."""

from __future__ import annotations

import pytest

from mbtune.errors import WorkloadError
from mbtune.workloads import hf


@pytest.mark.parametrize(("version", "numbers"), [("5.24.0", (5, 24, 0)), ("5.25.0.dev0", (5, 25, 0)),
                                                  ("5.17.0+local", (5, 17, 0)), ("6.0rc1", (6, 0))])
def test_a_release_is_its_leading_numbers(version, numbers):
    assert hf._release(version) == numbers


def test_an_older_transformers_is_named_with_the_release_needed(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(WorkloadError, match=r"transformers 5\.17\.0 is older than the 5\.24"):
        hf._transformers()


def test_an_installed_transformers_that_does_not_import_is_not_called_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError("huggingface-hub>=2.4.0,<3.0 is required for a normal functioning of this module")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(WorkloadError, match="installed but does not import: huggingface-hub>=2.4.0"):
        hf._transformers()
