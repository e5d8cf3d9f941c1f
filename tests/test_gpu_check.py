"""benchmarks/gpu_check.py, the one command for a CUDA machine, run here as --dry-run: its reference
comparisons, determinism probe, timing and report code on the CPU (Triton through its interpreter)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from spikingjelly_mfpsn import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_writes_its_report(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT, "OUT": ""}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["correctness"]["cases"] >= 40 and result["correctness"]["failures"] == []
    assert result["determinism"]["identical"]
    assert {r["candidate"] for r in result["neuron"]} >= {"MF-PSN (auto)", "LIF"}
    assert {r["network"] for r in result["network"]} == {"Table 10", "sequential CIFAR"}
    host = result["host"]["MF-PSN (auto)"]
    assert host["total_us_per_step"] > 0 and host["top"] and all(t["calls_per_step"] > 0 for t in host["top"])
    assert all(r["launches"] > 0 for r in result["network"] if r["candidate"] == "mfpsn")
    text = (tmp_path / "gpu_check.md").read_text()
    assert "## (a) correctness: " in text and "bit-identical" in text and "| Table 10 | 2 | mfpsn |" in text



def test_the_network_section_times_the_networks_asked_for(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT, "OUT": ""}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--out",
                          str(tmp_path), "--sections", "network", "--networks", "sequential"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["network"]
    assert rows and {r["network"] for r in rows} == {"sequential CIFAR"}

def test_the_check_sees_a_wrong_method():
    """The correctness part fails a method whose charge is off (here by one step of delay)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    good = ops.get("shift_add")

    def late(x, weight, bias, dilation, layout):
        h = good.charge(x, weight, bias, dilation, layout)
        return h.roll(1, ops.time_dim(layout))
    ops.register(ops.Implementation("late", "torch", ops.LAYOUTS, late))
    failures = []
    try:
        gpu_check.check_training("late", "time_first", "param", 2, 1, "float32", torch.device("cpu"), (7, 2, 3, 3),
                                 failures)
    finally:
        ops.unregister("late")
    assert failures and "spikes differ" in failures[0]


def test_the_session_script_logs_each_stage(tmp_path):
    """benchmarks/gpu_session.sh on a machine without CUDA: the CUDA tests skip, gpu_check refuses to
    time nothing, and each stage's log and exit status still lands in $OUT."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none"),
           "TESTS_S": "300", "CHECK_S": "120", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh")], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 2, out.stderr[-3000:]  # (gpu_check's: the worse stage's exit status)
    log = (tmp_path / "session.log").read_text()
    assert "tests: " in log and "gpu_check: " in log and "exit 2" in log  # (gpu_check: no CUDA device)
    assert "deselected" in (tmp_path / "tests.log").read_text()
    assert "no CUDA device here" in (tmp_path / "check.log").read_text()


@pytest.mark.parametrize("tests_s, tests_k", [("0", ""), ("300", "inductor_with_method_auto")])
def test_the_session_script_runs_the_tests_asked_for(tmp_path, tests_s, tests_k):
    """TESTS_S=0 skips the CUDA tests (a GPU session short of time runs gpu_check only); TESTS_K selects
    among them with a pytest -k expression."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none"),
           "TESTS_S": tests_s, "TESTS_K": tests_k, "CHECK_S": "120", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh")], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    log = (tmp_path / "session.log").read_text()
    assert "gpu_check: " in log and ("tests: " in log) == (tests_s != "0")
    if tests_k:
        log = (tmp_path / "tests.log").read_text()  # (that CUDA test alone, skipped: no CUDA device here)
        assert log.count("SKIPPED [1] tests/test_cuda.py") == 1 and "deselected" in log, log[-2000:]
    else:
        assert not (tmp_path / "tests.log").exists()


@pytest.mark.parametrize("script, args, says", [
    ("host_cost.py", ["--shape", "4,2,8"], "argument --shape: expected four sizes"),
    ("host_cost.py", ["--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
    ("host_cost.py", ["--launch", "gpu"], "argument --launch: invalid choice: 'gpu'"),
    ("memory_passes.py", ["--shape", "1,2"], "argument --shape: expected four sizes"),
    ("time_last_layers.py", ["--repeat", "0"], "argument --repeat: expected an int >= 1"),
    ("speed_suite.py", ["--parts", "nueron", "--out", "OUT"], "--parts: unknown 'nueron'"),
    ("speed_suite.py", ["--parts", "neuron"], "--out: the committed results in benchmarks/results are written by a "
                                              "full run only"),
    ("speed_suite.py", ["--repeats", "0", "--out", "OUT"], "argument --repeats: expected an int >= 1"),
    ("gpu_check.py", ["--dry-run", "--repeats", "-1"], "argument --repeats: expected an int >= 1, got -1"),
    ("gpu_check.py", ["--dry-run", "--out", "FILE"], "is a file, not a folder")])
def test_the_benchmark_scripts_refuse_bad_flags_by_name(tmp_path, script, args, says):
    """Bad values ran into tracebacks (StatisticsError, ZeroDivisionError, unpacking), and a speed-suite
    run of some parts replaced the committed results with a partial report."""
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / a) if a in ("OUT", "FILE") else a for a in args]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT}, cwd=tmp_path)
    assert out.returncode == 2 and says in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "OUT").exists()


def test_a_compiled_candidate_that_fails_is_reported_and_the_others_timed():
    """A compiled network step that raises (e.g. inductor's compiler failing on that machine) becomes a
    'failed' row of the report instead of ending the run."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)

    def broken():
        raise RuntimeError("PassManager::run failed")
    fns = {"works": lambda: None, "broken": broken}
    graphs, failed = gpu_check._compiled_graphs_of(fns)
    assert list(fns) == ["works"] and list(graphs) == ["works"]
    assert list(failed) == ["broken"] and "PassManager::run failed" in failed["broken"]
    row = {"network": "Table 10", "T": 8, "candidate": "broken, compiled", "error": failed["broken"]}
    text = gpu_check.markdown({"versions": {"device": "cpu"}, "network": [row]})
    assert "| Table 10 | 8 | broken, compiled | failed: RuntimeError: PassManager::run failed |" in text


def test_a_dry_run_leaves_the_gpu_results_alone(tmp_path):
    """Without --out or $OUT a dry run (tiny CPU figures) writes to a new temporary folder, not into
    benchmarks/results/gpu, where it had landed and been committed once."""
    results = os.path.join(ROOT, "benchmarks", "results", "gpu")
    before = sorted(os.listdir(results))
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--sections",
                          "neuron"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**env, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    folder = out.stdout.strip().splitlines()[-1].removeprefix("written to ")
    assert os.path.isfile(os.path.join(folder, "gpu_check.json")) and not folder.startswith(results), out.stdout
    assert sorted(os.listdir(results)) == before
