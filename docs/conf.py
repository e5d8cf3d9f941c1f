"""Sphinx configuration of the documentation site (``make docs``)."""
import os
import sys
import textwrap

from docutils import nodes

sys.path.insert(0, os.path.abspath(".."))

project = "spikingjelly_mfpsn"
author = "the spikingjelly_mfpsn developers"
copyright = "2026, " + author
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.doctest", "sphinx.ext.intersphinx"]
html_theme = "furo"
html_title = "spikingjelly_mfpsn"
exclude_patterns = ["_build"]
highlight_language = "text"              # ``::`` blocks are commands and printed output
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False    # SpikingJelly's own docstrings are not ours to render
autodoc_default_options = {"show-inheritance": False}   # (api.rst names :members: per module)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
intersphinx_mapping = {}                 # the site builds offline
suppress_warnings = ["config.cache"]
doctest_global_setup = """
import os, tempfile
import torch
import spikingjelly_mfpsn
_cwd, _tmp = os.getcwd(), tempfile.TemporaryDirectory(prefix="mfpsn-doctest-")
os.chdir(_tmp.name)                                    # files the blocks write land here
from spikingjelly.activation_based import functional, layer, neuron, surrogate
"""
doctest_global_cleanup = """
os.chdir(_cwd)
_tmp.cleanup()
"""
SKIP = {"cuda": "not torch.cuda.is_available()",
        "cpp": "not spikingjelly_mfpsn.ops.backend_available('cpp')",
        "cupy": "not spikingjelly_mfpsn.ops.backend_available('cupy')",
        "torchvision": "__import__('importlib.util').util.find_spec('torchvision') is None"}


def run_python_blocks(app, doctree):
    """Make every ``code-block:: python`` a doctest: the blocks of one page run in order, in one namespace.

    A block passes when it runs without an exception; what it prints is not compared.
    """
    for node in doctree.findall(nodes.literal_block):
        if node.get("language") == "python" and "testnodetype" not in node:
            body = textwrap.indent(node.astext(), "    ")
            node["test"] = f"import contextlib as _c, io as _io\nwith _c.redirect_stdout(_io.StringIO()):\n{body}\n"
            node["testnodetype"] = "testcode"
            node["groups"] = ["default"]
            for cls, condition in SKIP.items():    # ``:class: cuda`` blocks run only where a GPU is
                if cls in node.get("classes", []):
                    node["skipif"] = condition


def setup(app):
    app.connect("doctree-read", run_python_blocks)
