"""The determinism table in full, in a file of its own so that the test runner's workers
share it out apart from the rest of test_determinism.py (it is the suite's longest test)."""

from __future__ import annotations

import pytest
from test_determinism import PATHS, _check_table, prompt_ids  # noqa: F401 (a fixture)


@pytest.mark.slow  # 16 chat questions, 48 greedy tokens
@pytest.mark.parametrize("path", PATHS)
def test_the_full_table_on_sixteen_questions(llm_factory, prompt_ids, path):  # noqa: F811
    # 24 blocks hold about four of the 86-token requests: they preempt each other
    # without the churn of a cache that holds one.
    _check_table(llm_factory, prompt_ids, PATHS[path], 48, kv_blocks=24)
