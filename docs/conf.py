"""Sphinx configuration: Markdown pages (MyST), the API reference generated from the docstrings (autodoc)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _api  # noqa: E402

project = "tensorplay"
author = "the tensorplay authors"
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
html_theme = "alabaster"
html_title = "tensorplay"
html_static_path: list[str] = []

autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False
suppress_warnings = ["myst.xref_missing"]

_api.write_pages(HERE / "api")
