"""Building and loading the C++ operators of backend 'cpp': the build cache, an unwritable cache, a failing
compiler, no compiler at all. Each case runs in a fresh Python process (a process loads the operators once)."""
import os
import subprocess
import sys
import textwrap

import pytest

from spikingjelly_mfpsn.ops import cpp_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **env}, timeout=600)


needs_compiler = pytest.mark.skipif(cpp_ops.compiler() is None, reason="no C++ compiler (g++/clang++ or $CXX): "
                                    "test_without_compiler covers that case")


@needs_compiler
def test_build_cache_survives_a_corrupted_library(tmp_path):
    """A build cached in the build directory is loaded by the next process, not rebuilt; a library there
    that no longer loads (here: overwritten) is rebuilt, not a crash."""
    code = """
        import time, torch
        from spikingjelly_mfpsn import ops
        from spikingjelly_mfpsn.ops import cpp_ops
        start = time.perf_counter()
        cpp_ops.load()
        print("load took", time.perf_counter() - start)
        x, w = torch.randn(5, 2, 3), torch.randn(3, 2)
        h = ops.charge(x, w, None, 1, "time_first", "cpp")
        want = ops.charge(x, w, None, 1, "time_first", "shift_add")
        assert torch.allclose(h, want), (h, want)
    """
    first = run_python(code, SPIKINGJELLY_MFPSN_BUILD=str(tmp_path))
    assert first.returncode == 0, first.stderr
    libs = list(tmp_path.glob("*/*.so"))
    assert len(libs) == 1, libs
    second = run_python(code, SPIKINGJELLY_MFPSN_BUILD=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert float(second.stdout.split("load took")[1].split()[0]) < 10  # loaded, not compiled again
    libs[0].write_bytes(b"not a shared library")
    third = run_python(code, SPIKINGJELLY_MFPSN_BUILD=str(tmp_path))
    assert third.returncode == 0, third.stderr
    assert [p for p in tmp_path.glob("*/*.so") if p.read_bytes()[:4] == b"\x7fELF"]


@needs_compiler
def test_an_unwritable_build_directory_and_a_failing_compiler(tmp_path):
    """A build directory that cannot be written (here: below a regular file) makes the build go to a
    temporary directory for this process, with a warning; a compiler that fails is a BuildError with its
    message; and the temporary directory is gone when the process ends."""
    fake = tmp_path / "fake-c++"
    fake.write_text('#!/bin/sh\ncase "$1" in -v|--version) echo "g++ (fake) 12.0"; exit 0;; esac\n'
                    "echo 'error: this compiler says no' >&2\nexit 1\n")
    fake.chmod(0o755)
    blocker, tmp = tmp_path / "file", tmp_path / "tmp"
    blocker.write_text("")
    tmp.mkdir()
    out = run_python("""
        import torch, warnings
        from spikingjelly_mfpsn import ops
        from spikingjelly_mfpsn.ops import cpp_ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ops.charge(torch.randn(5, 2, 3), torch.randn(3, 2), None, 1, "time_first", "cpp")
            except cpp_ops.BuildError as e:
                print("refused:", e)
        print([str(w.message) for w in caught if "for this process only" in str(w.message)])
    """, CXX=str(fake), SPIKINGJELLY_MFPSN_BUILD=str(blocker / "build"), TMPDIR=str(tmp))
    assert out.returncode == 0 and "refused:" in out.stdout, out.stderr
    assert "this compiler says no" in out.stdout
    assert "cannot be built in" in out.stdout and str(tmp) in out.stdout
    assert not list(tmp.iterdir())


def test_without_compiler():
    """No compiler: 'cpp' is not registered, backend='cpp' says why, and everything else still works."""
    out = run_python("""
        import torch
        from spikingjelly.activation_based import neuron
        import spikingjelly_mfpsn
        from spikingjelly_mfpsn import ops
        assert "cpp" not in ops.names() and "cpp" not in ops.available_backends()
        try:
            neuron.MulFreeChannelwisePSN(3, backend="cpp")
        except ImportError as e:
            print("ERROR:", e)
        sn = neuron.MulFreeChannelwisePSN(3, step_mode="m")
        print(sn(torch.randn(4, 2, 3)).shape)
    """, CXX="/nonexistent/compiler")
    assert out.returncode == 0, out.stderr
    assert "ERROR: backend='cpp' cannot run here: no C++ compiler" in out.stdout
    assert "torch.Size([4, 2, 3])" in out.stdout
