"""The `octavo` command as a newcomer meets it, run as a subprocess: Ctrl-C (SIGINT) in the
middle of a generation and of a chat reply, and bad arguments failing before the model loads."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

# Threads fight over a shared CPU; one keeps the generation steady under a loaded test run.
ENV = dict(os.environ, OMP_NUM_THREADS="1")
OCTAVO = [sys.executable, "-m", "octavo.entrypoints.cli"]


def start(*args: str, stdin=None) -> subprocess.Popen:
    return subprocess.Popen(
        [*OCTAVO, *args], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )


def read_until(proc: subprocess.Popen, done, timeout: float = 60.0) -> str:
    """Reads stdout until `done(text so far)` holds; fails the test after `timeout` s."""
    text = b""
    deadline = time.monotonic() + timeout
    while not done(text.decode(errors="replace")):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
        if not ready:
            proc.kill()
            pytest.fail(f"timed out waiting for output; so far {text!r}")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            pytest.fail(f"stdout closed early; so far {text!r}, stderr {proc.stderr.read()!r}")
        text += chunk
    return text.decode(errors="replace")


@pytest.mark.slow  # a process that loads the model; test_cli.py's Ctrl-C runs in this one
def test_ctrl_c_stops_generate_prints_the_partial_text_and_exits_130(smollm2_path):
    proc = start("generate", "Once upon a time", "--max-tokens", "2000")
    partial = read_until(proc, lambda text: len(text.split()) >= 2)  # words are streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130  # 0 had the generation ended before the signal
    assert partial.split() and out.decode().endswith("\n")  # the text so far, then a newline
    assert "interrupted" in err.decode()
    assert "Traceback" not in err.decode()


@pytest.mark.slow  # a process that loads the model
def test_ctrl_c_stops_a_chat_reply_then_quits_at_the_prompt(smollm2_path):
    proc = start("chat", "--max-tokens", "2000", stdin=subprocess.PIPE)
    read_until(proc, lambda text: text.endswith("> "))
    proc.stdin.write(b"Tell me a long story about a dragon and a knight.\n")
    proc.stdin.flush()
    read_until(proc, lambda text: len(text.split()) >= 2)  # the reply is streaming
    proc.send_signal(signal.SIGINT)
    read_until(proc, lambda text: text.endswith("\n> "), timeout=30)  # back at the prompt
    proc.send_signal(signal.SIGINT)  # at the prompt: quit
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "Traceback" not in err.decode()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--temperature", "-1"], "argument --temperature: must be"),
        (["generate", "hi", "--top-p", "0"], "argument --top-p: must be"),
        (["generate", "--file", "/no/such/prompts.txt"], "--file /no/such/prompts.txt"),
        (["generate"], "give a prompt or --file"),
        (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "hi", "--device", "gpu"], "--device"),
        (["chat", "--top-k", "-5"], "argument --top-k: must be"),
        (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["bench", "throughput", "--num-prompts", "x"], "--num-prompts"),
    ],
)
def test_bad_arguments_fail_at_once_with_one_line(args, message):
    """Checked before the model loads (which takes seconds): no traceback, exit status 2."""
    start_time = time.monotonic()
    result = subprocess.run(
        [*OCTAVO, *args], capture_output=True, text=True, env=ENV, timeout=30, check=False
    )
    assert time.monotonic() - start_time < 3.0
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr  # no usage block


def test_help_shows_the_defaults():
    result = subprocess.run(
        [*OCTAVO, "generate", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    for default in ("(default: 256)", "(default: 0.0)", "(default: auto)", "(default: 1.0)"):
        assert default in " ".join(result.stdout.split()), default


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "serve"]])
def test_help_shows_each_default_once(command):
    result = subprocess.run(
        [*OCTAVO, *command, "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    options = re.split(r"\n  -", result.stdout)[1:]  # one chunk per option
    assert sum("(default:" in option for option in options) >= 3
    for option in options:
        assert option.count("default") <= 1, option


def test_version():
    result = subprocess.run([*OCTAVO, "--version"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.startswith("octavo 0.")


def test_every_option_of_every_command_has_a_help_text():
    """So that --help explains each one and shows its default (cli_args.HelpFormatter)."""
    import argparse

    from octavo.entrypoints.cli import build_parser

    def walk(parser, command):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{command} {name}")
            elif action.option_strings and action.dest != "help" and not action.help:
                yield f"{command} {action.option_strings[0]}"

    assert list(walk(build_parser(), "octavo")) == []
