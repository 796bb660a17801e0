"""Values read from files reach the terminal escaped: error lines whole, the trainer's log lines but their newlines."""

from __future__ import annotations

import io
import logging

from flux_cp.errors import UsageError
from flux_cp.run import runner
from flux_cp.terminal import escape_logs, printable

EVIL = "Flux\x1b[2J\x1b[31mPipeline\r\u202egnp.\nerror: forged"


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest():
    assert printable("café, 東京 and 'quotes'") == "café, 東京 and 'quotes'"
    assert printable(EVIL) == "Flux\\x1b[2J\\x1b[31mPipeline\\r\\u202egnp.\\nerror: forged"
    assert printable("a\nb\tc\x07", keep="\n\t") == "a\nb\tc\\x07"


def test_an_error_line_quoting_a_file_is_one_line_with_its_escapes_written_out(capsys):
    def main() -> int:
        raise UsageError(f"--pretrained_model_name_or_path m is a {EVIL}; flux-cp trains FLUX.1")

    assert runner.run(main) == 2
    err = capsys.readouterr().err
    assert err == ("error: --pretrained_model_name_or_path m is a Flux\\x1b[2J\\x1b[31mPipeline\\r\\u202egnp.\\nerror: "
                   "forged; flux-cp trains FLUX.1\n")  # fmt: skip


def test_log_lines_are_escaped_but_keep_their_newlines():
    logger = logging.getLogger("flux_cp.test_terminal")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        escape_logs(logger)
        escape_logs(logger)  # once is enough
        logger.info("resumed from c (written with %s)", EVIL)
        logger.info("done: 2 steps\n  README.md  model card")
    finally:
        logger.removeHandler(handler)
    # newlines stay (the summary has several lines): values from files are escaped whole where they are logged
    assert stream.getvalue() == ("resumed from c (written with Flux\\x1b[2J\\x1b[31mPipeline\\r\\u202egnp.\nerror: "
                                 "forged)\ndone: 2 steps\n  README.md  model card\n")  # fmt: skip


def test_the_error_line_given_to_the_launcher_is_escaped_too(tmp_path, monkeypatch, capsys):
    """accelerate launch (torchrun's agent) prints the error file's message in its own report, on the terminal."""
    import json

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))

    def main() -> int:
        raise UsageError(f"a {EVIL}")

    assert runner.run(main) == 2
    message = json.loads((tmp_path / "error.json").read_text())["message"]
    assert message == "error: a Flux\\x1b[2J\\x1b[31mPipeline\\r\\u202egnp.\\nerror: forged"
    assert message.isprintable()


def test_the_loss_curve_of_a_folder_named_with_escapes_and_dollars_is_drawn(tmp_path):
    """The curve's title is the metrics file's path: a `$...$` in it is text (not mathtext, which fails on a
    malformed formula at the end of a run), and its control characters are escaped."""
    import json

    from flux_cp.outputs.metrics import plot_loss_curve

    out = tmp_path / "run$\\frac$ \x1b[2J"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2)))
    assert plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png").stat().st_size > 0
