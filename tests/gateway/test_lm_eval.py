"""lm-eval (``lm-eval[api]``) against the whole system, as a user runs it against vLLM:
``local-completions`` on a multiple-choice (loglikelihood) task and ``local-chat-completions``
on a generate-until task, each on a small data file made here (no hub), with
``num_concurrent`` 2 and ``batch_size`` 2 (lm-eval batches completions' token-id prompts; it
runs chat one request at a time whatever the batch size), tokenizing through the server's
``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` (its remote tokenizer).

The multiple-choice accuracy lm-eval reports must equal the one the independent reference
(tests/stories_reference.py) gives on the same tokens: every loglikelihood request was
served and read right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.served import Served
from tests.stories_reference import StoriesReference

lm_eval = pytest.importorskip("lm_eval")

MODEL = "stories260K"
QUESTIONS = [
    ("Once upon a time, there was a little", ["girl", "rock", "table"]),
    ("Lily liked to play in the", ["park", "dog", "ran"]),
    ("Tim saw a big red", ["ball", "sad", "the"]),
    ("She was very", ["happy", "ball", "tree"]),
    ("One day, Tom went to the", ["park", "happy", "red"]),
    ("The sun was", ["shining", "dog", "girl"]),
]
MC_TASK = """
task: superinfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""
GEN_TASK = """
task: superinfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture
def tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c}) + "\n" for q, c in QUESTIONS))
    gen = tmp_path / "gen.jsonl"
    answers = [{"question": q, "answer": c[0]} for q, c in QUESTIONS]
    gen.write_text("".join(json.dumps(answer) + "\n" for answer in answers))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=mc))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=gen))
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tmp_path))


def _encode(served: Served, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    tokens: list[int] = httpx.post(f"{served.url}/tokenize", json=body).json()["tokens"]
    return tokens


def _reference_accuracy(served: Served, stories_path: Path) -> float:
    """lm-eval's rule on the reference: the choice (after a space) whose tokens have the
    largest summed log-probability after the question's (the pair encoded whole, the
    continuation being what follows the question's own tokens, as lm-eval splits it)."""
    reference = StoriesReference(stories_path)
    correct = 0
    for question, choices in QUESTIONS:
        context = _encode(served, question)
        scores = []
        for choice in choices:
            continuation = _encode(served, f"{question} {choice}")[len(context) :]
            logprobs = reference.logprobs(context + continuation)
            scores.append(
                sum(
                    logprobs[len(context) + i - 1, token].item()
                    for i, token in enumerate(continuation)
                )
            )
        correct += scores.index(max(scores)) == 0
    return correct / len(QUESTIONS)


def test_lm_eval_loglikelihood_and_generation(
    served: Served, tasks: Any, stories_path: Path
) -> None:
    completions = _evaluate(served, tasks, "local-completions", "superinfer_mc")
    accuracy = completions["results"]["superinfer_mc"]["acc,none"]
    assert accuracy == pytest.approx(_reference_accuracy(served, stories_path))
    chat = _evaluate(served, tasks, "local-chat-completions", "superinfer_gen")
    assert 0.0 <= chat["results"]["superinfer_gen"]["exact_match,none"] <= 1.0
    assert len(chat["samples"]["superinfer_gen"]) == len(QUESTIONS)


def _evaluate(served: Served, tasks: Any, model: str, task: str) -> Any:
    """lm-eval's run of ``task`` through ``model`` (its API client) against the server."""
    chat = model == "local-chat-completions"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    model_args = {"model": MODEL, "num_concurrent": 2, "max_retries": 1,
                  "tokenizer_backend": "remote", "base_url": f"{served.url}{path}"}  # fmt: skip
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], task_manager=tasks, batch_size=2,
        apply_chat_template=chat,
    )  # fmt: skip
