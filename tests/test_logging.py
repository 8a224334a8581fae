"""The ``ferrokv`` logger (``ferrokv.logger``): INFO to stderr by default with one prefix,
``FERROKV_LOGGING_LEVEL`` sets the level, nothing goes through the root logger twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ferrokv.cli import main

PYTHON_DIR = str(Path(__file__).resolve().parents[1] / "python")
SCRIPT = """
import logging, sys
if sys.argv[1:] == ["root"]:
    logging.basicConfig(level=logging.DEBUG, format="ROOT %(message)s")  # an application's own logging
import ferrokv
log = logging.getLogger("ferrokv")
log.debug("dbg-line"); log.info("info-line"); log.warning("warn-line")
"""


def _run(env_level: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FERROKV_LOGGING_LEVEL"}
    env["PYTHONPATH"] = PYTHON_DIR  # this checkout's package, as in the test process
    if env_level is not None:
        env["FERROKV_LOGGING_LEVEL"] = env_level
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("level, shown", [
    (None, ["info-line", "warn-line"]),
    ("debug", ["dbg-line", "info-line", "warn-line"]),
    ("WARNING", ["warn-line"]),
    ("40", []),
])
def test_level_comes_from_the_environment(level, shown):
    r = _run(level)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert [line.split()[-1] for line in lines] == shown
    for line, name in zip(lines, shown):
        assert line.split()[0] == {"dbg-line": "DEBUG", "info-line": "INFO", "warn-line": "WARNING"}[name]
        assert line.count("ferrokv") == 1 and "[ferrokv] " in line
    assert r.stdout == ""


def test_application_logging_sees_each_line_once():
    r = _run(None, "root")
    assert r.stderr.count("info-line") == 1 and "ROOT" not in r.stderr


def test_bad_level_names_the_variable():
    r = _run("LOUD")
    assert r.returncode != 0
    assert "FERROKV_LOGGING_LEVEL: 'LOUD' is not a logging level" in r.stderr


def test_cli_logs_one_prefix(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir("cli")), "--raw", "--quiet", "--max-tokens", "2",
               "--num-kv-blocks", "64", "--max-model-len", "120", "hello"])
    assert rc == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "loaded in" in line]
    assert len(err) == 1
    assert err[0].startswith("INFO ") and err[0].count("[ferrokv]") == 1 and "[ferrokv] model " in err[0]
    assert "ferrokv: ferrokv" not in err[0] and "ferrokv: model" not in err[0]
    # 63 usable blocks; a 120-token sequence holds 8 whole blocks of 16: 7.9 at once (not 1008 / 120).
    assert "KV cache: 63 blocks x 16 tokens (+1 reserved)" in err[0]
    assert "max concurrency 7.9 at max_model_len=120" in err[0]
