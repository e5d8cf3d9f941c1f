"""What an installed (not editable) copy of the package holds: every file the code reads at run time."""
import shutil
import subprocess
import sys
from pathlib import Path

from spikingjelly_mfpsn.ops import cpp_ops, cupy_ops, registry

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spikingjelly_mfpsn"


def test_an_installed_copy_ships_the_kernel_sources(tmp_path):
    """setuptools' build step (what ``pip install .`` and a wheel copy) of a copy of the project: the C++
    kernels, the C++ autograd node and the CUDA kernels are data files, compiled where they run, and an
    installed package without them has no backend 'cpp' (before: only the CUDA file was declared)."""
    for name in ("setup.py", "setup.cfg", "README.rst"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(PACKAGE, tmp_path / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", "out"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    installed = tmp_path / "out" / PACKAGE.name
    for source in (cpp_ops.SOURCE_FILE, cpp_ops.NODE_SOURCE, cupy_ops.KERNEL_FILE):
        relative = Path(source).relative_to(PACKAGE)
        assert (installed / relative).read_bytes() == Path(source).read_bytes(), f"{relative} is not installed"


def test_an_installation_without_the_kernel_source_has_no_cpp_backend(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp_ops, "SOURCE_FILE", tmp_path / "mfpsn_cpu.cpp")
    monkeypatch.setattr(registry, "_UNAVAILABLE_REASONS", dict(registry._UNAVAILABLE_REASONS))
    reason = cpp_ops.register_if_available()
    assert reason is not None and "mfpsn_cpu.cpp is missing from this installation" in reason
    assert reason in registry._UNAVAILABLE_REASONS["cpp"]
