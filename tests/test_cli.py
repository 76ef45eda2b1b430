"""The `hstu` command line's errors: a message naming the problem and exit status 1, the
traceback only with --debug."""
import argparse

import pytest

from kernels.dynamic_embedding import DumpError
from lightning_modules.datasets import DataError
from pipelines.cli import main as hstu


def test_bad_input_ends_in_a_message_not_a_traceback(tmp_path, capsys):
    (tmp_path / "v.csv").write_text("user_id,item_id,timestamp\n1,2,3\n1,2,3.5\n")
    with pytest.raises(SystemExit) as e:
        hstu(["prepare", "--dataset", "csv", "--input", str(tmp_path / "v.csv"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("hstu: error: ") and "v.csv:3: field 'timestamp'" in err
    assert "Traceback" not in err

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        hstu(["dump", "--train-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "m")])
    assert e.value.code == 1 and "not a complete model directory" in capsys.readouterr().err


def test_serving_a_path_without_an_export_is_the_commands_error(tmp_path, capsys):
    """Before any server starts: not a traceback from the server's startup."""
    with pytest.raises(SystemExit) as e:
        hstu(["serve", "--export", str(tmp_path / "none"), "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err == f"hstu: error: {tmp_path / 'none'}: not an exported model (no export.json)\n"


def test_debug_shows_the_exception(tmp_path):
    (tmp_path / "v.csv").write_text("user_id,item_id,timestamp\n1,2,x\n")
    with pytest.raises(DataError, match="v.csv:2"):
        hstu(["--debug", "prepare", "--dataset", "csv", "--input", str(tmp_path / "v.csv"), "--out", str(tmp_path / "o")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError):
        hstu(["--debug", "dump", "--train-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "m")])


def test_training_without_prepared_data_stops_before_any_worker_starts(tmp_path, capsys):
    """`hstu train` names the missing splits instead of a worker's traceback; the worker
    itself (what a PyTorchJob's pods run) says the same and exits."""
    import subprocess
    import sys

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        hstu(["train", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "data: not prepared data (no valid.parquet, test.parquet;" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # no worker ran
    worker = subprocess.run(
        [sys.executable, "-m", "lightning_modules.train", "--data-dir", str(tmp_path / "none"), "--out-dir", str(tmp_path / "o")],
        capture_output=True, text=True,
    )
    assert worker.returncode == 1 and "hstu-train: error: " in worker.stderr and "none: not prepared data (no such directory" in worker.stderr
    assert "Traceback" not in worker.stderr


@pytest.mark.parametrize("argv,message", [
    (["run", "--workers", "0"], "argument --workers: 0 is below 1"),
    (["run", "--epochs", "0"], "argument --epochs: 0 is below 1"),
    (["train", "--data-dir", "d", "--out", "o", "--patience", "-2"], "argument --patience: -2 is below -1"),
    (["manifest", "--data-dir", "d", "--out-dir", "o", "--gpus", "two"], "argument --gpus: 'two' is not a whole number"),
    (["serve", "--export", "e", "--max-batch", "0"], "argument --max-batch: 0 is below 1"),
    (["serve", "--export", "e", "--max-wait-ms", "-1"], "argument --max-wait-ms: -1.0 is outside [0.0, inf)"),
    (["recommend", "--export", "e", "--history", "1,a"], "argument --history: 'a' is not an item id"),
    (["recommend", "--export", "e", "--history", str(2**63)], f"argument --history: {2**63} is outside int64"),
])
def test_values_out_of_range_are_refused_when_parsed(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        hstu(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_history_is_item_ids_between_commas():
    from lightning_modules.arguments import item_ids

    assert item_ids(" 1, 2,,-3 ,") == [1, 2, -3]
    with pytest.raises(argparse.ArgumentTypeError, match="no item id given"):
        item_ids(" , ")


def test_the_training_workers_counts_are_checked_too():
    from lightning_modules.config import HSTUConfig
    from lightning_modules.train import model_config, parse_args

    assert parse_args(["--data-dir", "d", "--out-dir", "o", "--loader-workers", "0", "--max-steps", "-1"]).loader_workers == 0
    assert parse_args(["--data-dir", "d", "--out-dir", "o", "--dropout", "0", "--lr", "1e-3"]).dropout == 0.0
    args = parse_args(["--data-dir", "d", "--out-dir", "o", "--preset", "hstu-long", "--row-multiple", "0"])
    assert model_config(args, 100).row_multiple == 0  # the flag reaches the config
    assert model_config(parse_args(["--data-dir", "d", "--out-dir", "o"]), 100).row_multiple == HSTUConfig().row_multiple
    assert model_config(parse_args(["--data-dir", "d", "--out-dir", "o", "--compile-model"]), 100).compile_model
    assert not model_config(parse_args(["--data-dir", "d", "--out-dir", "o"]), 100).compile_model
    for flag, value in (("--batch-size", "0"), ("--row-multiple", "-1"), ("--epochs", "-1"), ("--patience", "-1"), ("--log-every", "0"), ("--lr", "0"),
                        ("--dropout", "1.0"), ("--dropout", "x"), ("--checkpoint-minutes", "-5")):
        with pytest.raises(SystemExit):
            parse_args(["--data-dir", "d", "--out-dir", "o", flag, value])
