"""Tests of examples/run_qa.py: SQuAD metrics on hand-computed cases, post-processing of hand-made logits, windows
over a context of more than 1,000 tokens, and end-to-end runs (v1 in one window of a long model, v1 in doc_stride
windows of a short one, v2 with unanswerable questions) on tiny local data and tiny models."""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import AutoModelForQuestionAnswering, RobertaConfig, RobertaModel, TrainingArguments

import hf_xformers
from examples import run_qa, utils_examples
from tests.tiny_tokenizers import SENTENCES, roberta_tokenizer
from tests.usage_errors import refused

# Short answers at known places of a long context; each question asks for one.
ANSWERS = ["zebra crossing", "lighthouse keeper", "seventeen apples", "copper kettle", "winter garden"]


def long_context(n_sentences: int = 44) -> tuple[str, list[int]]:
    """A context of ``n_sentences`` sentences (more than 1,000 tokens of the tiny tokenizer) with each of
    :data:`ANSWERS` spread over it; returns the context and each answer's first character."""
    pieces, starts, at = [], [], 0
    slots = {round(i * (n_sentences - 1) / (len(ANSWERS) - 1)): a for i, a in enumerate(ANSWERS)}
    for i in range(n_sentences):
        sentence = SENTENCES[i % len(SENTENCES)]
        if i in slots:
            sentence = f"{sentence} near the {slots[i]}"
            starts.append(at + len(sentence) - len(slots[i]))
        pieces.append(sentence + ".")
        at += len(sentence) + 2  # the period and the space that joins sentences
    return " ".join(pieces), starts


def squad_rows(n_examples: int, unanswerable: int = 0, n_sentences: int = 44) -> list[dict]:
    """Flattened SQuAD rows: ``n_examples`` questions over the long context (of ``n_sentences``), then
    ``unanswerable`` questions without an answer (SQuAD v2)."""
    context, starts = long_context(n_sentences)
    rows = []
    for i in range(n_examples):
        k = i % len(ANSWERS)
        rows.append({"id": f"q{i}", "title": "tiny", "context": context, "question": f" where is the {ANSWERS[k]}?",
                     "answers": {"text": [ANSWERS[k]], "answer_start": [starts[k]]}})  # fmt: skip
    for i in range(unanswerable):
        rows.append({"id": f"n{i}", "title": "tiny", "context": context, "question": "who owns the red balloon?",
                     "answers": {"text": [], "answer_start": []}})  # fmt: skip
    return rows


def squad_file(path: Path, n_examples: int, unanswerable: int = 0, n_sentences: int = 44, nested: bool = False) -> str:
    """:func:`squad_rows` written as a SQuAD-format file: flattened rows under ``data``, or with ``nested`` the
    official layout (articles -> paragraphs -> qas)."""
    rows = squad_rows(n_examples, unanswerable, n_sentences)
    data = rows
    if nested:
        qas = [{"id": r["id"], "question": r["question"], "is_impossible": not r["answers"]["text"],
                "answers": [{"text": t, "answer_start": a} for t, a in zip(*r["answers"].values())]}
               for r in rows]  # fmt: skip
        data = [{"title": "tiny", "paragraphs": [{"context": rows[0]["context"], "qas": qas}]}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "tiny", "data": data}))
    return str(path)


def tiny_longformer(path: Path, positions: int) -> Path:
    """A tiny hfx-longformer base model reading ``positions`` tokens, with the tiny BPE tokenizer."""
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    config = hf_xformers.HfxLongformerConfig(
        vocab_size=len(tokenizer), attention_window=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=positions + 2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf_xformers.HfxLongformerModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    return tiny_longformer(tmp_path_factory.mktemp("long_qa"), 1536)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    return tiny_longformer(tmp_path_factory.mktemp("short_qa"), 128)


def qa_args(model: Path, out: Path, train: str, dev: str, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(model), "--output_dir", str(out), "--train_file", train, "--validation_file", dev,
        "--do_train", "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "4", "--logging_steps", "1", "--save_strategy", "no", "--seed", "0",
        "--report_to", "none", "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


def data_args(**options) -> run_qa.DataTrainingArguments:
    return run_qa.DataTrainingArguments(**options)


# ---------------------------------------------------------------------------------------------------------------
# Metric
# ---------------------------------------------------------------------------------------------------------------


def test_normalisation_and_scores_by_hand():
    assert run_qa.normalize_answer("  The Eiffel-Tower, in  PARIS! ") == "eiffeltower in paris"
    assert run_qa.normalize_answer("an apple and a pear") == "apple and pear"
    assert run_qa.exact_match("the Copper kettle.", "copper kettle") == 1.0
    assert run_qa.exact_match("copper kettles", "copper kettle") == 0.0
    # "big red copper kettle" vs "copper kettle": 2 common tokens, precision 2/4, recall 2/2 -> F1 2/3.
    assert run_qa.token_f1("big red copper kettle", "the copper kettle") == pytest.approx(2 / 3)
    # Repeated tokens count with multiplicity: "a b b" (articles aside: "b b") vs "b": precision 1/2, recall 1.
    assert run_qa.token_f1("x x y", "x z") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert run_qa.token_f1("", "") == 1.0 and run_qa.token_f1("kettle", "") == 0.0
    assert run_qa.token_f1("the", "a") == 1.0  # both normalise to nothing


def test_squad_metrics_v1_best_over_gold_answers():
    references = {"a": ["copper kettle", "the kettle"], "b": ["winter garden"], "c": ["seventeen apples"]}
    predictions = {"a": "kettle", "b": "the winter garden", "c": "apples and pears"}
    metrics = run_qa.squad_metrics(predictions, references)
    # a: EM 1 against "the kettle"; b: EM 1; c: F1 = 2 * (1/3) * (1/2) / (1/3 + 1/2) = 0.4.
    assert metrics["exact_match"] == pytest.approx(200 / 3)
    assert metrics["f1"] == pytest.approx(100 * (1 + 1 + 0.4) / 3)
    assert metrics["total"] == 3 and "HasAns_total" not in metrics


def test_squad_metrics_v2_splits_and_best_threshold():
    references = {"a": ["copper kettle"], "b": ["winter garden"], "n1": [], "n2": []}
    # The best spans, and what a threshold of 0 made of them (odds > 0 -> nothing).
    spans = {"a": "copper kettle", "b": "summer garden", "n1": "red balloon", "n2": "kettle"}
    odds = {"a": -3.0, "b": 1.0, "n1": 2.0, "n2": -1.0}
    predictions = {q: ("" if odds[q] > 0 else spans[q]) for q in references}
    metrics = run_qa.squad_metrics(predictions, references, null_odds=odds, best_spans=spans)
    # a right, b empty (wrong), n1 empty (right), n2 "kettle" (wrong).
    assert metrics["exact_match"] == pytest.approx(50.0)
    assert metrics["HasAns_exact_match"] == pytest.approx(50.0) and metrics["HasAns_total"] == 2
    assert metrics["NoAns_exact_match"] == pytest.approx(50.0) and metrics["NoAns_total"] == 2
    assert metrics["HasAns_f1"] == pytest.approx(100 * (1 + 0) / 2)  # "summer garden" is not answered at 0
    # Thresholds, by hand: below -3 all empty: 2 right (n1, n2). At -3: a answered, 3 right. At -1: n2 answered
    # (wrong), 2. At 1: b answered, EM 0 (F1 0.5). At 2: n1 answered, wrong. Best EM: 3/4 at -3.
    assert metrics["best_exact_match"] == pytest.approx(75.0) and metrics["best_exact_match_thresh"] == -3.0
    # F1: at -3: 3; at -1: 2; at 1: 2.5; at 2: 1.5. Best 3/4 at -3.
    assert metrics["best_f1"] == pytest.approx(75.0) and metrics["best_f1_thresh"] == -3.0
    # All-empty is best when every span is wrong: the threshold then lies below every question's odds.
    wrong = {q: "nothing here" for q in references}
    low = run_qa.squad_metrics({q: "" for q in references}, references, null_odds=odds, best_spans=wrong)
    assert low["best_exact_match"] == pytest.approx(50.0) and low["best_exact_match_thresh"] < -3.0


# ---------------------------------------------------------------------------------------------------------------
# Post-processing of hand-made logits
# ---------------------------------------------------------------------------------------------------------------


def hand_made_windows():
    """One example, context "alpha beta gamma delta", read in two windows: tokens are words, CLS at 0, the question
    at 1, separators at 2 and at the end. Window 0 holds alpha beta gamma, window 1 beta gamma delta."""
    context = "alpha beta gamma delta"
    spans = {"alpha": (0, 5), "beta": (6, 10), "gamma": (11, 16), "delta": (17, 22)}
    first = [None, None, None, spans["alpha"], spans["beta"], spans["gamma"], None]
    second = [None, None, None, spans["beta"], spans["gamma"], spans["delta"], None]
    examples = Dataset.from_list([{"id": "x", "context": context, "answers": {"text": ["gamma delta"],
                                                                             "answer_start": [11]}}])  # fmt: skip
    windows = Dataset.from_dict({"example_id": ["x", "x"], "cls_index": [0, 0], "offset_mapping": [first, second]})
    return examples, windows


def test_postprocess_picks_the_best_span_across_windows():
    examples, windows = hand_made_windows()
    start = np.full((2, 8), -5.0)
    end = np.full((2, 8), -5.0)
    start[0, 4], end[0, 5] = 3.0, 3.0  # window 0: "beta gamma", score 6
    start[1, 4], end[1, 5] = 4.0, 3.5  # window 1: "gamma delta", score 7.5
    start[1, 7], end[1, 7] = 50.0, 50.0  # padding past window 1's length: never read
    start[0, 1], end[0, 1] = 20.0, 20.0  # the question (no offsets): never an answer
    answers = run_qa.postprocess(examples, windows, start, end, data_args())
    assert answers.predictions == {"x": "gamma delta"}
    best = answers.nbest["x"][0]
    assert {k: best[k] for k in ("text", "start", "score", "start_logit", "end_logit")} == {
        "text": "gamma delta", "start": 11, "score": 7.5, "start_logit": 4.0, "end_logit": 3.5}  # fmt: skip
    assert sum(c["probability"] for c in answers.nbest["x"]) == pytest.approx(1.0)
    assert answers.nbest["x"][1]["text"] == "beta gamma" and answers.null_odds == {}
    # An end before its start, or a span longer than max_answer_length, is no candidate.
    start, end = np.full((2, 8), -5.0), np.full((2, 8), -5.0)
    start[0, 5], end[0, 3] = 9.0, 9.0  # end before start
    start[1, 3], end[1, 5] = 2.0, 2.5  # "beta gamma delta": 3 tokens, score 4.5
    full = run_qa.postprocess(examples, windows, start, end, data_args(max_answer_length=3)).predictions["x"]
    assert full == "beta gamma delta"
    # At most 2 tokens: the best left is window 0's "gamma" alone (9 - 5), not its reversed span.
    short = run_qa.postprocess(examples, windows, start, end, data_args(max_answer_length=2)).predictions["x"]
    assert short == "gamma"


def test_postprocess_v2_null_answer_against_the_threshold():
    examples, windows = hand_made_windows()
    start, end = np.zeros((2, 7)), np.zeros((2, 7))
    start[:, 0], end[:, 0] = [4.0, 1.0], [4.0, 1.5]  # null scores 8 and 2.5: the lowest (2.5) counts
    start[1, 4], end[1, 5] = 1.0, 1.0  # best span "gamma delta", score 2
    v2 = dict(version_2_with_negative=True)
    answers = run_qa.postprocess(examples, windows, start, end, data_args(**v2))
    assert answers.null_odds["x"] == pytest.approx(0.5)
    assert answers.predictions["x"] == "" and answers.best_spans["x"] == "gamma delta"
    assert answers.nbest["x"][0]["text"] == ""  # the null answer competes in the n-best list
    lenient = run_qa.postprocess(examples, windows, start, end, data_args(null_score_diff_threshold=1.0, **v2))
    assert lenient.predictions["x"] == "gamma delta"


def test_postprocess_v2_answers_the_best_non_empty_span():
    """The planted case of issue 51: a span of one whitespace token (it covers no character: its text is empty) tops
    the candidates, and the best real span beats the null score by 30. transformers' rules answer the real span."""
    context = "alpha beta gamma delta  "  # a byte-level BPE makes a token of the last space, offsets (23, 23)
    tokens = [None, None, None, (0, 5), (6, 10), (11, 16), (17, 22), (23, 23), None]
    examples = Dataset.from_list([{"id": "x", "context": context, "answers": {"text": [], "answer_start": []}}])
    windows = Dataset.from_dict({"example_id": ["x"], "cls_index": [0], "offset_mapping": [tokens]})
    start, end = np.zeros((1, 9), np.float32), np.zeros((1, 9), np.float32)
    start[0, 0], end[0, 0] = 1.0, 1.0  # null score 2
    start[0, 7], end[0, 7] = 30.0, 10.0  # the whitespace token alone: score 40, text ""
    start[0, 5], end[0, 6] = 16.0, 16.0  # "gamma delta": score 32, 30 above the null score ("gamma delta " 26)
    args = data_args(version_2_with_negative=True)
    answers = run_qa.postprocess(examples, windows, start, end, args)
    assert answers.nbest["x"][0]["text"] == "" and answers.nbest["x"][0]["score"] == 40.0  # the empty span ranks first
    assert answers.predictions["x"] == answers.best_spans["x"] == "gamma delta"
    assert answers.null_odds["x"] == pytest.approx(-30.0)
    # The oracle says the same (the many equal scores of this case rank in another order in its n-best list).
    oracle = oracle_postprocess(examples, windows, start, end, v2=True)["x"]
    assert (oracle["answer"], oracle["best_span"], oracle["null_odds"]) == ("gamma delta", "gamma delta", -30.0)
    # Raised by 31, the null score beats the span by 1: no answer, by the same rules.
    start[0, 0] += 31.0
    assert run_qa.postprocess(examples, windows, start, end, args).predictions["x"] == ""
    assert oracle_postprocess(examples, windows, start, end, v2=True)["x"]["answer"] == ""


def oracle_postprocess(
    examples: Dataset,
    windows: Dataset,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    v2: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    threshold: float = 0.0,
) -> dict[str, dict]:
    """The rules of transformers' ``postprocess_qa_predictions`` (its example's ``utils_qa.py``), restated and
    applied by brute force: every (start, end) token pair of every window of an example is tried. Returns id ->
    ``{"answer", "best_span", "nbest", "null_odds"}`` (``null_odds`` None in v1).

    A pair is a candidate when both tokens lie in the context (their offset is not None), ``0 <= end - start <
    max_answer_length``, and its start (end) is among the ``n_best_size`` highest start (end) logits of the window.
    Its score is start logit + end logit; its text runs from the start token's first character to the end token's
    last. The n-best list is the ``n_best_size`` best candidates; v2 ranks the null answer among them (text "",
    score the start + end logit on CLS, the lowest over the windows; after candidates of equal score) and appends
    it when it falls out of the list. Probabilities: the softmax of the list's scores. v1 answers the top
    candidate; v2 the best candidate with a non-empty text, unless the null score beats it by more than
    ``threshold``. Where no candidate (v2: no non-empty one) exists, the answer is "" and, in v2, the null odds
    infinite: transformers answers its placeholder "empty" there. Equal scores rank by window, start, end
    (transformers: by its argsort); random logits have none.
    """
    example_of, offsets_of, cls_of = (list(windows[column]) for column in ("example_id", "offset_mapping", "cls_index"))
    results = {}
    for example in examples:
        context, candidates, null = example["context"], [], None
        for w in [w for w, example_id in enumerate(example_of) if example_id == example["id"]]:
            offsets = offsets_of[w]
            starts = [float(x) for x in start_logits[w][: len(offsets)]]
            ends = [float(x) for x in end_logits[w][: len(offsets)]]
            cls = cls_of[w]
            if null is None or starts[cls] + ends[cls] < null["score"]:
                null = {"text": "", "start": -1, "score": starts[cls] + ends[cls], "start_logit": starts[cls],
                        "end_logit": ends[cls]}  # fmt: skip
            # The n best tokens of the window: those at or above its n-th highest logit.
            start_cut, end_cut = (sorted(logits, reverse=True)[:n_best_size][-1] for logits in (starts, ends))
            for s, e in itertools.product(range(len(offsets)), repeat=2):
                if offsets[s] is None or offsets[e] is None or not 0 <= e - s < max_answer_length:
                    continue
                if starts[s] >= start_cut and ends[e] >= end_cut:
                    candidates.append({"text": context[offsets[s][0] : offsets[e][1]], "start": offsets[s][0],
                                       "score": starts[s] + ends[e], "start_logit": starts[s],
                                       "end_logit": ends[e]})  # fmt: skip
        ranked = sorted(candidates + ([null] if v2 else []), key=lambda c: -c["score"])  # stable: null after ties
        nbest = ranked[:n_best_size] + ([null] if v2 and null not in ranked[:n_best_size] else [])
        if nbest:
            weights = np.exp(np.array([c["score"] for c in nbest]) - max(c["score"] for c in nbest))
            nbest = [{**c, "probability": float(p)} for c, p in zip(nbest, weights / weights.sum())]
        spans = [c for c in ranked if c["text"]]
        result = {"best_span": spans[0]["text"] if spans else "", "nbest": nbest, "null_odds": None}
        if v2:
            result["null_odds"] = null["score"] - spans[0]["score"] if spans else math.inf
            result["answer"] = result["best_span"] if result["null_odds"] <= threshold else ""
        else:
            result["answer"] = ranked[0]["text"] if ranked else ""
        results[example["id"]] = result
    return results


def random_qa_windows(n_examples: int, seed: int) -> tuple[Dataset, Dataset, np.ndarray, np.ndarray]:
    """``n_examples`` contexts with irregular whitespace (whose byte-level BPE tokens cover no character), read by
    :func:`run_qa.featurize` in windows of 48 tokens, and standard normal float32 logits padded with -100 past each
    window, as Trainer pads them."""
    rng = np.random.default_rng(seed)
    separators = [" ", " ", " ", "  ", "   ", "\n\n "]
    rows = []
    for i in range(n_examples):
        words = " ".join(rng.choice(SENTENCES, size=rng.integers(1, 5))).split()
        context = "".join(word + separators[k] for word, k in zip(words, rng.integers(0, len(separators), len(words))))
        rows.append({"id": f"e{i}", "question": "what is it?", "context": context,
                     "answers": {"text": [], "answer_start": []}})  # fmt: skip
    examples = Dataset.from_list(rows)
    windows = examples.map(
        run_qa.featurize, batched=True, remove_columns=examples.column_names,
        fn_kwargs={"tokenizer": roberta_tokenizer(), "data_args": data_args(version_2_with_negative=True, doc_stride=8),
                   "max_length": 48, "global_attention": False, "return_token_type_ids": False},
    )  # fmt: skip
    lengths = [len(ids) for ids in windows["input_ids"]]
    start, end = rng.standard_normal((2, len(windows), max(lengths)), dtype=np.float32)
    padding = np.arange(max(lengths))[None, :] >= np.array(lengths)[:, None]
    start[padding], end[padding] = -100.0, -100.0
    return examples, windows, start, end


def assert_matches_oracle(answers: run_qa.Answers, oracle: dict[str, dict]) -> None:
    """``answers`` (:func:`run_qa.postprocess`) are :func:`oracle_postprocess`'s: the same answers, best spans, null
    odds (v2) and n-best lists (texts, starts, scores, logits, probabilities, in the same order)."""
    assert answers.predictions == {qid: o["answer"] for qid, o in oracle.items()}
    assert answers.best_spans == {qid: o["best_span"] for qid, o in oracle.items()}
    null_odds = {qid: o["null_odds"] for qid, o in oracle.items() if o["null_odds"] is not None}  # v2 only
    assert answers.null_odds == pytest.approx(null_odds)
    for qid, o in oracle.items():
        assert [(c["text"], c["start"]) for c in answers.nbest[qid]] == [(c["text"], c["start"]) for c in o["nbest"]]
        for key in ("score", "start_logit", "end_logit", "probability"):
            assert [c[key] for c in answers.nbest[qid]] == pytest.approx([c[key] for c in o["nbest"]], abs=1e-6), qid


@pytest.mark.parametrize(
    "n_examples, v2, n_best_size, threshold",
    [(420, True, 20, 0.0), (120, True, 3, -6.0), (120, False, 20, 0.0), (120, False, 3, 0.0)],
)
def test_postprocess_agrees_with_the_oracle_on_random_logits(n_examples, v2, n_best_size, threshold):
    """Same windows, same logits: the same answers, null odds and n-best lists as :func:`oracle_postprocess`
    (479aea5: 5 of the 420 v2 answers differed, each an empty span ranked first). Checked once against transformers'
    ``postprocess_qa_predictions`` (a copy kept outside the repository), the oracle agreed on all 780 examples of
    these settings (18 of them where transformers answers its placeholder "empty" and the oracle "") and on 1,000
    more (n-best sizes 5 to 40, max_answer_length 1 to 4)."""
    examples, windows, start, end = random_qa_windows(n_examples, seed=n_best_size)
    assert len(windows) > 2 * n_examples  # most contexts take several windows
    args = data_args(version_2_with_negative=v2, n_best_size=n_best_size, null_score_diff_threshold=threshold)
    oracle = oracle_postprocess(examples, windows, start, end, v2, n_best_size, threshold=threshold)
    assert_matches_oracle(run_qa.postprocess(examples, windows, start, end, args), oracle)
    # The data holds the cases the rules are about.
    top_spans = [[c for c in o["nbest"] if c["start"] >= 0][:1] for o in oracle.values()]
    if n_best_size == 20:  # (with only the 3 best starts and ends, a whitespace token rarely makes the top span)
        assert any(top and top[0]["text"] == "" for top in top_spans)  # what made 479aea5 differ
    else:
        assert not all(top_spans)  # some example has no span at all
    if threshold:  # the threshold decides some answers: below it they would be spans, above it they are ""
        assert any(threshold < o["null_odds"] <= 0.0 for o in oracle.values())


# ---------------------------------------------------------------------------------------------------------------
# Windows over a long context
# ---------------------------------------------------------------------------------------------------------------


def featurized(tmp_path, max_length: int, **options) -> tuple[Dataset, Dataset, run_qa.DataTrainingArguments]:
    examples = run_qa.load_squad_file(squad_file(tmp_path / "dev.json", len(ANSWERS), unanswerable=1))
    args = data_args(version_2_with_negative=True, **options)
    windows = examples.map(
        run_qa.featurize, batched=True, remove_columns=examples.column_names,
        fn_kwargs={"tokenizer": roberta_tokenizer(), "data_args": args, "max_length": max_length,
                   "global_attention": True, "return_token_type_ids": False},
    )  # fmt: skip
    return examples, windows, args


def oracle_logits(windows: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Logits that put 10 on each window's labelled start and end (CLS where the window lacks the answer)."""
    length = max(len(ids) for ids in windows["input_ids"])
    start, end = np.zeros((len(windows), length)), np.zeros((len(windows), length))
    rows = np.arange(len(windows))
    start[rows, windows["start_positions"]] = 10.0
    end[rows, windows["end_positions"]] = 10.0
    return start, end


def test_context_over_1000_tokens_in_doc_stride_windows_maps_answers_back(tmp_path):
    tokenizer = roberta_tokenizer()
    context, starts = long_context()
    assert len(tokenizer(context)["input_ids"]) > 1000
    examples, windows, args = featurized(tmp_path, 128, doc_stride=32)
    counts = {q: windows["example_id"].count(q) for q in examples["id"]}
    assert min(counts.values()) > 8  # the context is read in many windows of 128 tokens
    # Consecutive windows of an example share doc_stride context tokens.
    first, second = windows[0], windows[1]
    shared = [span for span in first["offset_mapping"] if span is not None]
    following = [span for span in second["offset_mapping"] if span is not None]
    assert shared[-32:] == following[:32]
    # A window's label spells its example's answer; the question and CLS are global, the context is not.
    labelled = 0
    for window in windows:
        i = examples["id"].index(window["example_id"])
        s, e = window["start_positions"], window["end_positions"]
        if s != window["cls_index"]:
            text = examples[i]["context"][window["offset_mapping"][s][0] : window["offset_mapping"][e][1]]
            assert text == examples[i]["answers"]["text"][0]
            labelled += 1
        question = [k for k, span in enumerate(window["offset_mapping"]) if span is None][:-1]
        glob = window["global_attention_mask"]
        assert glob[0] == 1 and sum(glob) < len(question) + 1 and glob[len(glob) - 1] == 0
    assert labelled >= len(ANSWERS)  # every answer lies whole in at least one window
    # Oracle logits: post-processing across the windows finds every answer at its character offset.
    answers = run_qa.postprocess(examples, windows, *oracle_logits(windows), args)
    for example in examples:
        gold = example["answers"]
        assert answers.predictions[example["id"]] == (gold["text"][0] if gold["text"] else "")
        if gold["text"]:
            assert answers.nbest[example["id"]][0]["start"] == gold["answer_start"][0]
    references = run_qa.gold_answers(examples, "answers")
    metrics = run_qa.squad_metrics(answers.predictions, references, answers.null_odds, answers.best_spans)
    assert metrics["exact_match"] == 100.0 and metrics["f1"] == 100.0 and metrics["NoAns_total"] == 1


def test_truncate_reads_one_window_per_example(tmp_path):
    examples, windows, args = featurized(tmp_path, 128, long_documents="truncate")
    assert windows["example_id"] == examples["id"] and min(windows["example_windows"]) > 8
    # Only the first answer (near the start) survives the cut; the others are labelled CLS.
    assert windows[0]["start_positions"] != windows[0]["cls_index"]
    assert all(w["start_positions"] == w["cls_index"] for w in windows.select(range(1, len(windows))))


def test_squad_nested_layout_is_flattened(tmp_path):
    nested = {"data": [{"title": "t", "paragraphs": [{"context": "alpha beta", "qas": [
        {"id": "1", "question": "q?", "answers": [{"text": "beta", "answer_start": 6}]},
        {"id": "2", "question": "r?", "answers": [], "is_impossible": True}]}]}]}  # fmt: skip
    path = tmp_path / "nested.json"
    path.write_text(json.dumps(nested))
    rows = run_qa.load_squad_file(str(path)).to_list()
    assert rows[0] == {"id": "1", "title": "t", "context": "alpha beta", "question": "q?",
                       "answers": {"text": ["beta"], "answer_start": [6]}}  # fmt: skip
    assert rows[1]["answers"] == {"text": [], "answer_start": []}


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------


def first_logged_loss(out: Path) -> float:
    state = json.loads((out / "trainer_state.json").read_text())
    return next(entry["loss"] for entry in state["log_history"] if "loss" in entry)


def test_run_qa_v1_long_model_reads_the_context_in_one_window(long_model, tmp_path):
    train = squad_file(tmp_path / "train.json", 4)
    dev = squad_file(tmp_path / "dev.json", 3)
    out = tmp_path / "out"
    metrics = run_qa.main(qa_args(long_model, out, train, dev))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 3 and results["eval_windows"] == 3  # one window per example
    assert 0.0 <= results["eval_exact_match"] <= results["eval_f1"] <= 100.0 + 1e-9
    assert results["eval_f1"] == metrics["eval_f1"] and math.isfinite(results["eval_loss"])
    assert json.loads((out / "train_results.json").read_text())["train_windows"] == 4
    assert math.isfinite(first_logged_loss(out))
    predictions = json.loads((out / "predictions.json").read_text())
    assert sorted(predictions) == ["q0", "q1", "q2"]
    context, _ = long_context()
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    for candidates in nbest.values():  # every candidate is the context's text at its start
        assert candidates and all(context[c["start"] : c["start"] + len(c["text"])] == c["text"] for c in candidates)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["HfxLongformerForQuestionAnswering"]


def test_run_qa_v1_short_model_doc_stride_windows(short_model, tmp_path, capsys):
    train = squad_file(tmp_path / "train.json", 2)
    dev = squad_file(tmp_path / "dev.json", 2)
    out = tmp_path / "out"
    run_qa.main(qa_args(short_model, out, train, dev, "--doc_stride", "32", "--max_steps", "1"))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_samples"] == 2 and results["eval_windows"] > 16
    assert sorted(json.loads((out / "predictions.json").read_text())) == ["q0", "q1"]
    # The same model truncated: one window per example, and the log says how many contexts were cut.
    capsys.readouterr()
    cut = tmp_path / "cut"
    run_qa.main(qa_args(short_model, cut, train, dev, "--long_documents", "truncate", "--max_steps", "1"))
    assert json.loads((cut / "eval_results.json").read_text())["eval_windows"] == 2
    assert "2 of 2 contexts are longer than a window and were cut" in capsys.readouterr().out


def test_run_qa_v2_with_unanswerable_questions(long_model, tmp_path, monkeypatch):
    """SQuAD v2 from a Hub dataset's layout (train and validation splits of flattened rows; the Hub is replaced by
    an in-memory copy)."""
    calls = []

    def fake_load_dataset(name, config=None, cache_dir=None):
        calls.append((name, config))
        rows = squad_rows(2, unanswerable=2)
        return DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows))

    monkeypatch.setattr(run_qa, "load_dataset", fake_load_dataset)
    out = tmp_path / "out"
    args = qa_args(long_model, out, "", "", "--version_2_with_negative", "--max_steps", "1")
    args = [a for a in args if a not in ("--train_file", "--validation_file", "")]
    run_qa.main([*args, "--dataset_name", "rajpurkar/squad_v2"])
    assert calls == [("rajpurkar/squad_v2", None)]  # read once for both splits
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_HasAns_total"] == 2 and results["eval_NoAns_total"] == 2
    for key in ("eval_HasAns_f1", "eval_NoAns_exact_match", "eval_best_f1", "eval_best_f1_thresh"):
        assert key in results
    assert results["eval_best_f1"] >= results["eval_f1"] - 1e-9  # the best threshold does at least as well as 0
    odds = json.loads((out / "null_odds.json").read_text())
    predictions = json.loads((out / "predictions.json").read_text())
    assert sorted(odds) == sorted(predictions) == ["n0", "n1", "q0", "q1"]
    assert all((predictions[q] == "") == (odds[q] > 0.0) for q in odds)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--long_documents", "split"], "--long_documents must be one of"),
        (["--max_seq_length", "4096"], "exceeds the 128 tokens"),
        (["--doc_stride", "64"], "--doc_stride 64 must be under half"),
        (["--misaligned_answers", "fix"], "--misaligned_answers must be one of"),
    ],
)
def test_run_qa_clear_errors(extra, match, short_model, tmp_path, capsys):
    data = squad_file(tmp_path / "d.json", 1)
    with refused(capsys, match):
        run_qa.main(qa_args(short_model, tmp_path / "out", data, data, *extra))


def test_run_qa_v1_data_without_answer_says_version_2(short_model, tmp_path):
    data = squad_file(tmp_path / "d.json", 1, unanswerable=1)
    with pytest.raises(ValueError, match="has no answer; pass --version_2_with_negative"):
        run_qa.main(qa_args(short_model, tmp_path / "out", data, data))


def shifted_squad_file(path: Path, shift: int) -> tuple[str, list[dict]]:
    """:func:`squad_file` of 3 questions, the second's ``answer_start`` moved ``shift`` characters on; returns the
    file and its rows."""
    squad_file(path, 3)
    document = json.loads(path.read_text())
    document["data"][1]["answers"]["answer_start"][0] += shift
    path.write_text(json.dumps(document))
    return str(path), document["data"]


def test_run_qa_refuses_an_answer_start_37_characters_off(short_model, tmp_path):
    """479aea5 trained on the span 37 characters past the answer, with no warning."""
    data, rows = shifted_squad_file(tmp_path / "d.json", 37)
    answer, start = rows[1]["answers"]["text"][0], rows[1]["answers"]["answer_start"][0]
    shifted = rows[1]["context"][start : start + len(answer)]
    message = (
        f"1 of 3 examples have an answer whose text is not the context's characters at its answer_start (example "
        f"'q1': the answer {answer!r} at character {start}, where the context reads {shifted!r}, the text is at "
        f"character {start - 37})"
    )
    with pytest.raises(ValueError, match=re.escape(message) + ".*--misaligned_answers skip"):
        run_qa.main(qa_args(short_model, tmp_path / "out", data, data, "--doc_stride", "32", "--max_steps", "1"))
    assert not (tmp_path / "out").exists()  # refused before any training


def test_misaligned_answers_skip_leaves_the_examples_out_with_a_warning(tmp_path, caplog):
    data, _ = shifted_squad_file(tmp_path / "d.json", 37)
    training = TrainingArguments(str(tmp_path / "out"), do_train=True, report_to="none")
    args = data_args(train_file=data, misaligned_answers="skip")
    with caplog.at_level(logging.WARNING, logger="run_qa"):
        splits = run_qa.load_raw_splits(args, training, cache_dir=None)
    assert splits["train"]["id"] == ["q0", "q2"]
    assert "1 of 3 examples have an answer whose text is not" in caplog.text and "2 examples remain" in caplog.text
    # An answer past the context's end counts too; skipping every example is refused.
    lost = Dataset.from_list([{"id": "z", "question": "q?", "context": "alpha beta",
                               "answers": {"text": ["beta"], "answer_start": [9]}}])  # fmt: skip
    with pytest.raises(ValueError, match=r"at character 9 lies outside .*at character 6.*leaves no example"):
        run_qa.check_answers(lost, args, "lost.json")


def tiny_base_model(name: str, vocab_size: int):
    """A tiny base model of each architecture with a QA head (and transformers' RoBERTa), 128 to 256 tokens."""
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    if name == "hfx-bigbird":
        config = hf_xformers.HfxBigBirdConfig(**common, max_position_embeddings=258, block_size=8, num_random_blocks=1)
        return hf_xformers.HfxBigBirdModel(config)
    if name == "hfx-linformer":
        return hf_xformers.HfxLinformerModel(hf_xformers.HfxLinformerConfig(**common, max_position_embeddings=66))
    if name == "hfx-performer":
        return hf_xformers.HfxPerformerModel(hf_xformers.HfxPerformerConfig(**common, max_position_embeddings=130))
    if name == "hfx-reformer":
        config = hf_xformers.HfxReformerConfig(
            vocab_size=vocab_size, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
            attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4,
            axial_pos_shape=[8, 16], axial_pos_embds_dim=[16, 16], max_position_embeddings=128, pad_token_id=1,
            eos_token_id=None,
        )  # fmt: skip
        return hf_xformers.HfxReformerModel(config)
    return RobertaModel(RobertaConfig(**common, max_position_embeddings=130, type_vocab_size=1))


@pytest.mark.parametrize("name", ["hfx-bigbird", "hfx-linformer", "hfx-performer", "hfx-reformer", "roberta"])
def test_run_qa_each_architectures_head_in_windows(name, tmp_path):
    """Each QA head trains a step and answers every question from doc_stride windows; only Longformer's gets a
    global_attention_mask (Reformer's forward takes the argument but refuses it)."""
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    tiny_base_model(name, len(tokenizer)).save_pretrained(tmp_path / name)
    tokenizer.save_pretrained(tmp_path / name)
    data = squad_file(tmp_path / "d.json", 1, n_sentences=10)  # about 280 tokens
    out = tmp_path / "out"
    metrics = run_qa.main(qa_args(tmp_path / name, out, data, data, "--doc_stride", "16", "--max_steps", "1"))
    assert metrics["eval_windows"] >= 2 and math.isfinite(metrics["train_loss"])
    assert list(json.loads((out / "predictions.json").read_text())) == ["q0"]
    model = AutoModelForQuestionAnswering.from_pretrained(out)
    assert not utils_examples.supports_global_attention(model.base_model)


def test_global_attention_goes_to_longformer_only(short_model):
    model = AutoModelForQuestionAnswering.from_pretrained(short_model)
    assert utils_examples.supports_global_attention(model.base_model)


def test_collator_pads_every_mask_on_the_right():
    windows = [
        {"input_ids": [0, 7, 2, 9, 2], "attention_mask": [1] * 5, "global_attention_mask": [1, 1, 0, 0, 0],
         "start_positions": 3, "end_positions": 3},
        {"input_ids": [0, 7, 2], "attention_mask": [1] * 3, "global_attention_mask": [1, 1, 0],
         "start_positions": 0, "end_positions": 0},
    ]  # fmt: skip
    batch = run_qa.QACollator(pad_token_id=1)(windows)
    assert batch["input_ids"].tolist() == [[0, 7, 2, 9, 2], [0, 7, 2, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert batch["global_attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert batch["start_positions"].tolist() == [3, 0] and batch["end_positions"].tolist() == [3, 0]
