"""The ``merak`` command: its verbs dispatch to each tool's main, with the verb in the usage line."""

from __future__ import annotations

import pytest

from merak.cli import VERBS, main


def test_no_verb_or_help_lists_every_verb(capsys):
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(verb in printed for verb in VERBS)
    assert main([]) == 2


def test_an_unknown_verb_is_named_with_the_choices(capsys):
    assert main(["trian"]) == 2
    assert "unknown verb 'trian'; choose one of plan, simulate" in capsys.readouterr().err


def test_a_verb_runs_its_tool_under_its_own_name(capsys):
    assert main(["simulate", "--stages", "2", "--microbatches", "4"]) == 0
    assert "1f1b: 2 stages x 4 microbatches" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert capsys.readouterr().out.startswith("usage: merak simulate")
