"""Progress on stderr: tqdm's bar on a terminal; in a log file a plain line every max(1, steps // 100) steps (the
first and the last too), and no library bars. The trainer's own log is checked in test_run_outputs.py."""

from __future__ import annotations

import io
import logging

from flux_cp import bars


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flux_cp"]


def _steps(bar: bars.StepBar, steps: range) -> None:
    for step in steps:
        bar.step(step, 1.0 / step, 1e-4, 0.25, 1234.4, 0.42 if step % 2 else None)


def test_a_log_file_gets_a_line_every_hundredth_of_the_run_with_the_first_and_last_step(caplog):
    with caplog.at_level(logging.INFO, logger="flux_cp"):
        bar = bars.StepBar(250, 0, shown=True, terminal=False)
        _steps(bar, range(1, 251))
        bar.close()
    lines = _lines(caplog)
    assert lines[0] == "steps: 0/250, a line every 2 steps"
    assert [int(line.split()[1].split("/")[0]) for line in lines[1:]] == [1, *range(2, 251, 2)]
    assert lines[1] == "steps: 1/250: loss 1.0000, lr 1.00e-04, 0.25 s/step, 1234 tok/s, MFU 42%"
    assert lines[2] == "steps: 2/250: loss 0.5000, lr 1.00e-04, 0.25 s/step, 1234 tok/s"


def test_a_resumed_run_counts_from_its_step_and_a_short_run_says_every_step(caplog):
    with caplog.at_level(logging.INFO, logger="flux_cp"):
        bar = bars.StepBar(1000, 995, shown=True, terminal=False)
        _steps(bar, range(996, 1001))
        short = bars.StepBar(3, 0, shown=True, terminal=False)
        _steps(short, range(1, 4))
        bars.StepBar(7, 0, shown=False, terminal=False).step(1, 1.0, 1e-4, 0.1, 10.0)  # another rank: silent
    heads = [line.split(":")[1].strip() if line.count(":") > 1 else line for line in _lines(caplog)]
    resumed = ["steps: 995/1000, a line every 10 steps", "996/1000", "1000/1000"]
    assert heads == [*resumed, "steps: 0/3, a line every step", "1/3", "2/3", "3/3"]


def test_a_terminal_gets_tqdm_s_bar_and_no_lines(caplog, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    with caplog.at_level(logging.INFO, logger="flux_cp"):
        bar = bars.StepBar(4, 0, shown=True, terminal=True)
        _steps(bar, range(1, 5))
        bar.close()
    assert _lines(caplog) == []
    assert "steps: 100%" in err.getvalue() and "\r" in err.getvalue() and "loss=0.2500" in err.getvalue()


def test_the_libraries_bars_are_off_in_a_log_file_only(monkeypatch):
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    try:
        transformers_logging.enable_progress_bar()  # (a run in this process before turned them off: its stderr)
        diffusers_logging.enable_progress_bar()
        monkeypatch.setattr(bars, "on_terminal", lambda: True)
        bars.plain_output()
        assert transformers_logging.is_progress_bar_enabled() and diffusers_logging.is_progress_bar_enabled()
        monkeypatch.setattr(bars, "on_terminal", lambda: False)
        bars.plain_output()
        assert not transformers_logging.is_progress_bar_enabled() and not diffusers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()
        diffusers_logging.enable_progress_bar()
