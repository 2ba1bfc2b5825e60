"""sled-bench grammars: its valid answers walk the server's own llguidance grammars to the end, and without
xgrammar installed it says how to install it rather than measuring one side."""

import sys

import pytest

from bench import grammars
from verify_server.model_loader import vocabulary_tokenizer


def test_every_answer_is_taken_whole_by_the_servers_grammars():
    hf = vocabulary_tokenizer()
    lib = grammars.Llguidance(hf, len(hf), hf.eos_token_id)
    row = grammars.measure(lib, hf, hf.eos_token_id, repeats=1)
    tokens = sum(len(hf.encode(a, add_special_tokens=False)) + 1 for *_, answers in grammars.TASKS for a in answers)
    assert row["positions"] == tokens and row["library"] == "llguidance"


def test_a_wrong_answer_is_refused_where_it_breaks_the_schema(monkeypatch):
    hf = vocabulary_tokenizer()
    monkeypatch.setattr(grammars, "TASKS", [("person", grammars.PERSON, ['{"name": "Ada", "age": "old"}'])])
    lib = grammars.Llguidance(hf, len(hf), hf.eos_token_id)
    with pytest.raises(RuntimeError, match="person answer .* refused at token"):
        grammars.measure(lib, hf, hf.eos_token_id, repeats=1)


def test_without_xgrammar_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    assert grammars.main(grammars.build_parser().parse_args([])) == 1
    assert "pip install --no-deps xgrammar apache-tvm-ffi" in capsys.readouterr().err
