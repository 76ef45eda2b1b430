"""benchmarks/scaling.py on CPUs: 1 and 2 processes over gloo through torchrun, both
workloads, so that the multi-GPU run is one command (see the benchmark's docstring)."""
import json
from types import SimpleNamespace

from benchmarks import scaling


def test_scaling_runs_both_workloads_on_one_and_two_processes(tmp_path):
    out = tmp_path / "scaling.json"
    scaling.main(["--device", "cpu", "--procs", "1", "2", "--small", "--presets", "hstu", "--steps", "2", "--warmup", "1",
                  "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["workload"], r["procs"]) for r in rows] == [("embedding", 1), ("embedding", 2), ("hstu", 1), ("hstu", 2)]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["samples_per_s_per_gpu"] > 0 and 0 <= r["comm_share"] < 1
        assert r["comm_ms_per_step"] >= 0 and (r["comm_ms_per_step"] > 0) == (r["comm_share"] > 0) and "error" not in r
        assert r["efficiency"] > 0
    one, two = [r for r in rows if r["workload"] == "embedding"]
    assert one["efficiency"] == 1.0 and one["comm_share"] == 0.0 and two["comm_share"] > 0  # two ranks exchange ids and rows
    hstu = [r for r in rows if r["workload"] == "hstu"]
    assert hstu[1]["comm_share"] > 0 and hstu[0]["tflops_per_gpu"] > 0  # DDP's all-reduce, timed through its comm hook
    assert hstu[1]["balanced_batches"]  # the ranks' shares split by cost, the training default
    # every rank's own view of the plain pass: its steps as its host saw them, no frame
    # compiled during it (no torch.compile here); the interpreter compiles no Triton kernel
    # (TritonCompiles' own test below)
    for r in hstu:
        assert [v["rank"] for v in r["ranks"]] == list(range(r["procs"]))
        for v in r["ranks"]:
            assert 0 < v["median_step_ms"] <= v["slowest_step_ms"]
            assert v["frames_compiled_in_plain_pass"] == 0 and v["triton_compiles_in_plain_pass"] == []


def test_triton_compiles_are_named_while_on_and_the_hook_before_still_runs():
    """The hook Triton calls after compiling a kernel: recorded (the kernel's name and the
    arguments it was specialized on) only while on; a hook set before keeps being called."""
    from triton import knobs

    before, earlier = knobs.runtime.jit_post_compile_hook, []
    knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["fn"].name)
    try:
        watch = scaling.TritonCompiles()
        fn = SimpleNamespace(name="_k", jit_function=SimpleNamespace(arg_names=["a_ptr", "n", "b_ptr"]))
        compile = {"configs": [{(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}]}
        for on in (False, True):
            watch.on = on
            knobs.runtime.jit_post_compile_hook(key="", repr="", fn=fn, compile=compile, is_manual_warmup=False, already_compiled=False)
        assert watch.kernels == ["_k: a_ptr, b_ptr"] and earlier == ["_k", "_k"]
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_a_failed_run_is_reported_as_such(tmp_path):
    """A worker that fails (here: no data) gives a row saying so, not an exception that
    would lose the runs after it."""
    row = scaling.launch(1, ["--workload", "hstu", "--preset", "hstu", "--data-dir", str(tmp_path / "missing"),
                             "--steps", "1", "--warmup", "1"], "cpu")
    assert row == {"procs": 1, "error": "torchrun exited with 1"}
    assert "torchrun exited with 1" in scaling.table_line({"workload": "hstu", "preset": "hstu"} | row)
