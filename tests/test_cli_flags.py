"""What the three commands tell a new user: --version, --help with every default, and
`python3 -m ds4`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ds4

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
COMMANDS = {"ds4": "ds4.cli.main", "ds4-server": "ds4.cli.server", "ds4-replay": "ds4.cli.replay"}


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python3 -m MODULE ARGS`."""
    return subprocess.run([sys.executable, "-m", module, *args], env=ENV, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_version(prog: str) -> None:
    result = run(COMMANDS[prog], "--version")
    assert result.returncode == 0
    assert result.stdout == f"{prog} (ds4) {ds4.__version__}\n"


def test_python_m_ds4_is_the_ds4_command() -> None:
    assert run("ds4", "--version").stdout == f"ds4 (ds4) {ds4.__version__}\n"
    result = run("ds4", "generate", "--backend", "numpy", "-p", "Hi", "-n", "3")
    assert result.returncode == 0, result.stderr
    assert "decode: 3 tokens" in result.stderr


def help_entries(text: str) -> dict[str, str]:
    """Flag (each of its spellings) -> its whole help text, from argparse's --help."""
    entries: dict[str, str] = {}
    flags: list[str] = []
    for line in text.splitlines():
        if re.match(r"  -", line):  # an option's line: its spellings, maybe its help
            invocation, _, help_text = line.strip().partition("  ")
            flags = re.findall(r"(?:^|, )(-[\w-]+)", invocation)
            entries.update({f: help_text.strip() for f in flags})
        elif flags and line.startswith(" " * 8):  # the help goes on
            entries.update({f: (entries[f] + " " + line.strip()).strip() for f in flags})
        else:
            flags = []
    return entries


def test_server_help_shows_defaults_and_what_the_knobs_do() -> None:
    entries = help_entries(run("ds4.cli.server", "--help").stdout)
    for flag, default in [("--host", "127.0.0.1"), ("--port", "8000"), ("--parallel", "1"),
                          ("--ctx", "32768"), ("--prefill-chunk", "2048"),
                          ("--backend", "auto"), ("--tokens", "393216")]:
        assert f"(default: {default})" in entries[flag], (flag, entries[flag])
    assert "output token limit of a request that sets none" in entries["--tokens"]
    assert "prompt tokens the engine runs through the model in one step" in \
        entries["--prefill-chunk"]
    assert "memory-mapped checkpoint" in entries["--ssd-streaming"]
    assert "split the routed experts over N GPUs" in entries["--gpus"]
    assert "(default: None)" not in " ".join(entries.values())  # no default: nothing shown


def test_generate_and_replay_help_show_defaults() -> None:
    entries = help_entries(run("ds4", "generate", "--help").stdout)
    for flag, default in [("-n", "64"), ("--temperature", "0.0"), ("--min-p", "0.05"),
                          ("--ctx", "4096"), ("--backend", "auto")]:
        assert f"(default: {default})" in entries[flag], (flag, entries[flag])
    entries = help_entries(run("ds4.cli.replay", "--help").stdout)
    assert "send the requests to the server at this base URL" in entries["--url"]
    assert "(default: asap)" in entries["--timing"]


@pytest.mark.parametrize("argv, says", [
    (["ds4.cli.server", "--port", "70000"], "is not a port number (0-65535)"),
    (["ds4.cli.server", "--gpu-memory-gib", "0"], "must be > 0"),
    (["ds4", "generate", "-p", "hi", "--gpu-memory-gib", "-3"], "must be > 0"),
    (["ds4", "generate", "-p", "hi", "--mtp-draft", "x"], "'x' is not an integer"),
    (["ds4.cli.server", "--mtp-margin", "-1"], "must be >= 0"),
    (["ds4.cli.server", "--gpus", "0"], "0 must be >= 1"),
    (["ds4.cli.server", "--gpus", "2", "--backend", "numpy"], "--gpus needs CUDA devices"),
    (["ds4.cli.server", "--gpus", "2", "--gpu-memory-gib", "8"], "host overflow"),
    (["ds4", "generate", "-p", "hi", "--gpus", "2", "--backend", "numpy"], "needs CUDA"),
    (["ds4.cli.server", "--expert-owners", "owners.json"], "over the GPUs of --gpus N"),
    (["ds4", "generate", "-p", "hi", "--gpus", "2", "--expert-owners", "/no/such.json"],
     "--expert-owners /no/such.json"),
])
def test_numbers_out_of_range_exit_2_saying_what_is_wanted(argv, says):
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr
