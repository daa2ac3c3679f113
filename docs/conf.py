"""Sphinx configuration of trainflow's documentation site (`make docs`)."""

import trainflow

project = "trainflow"
author = "the trainflow authors"
copyright = "the trainflow authors"
release = version = trainflow.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",  # docs/cli.md: the command-line reference from the argument parser
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The API reference: real imports of the installed package (no mocks), one page per module.
autosummary_generate = True
autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    "show-inheritance": True,
    "exclude-members": "model_config",
}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
# Docstrings write names in single backticks, as Markdown does: show them as code.
default_role = "literal"
nitpicky = False
# Options and commands are quoted as typed: no "--" turned into a dash.
smartquotes = False

html_theme = "pydata_sphinx_theme"
html_title = "trainflow"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
