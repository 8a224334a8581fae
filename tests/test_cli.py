"""The ``ferrokv`` command line: generate and chat on a tiny model (in-process)."""

from __future__ import annotations

import io
import sys

import pytest

from ferrokv.cli import main


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("cli"))


def test_generate_prints_answers_and_stats(model, capsys):
    rc = main(["generate", "--model", model, "--raw", "--quiet", "--max-tokens", "5", "--num-kv-blocks", "64",
               "--block-size", "4", "--max-model-len", "128", "--no-enable-prefix-caching", "hello", "the cat"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "### hello" in out and "### the cat" in out
    assert "2 requests, 10 tokens generated" in out
    assert "KV cache: peak" in out and "prefix cache: 0 of" in out


def test_generate_reports_bad_flags_as_errors(model, capsys):
    rc = main(["generate", "--model", model, "--raw", "--quiet", "--temperature", "-1", "hi"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err
    rc = main(["generate", "--model", "/nonexistent/model", "--quiet", "hi"])
    assert rc == 2
    assert "/nonexistent/model" in capsys.readouterr().err


def test_chat_reads_turns_from_stdin(model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\nhow are you\n/exit\n"))
    rc = main(["chat", "--model", model, "--max-tokens", "4", "--num-kv-blocks", "64", "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("assistant> ") == 2
