"""`python -m bench` runs each benchmark as `python -m bench.NAME`: every one must import that way
(a bench importing its helpers as a top-level module only worked as `python bench/x.py`)."""

from __future__ import annotations

import importlib

import pytest

from bench.__main__ import BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_bench_module_imports_as_a_package_module(name):
    mod = importlib.import_module(f"bench.{name}")
    assert callable(getattr(mod, "main", None)), f"bench/{name}.py has no main()"
