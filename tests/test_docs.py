"""The README a newcomer reads: short, its links and Python blocks working, no measurement history."""
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


def python_blocks(text: str) -> list[str]:
    """The bodies of the ``.. code-block:: python`` blocks of an rst text, dedented."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].strip() == ".. code-block:: python":
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                body.append(lines[i][4:])
                i += 1
            blocks.append("\n".join(body).strip() + "\n")
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


def test_the_readme_renders_without_warnings():
    docutils_core = pytest.importorskip("docutils.core", reason="docutils is not installed (pip install docutils)")
    warnings = io.StringIO()
    docutils_core.publish_string(readme(), writer_name="null",
                                 settings_overrides={"warning_stream": warnings, "report_level": 2})
    assert warnings.getvalue() == ""


def test_the_readme_python_blocks_run(tmp_path):
    blocks = python_blocks(readme())
    assert blocks
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(tmp_path)}
    for block in blocks:
        out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
        assert out.returncode == 0, block + out.stderr[-3000:]
