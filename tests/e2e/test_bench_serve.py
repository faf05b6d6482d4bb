"""`octavo bench serve` against a model with no tokenizer (dummy weights, as on the GPU):
prompts go as token ids, and streamed chunks count as tokens though their text is empty."""

from __future__ import annotations

import json

from model_utils import TINY
from server_fixture import ServerThread

from octavo import LLM
from octavo.entrypoints import cli
from octavo.entrypoints.bench_serve import synthetic_prompts
from octavo.entrypoints.openai.api_server import build_app


def test_synthetic_prompts_lengths_and_ids():
    ids = synthetic_prompts(200, 100, seed=3, range_ratio=0.5, token_ids=7)
    assert len(ids) == 200
    assert all(50 <= len(p) <= 150 and all(0 <= t < 7 for t in p) for p in ids)
    assert min(map(len, ids)) < 60 and max(map(len, ids)) > 140  # the whole range is drawn
    assert ids == synthetic_prompts(200, 100, seed=3, range_ratio=0.5, token_ids=7)
    words = synthetic_prompts(5, 12, seed=3)
    assert all(isinstance(p, str) and len(p.split()) == 12 for p in words)


def test_bench_serve_sends_token_ids_to_a_model_without_a_tokenizer(tmp_path):
    config = TINY | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=256)
    assert llm.get_tokenizer() is None
    out_json = tmp_path / "bench.json"
    with ServerThread(build_app(llm.engine, "tiny")) as server:
        argv = [
            "bench", "serve", "--base-url", server.url, "--num-prompts", "6",
            "--request-rate", "50", "--max-tokens", "9", "--input-len", "20",
            "--random-range-ratio", "0.5", "--token-ids", str(TINY["vocab_size"]),
            "--json", str(out_json),
        ]  # fmt: skip
        assert cli.main(argv) == 0
    summary = json.loads(out_json.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 9
    expected = sum(map(len, synthetic_prompts(6, 20, 0, 0.5, TINY["vocab_size"])))
    assert summary["total_input_tokens"] == expected
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["mean_itl_ms"] > 0  # gaps between chunks whose text is empty


def test_bench_serve_rejects_bad_options(capsys):
    for option, value in (("--token-ids", "0"), ("--random-range-ratio", "1.0")):
        try:
            status = cli.main(["bench", "serve", option, value])
        except SystemExit as e:  # the parser's own checks
            status = e.code
        assert status == 2
        assert option in capsys.readouterr().err
