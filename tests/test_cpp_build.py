"""Building and loading the C++ operators of backend 'cpp': the build cache, an unwritable cache, a failing
compiler, no compiler at all. Each case runs in a fresh Python process (a process loads the operators once)."""
import functools
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from spikingjelly_mfpsn.ops import cpp_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, cwd=None, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **env}, timeout=600, cwd=cwd)


needs_compiler = pytest.mark.skipif(cpp_ops.compiler() is None, reason="no C++ compiler (g++/clang++ or $CXX): "
                                    "test_without_compiler covers that case")


@needs_compiler
def test_build_cache_survives_a_corrupted_library(tmp_path):
    """A build cached in the build directory is loaded by the next process, not rebuilt (but other sources
    are built, whatever their file times; a wait for another process's build is announced); a library
    there that no longer loads (here: overwritten) is rebuilt, not a crash."""
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
    # (from a copy of the package, whose sources the test changes in place below)
    copy = tmp_path / "copy" / "spikingjelly_mfpsn"
    shutil.copytree(os.path.join(ROOT, "spikingjelly_mfpsn"), copy, ignore=shutil.ignore_patterns("__pycache__"))
    run = functools.partial(run_python, code, cwd=tmp_path, SPIKINGJELLY_MFPSN_BUILD=str(tmp_path / "build"),
                            PYTHONPATH=str(copy.parent))
    first = run()
    assert first.returncode == 0, first.stderr
    libs = list(tmp_path.glob("build/*/*.so"))
    assert len(libs) == 1, libs
    second = run()
    assert second.returncode == 0, second.stderr
    assert float(second.stdout.split("load took")[1].split()[0]) < 10  # loaded, not compiled again
    # Waiting for another process's build said nothing (and had no bound): a holder of the lock is named
    # (the lock is held until the waiting process says so, however slowly it starts)
    import filelock
    held = filelock.FileLock(str(libs[0].parent / "build.lock"), thread_local=False)
    held.acquire()
    waiting = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env={**os.environ, "SPIKINGJELLY_MFPSN_BUILD": str(tmp_path / "build"),
                                    "PYTHONPATH": str(copy.parent)})
    said = []
    threading.Thread(target=lambda: said.extend(waiting.stderr), daemon=True).start()
    deadline = time.monotonic() + 300
    while not any("waiting for another process building" in line for line in said) and waiting.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    held.release()
    assert waiting.wait(timeout=300) == 0 and any("waiting for another process building" in line
                                                  for line in said), "".join(said)
    # Sources changed with older file times (a copy that keeps them, another version reinstalled) loaded the
    # cached build: they must be built (here they do not compile, which says they were)
    originals = {}
    for source in cpp_ops.SOURCES:
        changed = copy / "ops" / source.parent.name / source.name
        originals[changed] = changed.read_text()
        changed.write_text("#error other sources\n" + originals[changed])
        os.utime(changed, (978307200, 978307200))  # 2001
    other = run()
    assert other.returncode != 0 and "other sources" in other.stderr, (other.stdout, other.stderr[-2000:])
    for changed, text in originals.items():
        changed.write_text(text)
    # A library cut short (an interrupted copy) with its old time: ninja took it for up to date, and loading it
    # killed every process with a bus error; it is linked again
    whole, stat = libs[0].read_bytes(), libs[0].stat()
    libs[0].write_bytes(whole[:len(whole) // 2])
    os.utime(libs[0], (stat.st_atime, stat.st_mtime))
    cut = run()
    assert cut.returncode == 0, (cut.returncode, cut.stderr[-2000:])
    assert libs[0].stat().st_size == len(whole)
    read_only_checked = _loads_from_a_read_only_directory(libs[0].parent, code, tmp_path, copy.parent)
    libs[0].write_bytes(b"not a shared library")
    third = run()
    assert third.returncode == 0, third.stderr
    assert [p for p in tmp_path.glob("build/*/*.so") if p.read_bytes()[:4] == b"\x7fELF"]
    if not read_only_checked:
        pytest.skip("the read-only build directory case needs a non-root user or setpriv (run as root here)")


def _loads_from_a_read_only_directory(directory, code, cwd, package_parent) -> bool:
    """A whole build in a directory that cannot be written (a shared, read-only install) was never loaded:
    each process compiled it again in a temporary directory. Now it loads (as root: without the capability
    to write anywhere). False where this cannot be checked here."""
    as_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    if as_user and shutil.which("setpriv") is None:
        return False
    mode = directory.stat().st_mode
    directory.chmod(0o555)
    try:
        out = subprocess.run([*as_user, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             timeout=600, cwd=cwd, env={**os.environ, "SPIKINGJELLY_MFPSN_BUILD": str(directory.parent),
                                                        "PYTHONPATH": str(package_parent)})
    finally:
        directory.chmod(mode)
    assert out.returncode == 0 and "cannot be built" not in out.stderr, out.stderr[-2000:]
    assert float(out.stdout.split("load took")[1].split()[0]) < 10  # loaded, not compiled elsewhere
    return True


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
    assert "ERROR: backend='cpp' cannot run here: $CXX='/nonexistent/compiler' names no compiler" in out.stdout
    assert "torch.Size([4, 2, 3])" in out.stdout


ANNOUNCEMENT = "building the C++ kernels"


def run_main(*args, **env):
    return subprocess.run([sys.executable, "-m", "spikingjelly_mfpsn", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **env}, timeout=600)


@needs_compiler
def test_a_first_build_is_announced_once_and_autoselect_does_not_time_it(tmp_path):
    """In a fresh build cache, ``python -m spikingjelly_mfpsn build`` builds the operators, saying so once
    before it compiles, and names their directory; a cached load says nothing; and autoselect loads the
    operators before its clock starts, so that a first build is never counted as autoselect time."""
    cache = tmp_path / "build"
    first = run_main("build", SPIKINGJELLY_MFPSN_BUILD=str(cache))
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(ANNOUNCEMENT) == 1, first.stderr
    assert f"cached in {cache}" in first.stderr
    directory = first.stdout.strip().split(" in ")[-1]
    assert directory.startswith(str(cache)) and list(cache.glob("*/*.so")), first.stdout
    again = run_main("build", SPIKINGJELLY_MFPSN_BUILD=str(cache))
    assert again.returncode == 0, again.stderr
    assert ANNOUNCEMENT not in again.stderr and directory in again.stdout
    out = run_python("""
        import time, torch
        import spikingjelly_mfpsn as mf
        from spikingjelly.activation_based import layer
        from spikingjelly_mfpsn.ops import cpp_ops
        calls, load = [], cpp_ops.load
        def timed_load():
            start = time.perf_counter()
            directory = load()
            calls.append((start, time.perf_counter()))
            return directory
        cpp_ops.load = timed_load
        net = torch.nn.Sequential(layer.Linear(3, 4, step_mode="m"), mf.MulFreeChannelwisePSN(k=2, step_mode="m"))
        report = mf.autoselect(net, torch.randn(4, 2, 3), m=1, cache=False, progress=False)
        t0 = time.perf_counter() - report.seconds  # (a moment after autoselect took it)
        print("calls", len(calls), "before the clock", bool(calls) and calls[0][1] <= t0)
        print("directory", load())
    """, SPIKINGJELLY_MFPSN_BUILD=str(cache))
    assert out.returncode == 0, out.stderr
    assert "calls 1 before the clock True" in out.stdout, out.stdout
    assert f"directory {directory}" in out.stdout and ANNOUNCEMENT not in out.stderr, (out.stdout, out.stderr)


def test_the_build_command_without_a_compiler_or_ninja():
    """``python -m spikingjelly_mfpsn build`` where the operators cannot build: exit status 1 and the reason on
    one line, no traceback; ``--help`` lists the command."""
    out = run_main("build", CXX="/nonexistent/compiler")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "names no compiler" in out.stderr, out.stderr
    no_ninja = run_python("""
        import sys
        from torch.utils import cpp_extension
        cpp_extension.is_ninja_available = lambda: False
        from spikingjelly_mfpsn.__main__ import main
        sys.exit(main(["build"]))
    """)
    if cpp_ops.compiler() is not None:
        assert no_ninja.returncode == 1, (no_ninja.stdout, no_ninja.stderr)
        assert len(no_ninja.stderr.strip().splitlines()) == 1 and "needs ninja" in no_ninja.stderr, no_ninja.stderr
    helped = run_main("--help")
    assert helped.returncode == 0 and "build" in helped.stdout, helped.stderr
    # Flags that do not split were a traceback from shlex ("No closing quotation"), naming nothing
    quoted = run_main("build", SPIKINGJELLY_MFPSN_CXXFLAGS='-DX="a')
    if cpp_ops.compiler() is not None:
        assert quoted.returncode == 1 and len(quoted.stderr.strip().splitlines()) == 1, quoted.stderr
        assert "$SPIKINGJELLY_MFPSN_CXXFLAGS='-DX=\"a' cannot be split" in quoted.stderr, quoted.stderr


@needs_compiler
def test_a_relative_cxx_is_made_absolute_and_one_with_flags_is_named(tmp_path):
    """A relative $CXX was kept relative, and the build (which runs in the build directory) did not find it;
    a $CXX with flags was 'no C++ compiler found' (the build runs it as one command)."""
    link = tmp_path / "my-c++"
    link.symlink_to(shutil.which(cpp_ops.compiler()))
    code = """
        from spikingjelly_mfpsn.ops import cpp_ops
        print(repr(cpp_ops.compiler()), cpp_ops.unavailable_reason())
    """
    for cxx, says in (("./my-c++", f"{str(link)!r} None"),
                      ("./my-c++ -Wall", "flags go in $SPIKINGJELLY_MFPSN_CXXFLAGS")):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT, "CXX": cxx}, timeout=120)
        assert says in out.stdout, (out.stdout, out.stderr)


@needs_compiler
def test_the_build_command_refuses_a_build_cache_it_cannot_write(tmp_path):
    """``build`` with an unwritable cache ($SPIKINGJELLY_MFPSN_BUILD below a regular file): exit status 1
    and the reason, before compiling; it compiled into a temporary directory, deleted when the command
    ended, and reported success."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run_main("build", SPIKINGJELLY_MFPSN_BUILD=str(blocker / "build"))
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be written" in lines[0] and "SPIKINGJELLY_MFPSN_BUILD" in lines[0], lines
    assert not out.stdout


@needs_compiler
def test_a_compiler_without_openmp_builds_single_threaded_kernels_and_says_so(tmp_path):
    """A compiler that refuses -fopenmp (Apple's clang without libomp) gets kernels built without OpenMP,
    which give the same charge on one thread, and a warning that says so (before: silence, so a user's
    torch.set_num_threads did nothing for them and nothing told why)."""
    real = cpp_ops.compiler()
    fake = tmp_path / "c++-without-openmp"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do if [ "$a" = -fopenmp ]; then\n'
                    "  echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1; fi; done\n"
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    out = run_python(f"""
        import sys, warnings, torch
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import reference
        from spikingjelly_mfpsn import ops
        x, w, b = torch.randn(6, 2, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h = ops.charge(x, w, b, 2, "time_first", "cpp")
        assert torch.allclose(h, reference.charge(x, w, b, 2, "time_first")), "charge"
        print([str(c.message) for c in caught if "OpenMP" in str(c.message)])
    """, CXX=str(fake), SPIKINGJELLY_MFPSN_BUILD=str(tmp_path / "build"))
    assert out.returncode == 0, out.stderr
    assert "did not build with OpenMP" in out.stdout and "run on one thread" in out.stdout, out.stdout
    assert "unsupported option '-fopenmp'" in out.stdout, out.stdout
