"""The package metadata and the examples a new user runs first."""

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_license_is_an_spdx_expression():
    """A TOML-table license makes setuptools print a deprecation block on every install (PEP 639)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    assert "setuptools>=77" in meta["build-system"]["requires"]  # the first to read SPDX strings

