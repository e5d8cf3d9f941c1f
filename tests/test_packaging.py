"""What an installed (not editable) copy of the package holds: every file the code reads at run time."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spikingjelly_mfpsn"


def _installed_copy(tmp_path) -> Path:
    """setuptools' build step (what ``pip install .`` and a wheel copy) of a copy of the project."""
    for name in ("setup.py", "setup.cfg", "README.rst"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", "out"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return tmp_path / "out"


def test_an_installed_copy_ships_the_kernel_sources(tmp_path):
    """The C++ sources and headers and the CUDA kernels are data files, compiled where they run: an
    installed copy holds every one of them (before: only the CUDA file was declared)."""
    installed = _installed_copy(tmp_path) / PACKAGE.name
    sources = [p for d in ("ops/cpu", "ops/cuda") for p in (PACKAGE / d).iterdir() if p.is_file()]
    assert len(sources) >= 5
    for source in sources:
        relative = source.relative_to(PACKAGE)
        assert (installed / relative).read_bytes() == source.read_bytes(), f"{relative} is not installed"


def test_an_installation_without_a_kernel_source_has_no_cpp_backend(tmp_path):
    """An installed copy that lost a C++ file has no backend 'cpp', and asking for it names the file."""
    out = _installed_copy(tmp_path)
    (out / PACKAGE.name / "ops" / "cpu" / "mfpsn_cpu.h").unlink()
    code = """
import torch
from spikingjelly.activation_based import neuron
import spikingjelly_mfpsn
from spikingjelly_mfpsn import ops
assert spikingjelly_mfpsn.__file__.startswith(%r), spikingjelly_mfpsn.__file__
assert "cpp" not in ops.available_backends()
try:
    neuron.MulFreeChannelwisePSN(3, backend="cpp")
except ImportError as e:
    print("ERROR:", e)
""" % str(out)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=out,
                         env={**os.environ, "PYTHONPATH": str(out)})
    assert run.returncode == 0, run.stderr
    assert "mfpsn_cpu.h is missing from this installation" in run.stdout
