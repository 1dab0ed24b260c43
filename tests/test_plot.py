"""plot.py and report/metrics.py: a run's metrics file and TensorBoard events, and the pictures drawn from them.

The run is conftest.one_process_runs' (train.py on one process, two steps, each --dtype; tests/test_train.py reads
its printouts): its metrics file carries the start-up's figures on its first step and the end's on its last, and
plot.py turns it into three PNGs. A file without those figures (an older one) or cut short is drawn from what it
holds, and what it lacks is said; a file that is no metrics file is one line, exit 2.
"""

import json
import struct

import pytest

from cli.flags import FlagError, build_parser, validate
import plot
import report.run
from report import metrics
import train

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple:
    """(width, height) of a PNG, from its IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG, path
    return struct.unpack(">II", head[16:24])


def records(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_metrics_file_carries_the_start_ups_and_the_ends_figures(one_process_runs):
    """Every line is a step record as before (step, loss, ...); the first adds the time model's step by part and
    the memory by kind predicted, the last the measured step time and the memory held or measured."""
    steps = records(one_process_runs["dir"] / "fp32.jsonl")
    assert [r["step"] for r in steps] == [0, 1] and all("loss" in r for r in steps)
    startup, end = steps[0]["startup"], steps[-1]["end"]
    assert "startup" not in steps[-1] and "end" not in steps[0]
    parts = startup["time_predicted_s"]
    assert set(parts) == {"compute", "exposed_comm", "bubble", "update", "step"} and parts["compute"] > 0
    assert abs(parts["compute"] + parts["exposed_comm"] + parts["bubble"] + parts["update"] - parts["step"]) < 1e-9
    assert tuple(startup["memory_predicted"]) == report.run.MEMORY_KINDS == tuple(end["memory_measured"])
    assert end["memory_measured"]["weights"] == end["memory_predicted"]["weights"] > 0  # one process: DDP's bytes
    assert end["memory_measured"]["activations"] > 0 and end["memory_measured"]["step_peak"] > 0
    assert end["steps_timed"] == 1 and end["step_time_s"] > 0 and startup["peak_under_load"] is False


def test_plot_draws_the_loss_the_step_time_and_the_memory_of_a_run(one_process_runs, tmp_path, capsys):
    written = plot.main([str(one_process_runs["dir"] / "fp32.jsonl"), "--out-dir", str(tmp_path)])
    names = ["fp32.loss.png", "fp32.step_time.png", "fp32.memory.png"]
    assert [p.rsplit("/", 1)[-1] for p in written] == names
    for name in names:
        path = tmp_path / name
        assert path.stat().st_size > 10_000, name  # axes, labels and data: not an empty canvas
        assert png_size(path) == (900, 450), name
    out = capsys.readouterr().out
    assert "plot: no" not in out, out  # the file has every figure
    assert plot.KINDS.keys() == set(report.run.MEMORY_KINDS)


def test_a_file_without_the_figures_is_drawn_from_what_it_holds_and_says_what_is_missing(tmp_path, capsys):
    """An older metrics file (step records only, no val loss) and a last line cut short by a killed run: the loss
    and the measured step times are drawn, each missing figure is one line, and nothing raises."""
    old = tmp_path / "old.jsonl"
    lines = [json.dumps(dict(step=s, loss=5.0 - s / 10, lr=1e-3, grad_norm=1.0, tokens=128, step_time_s=0.1,
                             tokens_per_s=1280.0, mfu=0.01, skipped=False)) for s in range(5)]
    old.write_text("\n".join(lines) + '\n{"step": 5, "lo')
    written = plot.main([str(old)])
    assert [p.rsplit("/", 1)[-1] for p in written] == ["old.loss.png", "old.step_time.png"]
    out = capsys.readouterr().out
    for said in ("line 6 of", "no val_loss", "no time-model prediction", "no memory figures"):
        assert said in out, (said, out)
    assert png_size(tmp_path / "old.step_time.png") == (900, 450)


def test_what_is_no_metrics_file_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not json\n")
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n')
    for argv, said in (([str(tmp_path / "none.jsonl")], "is not a file"),
                       ([str(tmp_path / "notes.txt")], "holds no step record"),
                       ([str(tmp_path / "other.jsonl")], "holds no step record"),
                       ([str(tmp_path / "other.jsonl"), "--no-such-flag"], "unrecognized arguments")):
        with pytest.raises(SystemExit) as stop:
            plot.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not list(tmp_path.glob("*.png"))


def test_tensorboard_gets_the_step_figures_the_memory_by_kind_and_the_printouts(one_process_runs):
    """Where the tensorboard package is installed (it is not a requirement)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(one_process_runs["dir"] / "fp32"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert set(metrics.SCALARS.values()) - {"optimizer/loss_scale"} <= scalars, scalars  # fp32: no loss scale
    for what in ("predicted", "measured"):
        assert {f"memory/{what}/{kind}" for kind in report.run.MEMORY_KINDS} <= scalars, scalars
    assert [e.step for e in events.Scalars("loss/train")] == [0, 1] and len(events.Scalars("loss/val")) == 1
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert "predicted persistent memory" in texts["startup/text_summary"]
    assert "measured vs predicted" in texts["end/text_summary"]


def test_without_the_tensorboard_package_the_run_says_so_once_and_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)  # its import now fails
    run = metrics.Metrics(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), rank=0)
    run.step(dict(step=0, loss=1.0))
    run.text("startup", "printed")
    run.close()
    out = capsys.readouterr().out
    assert out.count("the tensorboard package is not installed") == 1 and "pip install tensorboard" in out, out
    assert records(tmp_path / "m.jsonl") == [dict(step=0, loss=1.0)] and not (tmp_path / "tb").exists()
    other = metrics.Metrics(str(tmp_path / "r1.jsonl"), str(tmp_path / "tb1"), rank=1)  # only rank 0 writes
    assert other.wanted and other.file is None and other.board is None and not (tmp_path / "r1.jsonl").exists()


@pytest.mark.parametrize("where,said", [("a-file", "is a file, not a directory"), ("/proc/tb", "cannot be written")])
def test_a_tensorboard_directory_that_cannot_be_made_is_a_flag_error(tmp_path, where, said):
    """--tensorboard DIR is checked with the other paths, before any process group: one error naming the flag."""
    (tmp_path / "a-file").write_text("taken")
    path = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(FlagError) as error:
        validate(build_parser().parse_args(["--preset", "tiny", "--tensorboard", path]), 1, axes=train.AXES)
    assert str(error.value).startswith("--tensorboard ") and said in str(error.value), error.value
