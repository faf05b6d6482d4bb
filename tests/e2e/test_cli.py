"""The `octavo` command on the embedded model."""

from __future__ import annotations

import io

import pytest

from octavo.entrypoints import cli


@pytest.fixture
def shared_llm(llm, monkeypatch):
    """Reuse the session's engine instead of loading the model again."""
    monkeypatch.setattr(cli, "_llm", lambda args: llm)
    return llm


def test_generate_prints_the_greedy_completion(shared_llm, capsys):
    assert cli.main(["generate", "The capital of France is", "--max-tokens", "8"]) == 0
    printed = capsys.readouterr().out.strip()
    from octavo import SamplingParams

    expected = (
        shared_llm.generate(
            "The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert printed == expected.strip()


def test_generate_from_file_with_chat_template(shared_llm, capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("Say hi.\n\nName a colour.\n")
    assert cli.main(["generate", "--file", str(f), "--chat", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "=== Say hi." in out and "=== Name a colour." in out


def test_generate_bad_option_is_a_clear_error(shared_llm, capsys):
    assert cli.main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_chat_keeps_the_conversation_and_streams(shared_llm, capsys, monkeypatch):
    seen: list[list[dict]] = []
    real = cli.stream_chat_reply

    def spy(llm, conversation, params):
        seen.append([dict(m) for m in conversation])
        pieces = list(real(llm, conversation, params))
        assert len(pieces) > 1  # streamed in several pieces, not all at once
        yield from pieces

    monkeypatch.setattr(cli, "stream_chat_reply", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\nWhat did I just say?\n/exit\n"))
    assert cli.main(["chat", "--max-tokens", "12"]) == 0
    assert len(seen) == 2
    assert seen[1][0]["content"] == "Hello!"
    assert seen[1][1]["role"] == "assistant" and seen[1][1]["content"]
    assert seen[1][1]["content"] in capsys.readouterr().out
    assert not shared_llm.engine.has_unfinished_requests()


def test_chat_ends_cleanly_at_end_of_input(shared_llm, monkeypatch, capsys):
    """Ctrl-D (end of input) at the prompt quits with status 0."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\n"))
    assert cli.main(["chat", "--max-tokens", "4"]) == 0
    assert not shared_llm.engine.has_unfinished_requests()


def test_ctrl_c_between_steps_aborts_and_leaves_the_engine_usable(shared_llm):
    """The first Ctrl-C is held until the step in flight ends; the requests are then aborted,
    so chat can go on with the same engine."""
    import signal

    from octavo import SamplingParams

    params = SamplingParams(max_tokens=50, temperature=0)
    pieces = []
    for i, text, _ in cli.stream_generation(shared_llm.engine, ["Once upon a time", "Hi"], params):
        pieces.append((i, text))
        if len(pieces) == 3:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C: handled, no KeyboardInterrupt
    assert 3 <= len(pieces) <= 5  # the step in flight finished, no step after it
    assert not shared_llm.engine.has_unfinished_requests()
    (out,) = shared_llm.generate("Hi", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_generate_says_how_many_cpu_threads_compute(capsys, monkeypatch):
    import torch

    threads = torch.get_num_threads()
    try:
        assert cli.main(["generate", "Hi", "--max-tokens", "2", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "octavo: 1 CPU threads (threads; --threads or OCTAVO_NUM_THREADS" in err
