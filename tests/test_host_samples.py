"""benchmarks/host_samples.py on py-spy raw samples written by hand: each thread's time per
step, its functions' inclusive and own time, compilation left out, --within."""
import pytest

from benchmarks import host_samples

SAMPLES = """\
thread (1): MainThread;run (a.py:1);training_step (m.py:5);attend (h.py:9) 30
thread (1): MainThread;run (a.py:1);training_step (m.py:5);attend (h.py:9);launch (l.py:3) 10
thread (1): MainThread;run (a.py:1);training_step (m.py:5);compile_fx (torch/_inductor/compile_fx.py:1) 500
thread (1): MainThread;run (a.py:1);prepare (d.py:2) 20
thread (2) 40
thread (2);backward (b.py:4) 20
"""


def test_threads_functions_and_compilation_left_out(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text(SAMPLES)
    # 10 steps at 1,000 samples a second: a sample is 1 ms of the run, 0.1 ms a step
    summary = host_samples.summarize(host_samples.load(str(path)), steps=10, rate=1000)
    assert list(summary) == ["thread (1): MainThread", "thread (2)"]
    main = summary["thread (1): MainThread"]
    assert main["ms_per_step"] == pytest.approx(6.0)  # 30 + 10 + 20; the compiling 500 left out
    inclusive = dict(main["inclusive"])
    assert inclusive["run (a.py:1)"] == pytest.approx(6.0) and inclusive["training_step (m.py:5)"] == pytest.approx(4.0)
    assert dict(main["own"]) == pytest.approx({"attend (h.py:9)": 3.0, "prepare (d.py:2)": 2.0, "launch (l.py:3)": 1.0})
    # a thread's samples with no frame (C++ work or idle) count in its total, not as a function's
    assert summary["thread (2)"]["ms_per_step"] == pytest.approx(6.0) and dict(summary["thread (2)"]["own"]) == {"backward (b.py:4)": pytest.approx(2.0)}
    step = host_samples.summarize(host_samples.load(str(path)), steps=10, rate=1000, within="training_step")
    assert list(step) == ["thread (1): MainThread"] and step["thread (1): MainThread"]["ms_per_step"] == pytest.approx(4.0)


def test_a_line_that_is_not_a_sample_is_refused_with_its_place(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("thread (1);f (a.py:1) 3\nnot a sample\n")
    with pytest.raises(ValueError, match=r"samples.txt:2"):
        host_samples.load(str(path))
