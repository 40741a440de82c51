"""One version: pyproject.toml takes trainscope.__version__ (setuptools' dynamic attr), and setuptools' own build
reads the same."""

import tomllib
from conftest import ROOT

import trainscope


def test_the_version_has_one_source_and_the_build_reads_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "trainscope.__version__"}
    from setuptools.config.expand import read_attr

    assert read_attr("trainscope.__version__", root_dir=str(ROOT)) == trainscope.__version__ == "0.4.0"
