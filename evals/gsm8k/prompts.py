"""Few-shot prompts for GSM8K on the completions endpoint.

The prompt is ``num_fewshot`` worked train examples followed by the test question:

    Question: <train q1>
    Answer: <train solution 1, ending in "#### n">

    ...

    Question: <test q>
    Answer:

The model continues after "Answer:"; generation stops at the next "Question:" so it cannot run
on into an invented next example.
"""

from __future__ import annotations

from typing import List, Sequence

from evals.gsm8k.dataset import Example

# At most 4: the OpenAI API (and vLLM, VLLM_MAX_STOP_STRINGS) refuses longer stop lists with
# HTTP 400. End-of-sequence tokens stop generation anyway.
STOP = ["Question:", "<|im_end|>", "<|endoftext|>", "\n\n\n"]


def format_example(ex: Example, with_answer: bool) -> str:
    text = f"Question: {ex.question.strip()}\nAnswer:"
    if with_answer:
        text += f" {ex.answer.strip()}"
    return text


def build_prompt(shots: Sequence[Example], question: Example) -> str:
    parts: List[str] = [format_example(s, with_answer=True) for s in shots]
    parts.append(format_example(question, with_answer=False))
    return "\n\n".join(parts)
