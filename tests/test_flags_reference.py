"""docs/flags.md, the flag reference, is what tools/flags_reference.py renders from the flag table: every flag of
the parser, under its --help section, with its type or choices, default and help line, so the page cannot leave a
flag out or keep one that is gone. And the help of a flag says what the code does where the docs had it wrong."""

from __future__ import annotations

import re

import pytest

from flux_cp.config.parser import build_parser
from flux_cp.families import FLUX1, FLUX2
from flux_cp.plan import memory as plan
from tools import flags_reference


def test_docs_flags_md_is_what_the_flag_table_renders():
    assert flags_reference.OUT.read_text() == flags_reference.render(), (
        "docs/flags.md differs from the flag table: python tools/flags_reference.py"
    )


def test_the_reference_lists_every_flag_once_under_its_help_section():
    text = flags_reference.render()
    parser = build_parser()
    flags = [a.option_strings[0] for a in parser._actions if a.dest != "help"]
    listed = re.findall(r"^\| `(--\w+)` \|", text, flags=re.M)
    assert sorted(listed) == sorted(flags) and len(listed) == len(set(listed))
    for group in parser._action_groups:
        own = [a.option_strings[0] for a in group._group_actions if a.dest != "help"]
        if not own:
            continue
        section = text[text.index(f"\n## {group.title}\n") :]
        section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
        assert set(re.findall(r"^\| `(--\w+)` \|", section, flags=re.M)) == set(own), group.title


def test_a_row_holds_the_flags_choices_default_and_help():
    text = flags_reference.render()
    (row,) = [line for line in text.splitlines() if line.startswith("| `--base_precision` |")]
    assert row.startswith("| `--base_precision` | `bf16` \\| `fp8` \\| `int8` \\| `nf4` | `bf16` | How the frozen")
    (row,) = [line for line in text.splitlines() if line.startswith("| `--train_batch_size` |")]
    assert (
        row
        == "| `--train_batch_size` | integer | 1, or the demo's (4) | Samples per data-parallel rank per micro-step. |"
    )
    (row,) = [line for line in text.splitlines() if line.startswith("| `--gradient_checkpointing` |")]
    assert row.startswith("| `--gradient_checkpointing` | text; alone: `auto` | `none` | Recompute")


def test_check_fails_on_a_stale_page_and_passes_on_the_rendered_one(tmp_path, monkeypatch, capsys):
    page = tmp_path / "flags.md"
    page.write_text(flags_reference.render().replace("| `--rank` |", "| `--rank_gone` |"))
    monkeypatch.setattr(flags_reference, "OUT", page)
    assert flags_reference.main(["--check"]) == 1
    assert "python tools/flags_reference.py" in capsys.readouterr().out
    assert flags_reference.main([]) == 0
    assert flags_reference.main(["--check"]) == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_gradient_checkpointing_s_help_names_the_end_the_planner_checkpoints(compiled):
    """`--gradient_checkpointing N` takes N blocks from the end whose blocks keep the most (flux_cp.plan.memory): the
    help says FLUX.1 checkpoints its first blocks and FLUX.2 its last, as the planner decides for each family."""
    (action,) = [a for a in build_parser()._actions if a.dest == "gradient_checkpointing"]
    assert "(FLUX.1: the first blocks, FLUX.2: the last)" in action.help
    for family, from_end in ((FLUX1, False), (FLUX2, True)):
        kinds = tuple((kind, 1) for kind, _, _ in family.block_lists)
        assert plan.checkpoint_from_end(kinds, plan.block_keeps(family, compiled)) == from_end, family
