"""evals/gsm8k/prompts.py: the few-shot prompt and the stop strings."""

from __future__ import annotations

from evals.gsm8k.dataset import Example
from evals.gsm8k.prompts import STOP, build_prompt


def test_few_shot_prompt_layout():
    shots = [Example(f"Q{i}?", f"work {i}\n#### {i}") for i in range(5)]
    p = build_prompt(shots, Example("Final question?", "#### 99"))
    blocks = p.split("\n\n")
    assert len(blocks) == 6
    for i in range(5):
        assert blocks[i] == f"Question: Q{i}?\nAnswer: work {i}\n#### {i}"
    assert blocks[5] == "Question: Final question?\nAnswer:"
    assert "99" not in p  # the test answer never leaks into the prompt
    assert build_prompt([], Example("Only?", "#### 1")) == "Question: Only?\nAnswer:"
    assert "Question:" in STOP
    assert len(STOP) <= 4  # the OpenAI API / vLLM refuse more stop strings (HTTP 400)
