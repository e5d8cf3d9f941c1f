"""The README a newcomer reads and the documentation site: short, links and Python blocks working, warnings-free."""
import glob
import io
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme() -> str:
    with open(os.path.join(ROOT, "README.rst"), encoding="utf-8") as f:
        return f.read()


def python_blocks(text: str, options: bool = False) -> list:
    """The bodies of the ``.. code-block:: python`` blocks of an rst text, dedented (with their options)."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].strip() == ".. code-block:: python":
            i += 1
            opts = []
            while i < len(lines) and lines[i].strip().startswith(":"):
                opts.append(lines[i].strip())
                i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                body.append(lines[i][4:])
                i += 1
            block = "\n".join(body).strip() + "\n"
            blocks.append((block, opts) if options else block)
        else:
            i += 1
    return blocks


def test_the_readme_is_short():
    assert len(readme().split("\n")) <= 200


def test_the_readme_links_exist():
    targets = re.findall(r"<(docs/[^>]+)>`_", readme())
    assert len(targets) >= 8
    for target in targets:
        assert os.path.isfile(os.path.join(ROOT, target)), target


def test_the_readme_has_no_commit_hashes_or_timings():
    text = readme()
    assert not [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search("[a-f]", w)]
    assert not re.search(r"\d+(\.\d+)? ?(ms|us)\b", text)


def test_the_docs_name_no_commits():
    """History lives in the commit messages and the changelog, not in the user's pages."""
    for path in glob.glob(os.path.join(ROOT, "docs", "*.rst")):
        with open(path, encoding="utf-8") as f:
            words = re.findall(r"\b[0-9a-f]{7,40}\b", f.read())
        assert not [w for w in words if re.search(r"\d", w) and re.search("[a-f]", w)], path


def test_the_readme_renders_without_warnings():
    docutils_core = pytest.importorskip("docutils.core", reason="docutils is not installed (pip install docutils)")
    warnings = io.StringIO()
    docutils_core.publish_string(readme(), writer="null",
                                 settings_overrides={"warning_stream": warnings, "report_level": 2})
    assert warnings.getvalue() == ""


def test_the_readme_python_blocks_run(tmp_path):
    blocks = python_blocks(readme())
    assert blocks
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "SPIKINGJELLY_MFPSN_CACHE": str(tmp_path / "autoselect.json")}   # (the C++ build cache is shared)
    for block in blocks:
        out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
        assert out.returncode == 0, block + out.stderr[-3000:]


def sphinx_build(builder: str, out, env=None) -> subprocess.CompletedProcess:
    pytest.importorskip("sphinx", reason="sphinx is not installed (pip install sphinx furo)")
    pytest.importorskip("furo", reason="furo is not installed (pip install sphinx furo)")
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder,
                           "-d", str(out / "doctrees"), os.path.join(ROOT, "docs"), str(out / builder)],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=out)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    out = sphinx_build("html", tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    pages = {os.path.basename(p) for p in glob.glob(str(tmp_path / "html" / "*.html"))}
    guide = {os.path.basename(p)[:-4] + ".html" for p in glob.glob(os.path.join(ROOT, "docs", "*.rst"))}
    assert guide <= pages
    with open(tmp_path / "html" / "api.html", encoding="utf-8") as f:
        api = f.read()
    for name in ("MulFreeChannelwisePSN", "functional.replace_neurons", "functional.autoselect", "ops.mf_psn",
                 "deploy.fold", "energy.estimate", "nir.export_to_nir", "onnx.export_onnx"):
        assert f'id="spikingjelly_mfpsn.{name}"' in api, name


def test_every_python_block_of_the_docs_runs_as_a_doctest(tmp_path):
    blocks = [b for p in glob.glob(os.path.join(ROOT, "docs", "*.rst"))
              for b in python_blocks(open(p, encoding="utf-8").read(), options=True)]
    readme_included = len(python_blocks(readme().split(".. start-quickstart")[1].split(".. end-quickstart")[0]))
    unconditional = sum(1 for _, opts in blocks if not opts) + readme_included
    env = {**os.environ, "SPIKINGJELLY_MFPSN_CACHE": str(tmp_path / "autoselect.json")}
    out = sphinx_build("doctest", tmp_path, env)
    with open(tmp_path / "doctest" / "output.txt", encoding="utf-8") as f:
        report = f.read()
    assert out.returncode == 0, report[-3000:] + out.stderr[-3000:]
    ran = int(re.search(r"^\s*(\d+) tests$", report, re.M).group(1))
    assert unconditional <= ran <= len(blocks) + readme_included
    assert re.search(r"^\s*0 failures in tests$", report, re.M)


API_MODULES = ["spikingjelly_mfpsn", "spikingjelly_mfpsn.functional", "spikingjelly_mfpsn.convert",
               "spikingjelly_mfpsn.tuner", "spikingjelly_mfpsn.layer", "spikingjelly_mfpsn.ops",
               "spikingjelly_mfpsn.quantize", "spikingjelly_mfpsn.deploy", "spikingjelly_mfpsn.energy",
               "spikingjelly_mfpsn.nir", "spikingjelly_mfpsn.onnx", "spikingjelly_mfpsn.paper.models",
               "spikingjelly_mfpsn.paper.data"]


def test_public_docstrings_open_with_a_one_line_summary():
    """Every module of the API page and every function and class it exports: a docstring whose first
    line is a summary of its own (followed by a blank line), as napoleon and the API page expect."""
    import importlib
    import inspect
    offenders, seen = [], set()
    for name in API_MODULES:
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
        objects = [(name, module)] + [(f"{name}.{n}", getattr(module, n)) for n in exported]
        for path, obj in objects:
            if not (obj is module or inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in seen:
                continue
            if obj is not module and not getattr(obj, "__module__", "").startswith("spikingjelly_mfpsn"):
                continue  # re-exported from torch or SpikingJelly
            seen.add(id(obj))
            lines = (inspect.getdoc(obj) or "").split("\n")
            if not lines[0] or len(lines[0]) > 110 or (len(lines) > 1 and lines[1].strip()):
                offenders.append(path)
    assert len(seen) > 100 and not offenders, offenders
