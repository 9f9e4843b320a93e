"""examples/run_classification.py on tiny local data and tiny models (single-label with five string labels,
multi-label, regression), the token-length report, chunked evaluation of long documents, and
examples/long_vs_truncated.py end to end on a tiny BERT."""

from __future__ import annotations

import csv
import json
import re
import resource
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, Features, Value
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertModel

from examples import long_vs_truncated, run_classification, utils_examples
from hf_xformers.packed_inference import aggregate_chunks, chunk_token_ids, document_windows, special_token_layout
from tests.test_examples import torchrun
from tests.tiny_tokenizers import SENTENCES, bert_tokenizer
from tests.usage_errors import refused

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["sports", "politics", "science", "arts", "travel"]


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of 1 to 6 sentences: some longer than the tiny model's 128 tokens."""
    rng = np.random.default_rng(seed)
    return [" ".join(SENTENCES[j % 4] for j in range(i, i + int(rng.integers(1, 7)))) for i in range(n)]


def write_csv(path: Path, rows: list[dict]) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def common(model: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(model), "--output_dir", str(out), "--cache_dir", str(cache), "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--save_strategy", "no",
        "--report_to", "none", "--seed", "0", *extra,
    ]  # fmt: skip


def classification_files(folder: Path) -> None:
    """The files examples/README.md's run_classification commands read: ``topics/`` (csv: title, body, topic,
    source; five string labels), ``tags/`` (json lines, a list column) and ``scores/`` (json lines, floats)."""
    texts = documents(12)
    for name in ("topics", "tags", "scores"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    topics = [{"title": f"doc {i}", "body": t, "topic": TOPICS[i % 5], "source": "x"} for i, t in enumerate(texts)]
    write_csv(folder / "topics" / "train.csv", topics[:8])
    write_csv(folder / "topics" / "dev.csv", topics[8:])
    write_csv(folder / "topics" / "test.csv", [{k: v for k, v in r.items() if k != "topic"} for r in topics[8:]])
    tags = [{"text": t, "tags": [TOPICS[i % 3]] + ([TOPICS[3]] if i % 2 else [])} for i, t in enumerate(texts)]
    write_jsonl(folder / "tags" / "train.jsonl", tags[:8])
    write_jsonl(folder / "tags" / "dev.jsonl", tags[8:])
    scores = [{"sentence": t, "label": float(len(t) % 7) / 2} for t in texts]
    write_jsonl(folder / "scores" / "train.jsonl", scores[:8])
    write_jsonl(folder / "scores" / "dev.jsonl", scores[8:])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


# ---------------------------------------------------------------------------------------------------------------
# The three kinds of task
# ---------------------------------------------------------------------------------------------------------------


def test_single_label_five_string_labels(longformer_dir, cache_dir, tmp_path):
    texts = documents(20)
    rows = [{"title": f"doc {i}", "body": t, "topic": TOPICS[i % 5], "source": "x"} for i, t in enumerate(texts)]
    train = write_csv(tmp_path / "train.csv", rows[:15])
    dev = write_csv(tmp_path / "dev.csv", rows[15:])
    test = write_csv(tmp_path / "test.csv", [{k: v for k, v in r.items() if k != "topic"} for r in rows[15:]])
    out = tmp_path / "out"
    metrics = run_classification.main(common(
        longformer_dir, out, cache_dir, "--train_file", train, "--validation_file", dev, "--test_file", test,
        "--text_column_names", "title,body", "--label_column_name", "topic", "--remove_columns", "source",
        "--metric_name", "matthews_correlation", "--do_train", "--do_eval", "--do_predict",
    ))  # fmt: skip
    assert {"eval_accuracy", "eval_f1_macro", "eval_matthews_correlation"} <= set(metrics)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {str(i): name for i, name in enumerate(sorted(TOPICS))}
    assert config["problem_type"] == "single_label_classification"
    lines = (out / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 6
    assert all(line.split("\t")[1] in TOPICS for line in lines[1:])
    # The length report: the tiny model reads 128 tokens; the longest documents are longer.
    report = json.loads((out / "token_lengths.json").read_text())["train"]
    assert report["documents"] == 15 and report["max_length"] == 128
    assert report["truncated_documents"] > 0 and report["tokens_lost_to_truncation"] > 0


def test_multi_label_list_column(longformer_dir, cache_dir, tmp_path):
    texts = documents(16)
    rows = [{"text": t, "tags": [TOPICS[i % 3]] + ([TOPICS[3]] if i % 2 else [])} for i, t in enumerate(texts)]
    train, dev = write_jsonl(tmp_path / "train.jsonl", rows[:12]), write_jsonl(tmp_path / "dev.jsonl", rows[12:])
    out = tmp_path / "out"
    metrics = run_classification.main(common(
        longformer_dir, out, cache_dir, "--train_file", train, "--validation_file", dev, "--test_file", dev,
        "--label_column_name", "tags", "--do_train", "--do_eval", "--do_predict", "--multi_label_threshold", "0.3",
    ))  # fmt: skip
    assert {"eval_f1_micro", "eval_f1_macro", "eval_accuracy"} <= set(metrics)
    config = json.loads((out / "config.json").read_text())
    assert config["problem_type"] == "multi_label_classification" and len(config["id2label"]) == 4
    for line in (out / "predict_results.txt").read_text().splitlines()[1:]:
        names = [n for n in line.split("\t")[1].split(",") if n]
        assert set(names) <= set(TOPICS[:4])


def test_regression_on_a_transformers_model(cache_dir, tmp_path):
    path = tmp_path / "bert"
    tokenizer = bert_tokenizer()
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37, max_position_embeddings=64)).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)
    texts = documents(16)
    rows = [{"sentence": t, "label": float(len(t) % 7) / 2} for t in texts]
    train, dev = write_jsonl(tmp_path / "train.jsonl", rows[:12]), write_jsonl(tmp_path / "dev.jsonl", rows[12:])
    out = tmp_path / "out"
    metrics = run_classification.main(common(
        path, out, cache_dir, "--train_file", train, "--validation_file", dev, "--test_file", dev,
        "--do_train", "--do_eval", "--do_predict", "--metric_name", "mae",
    ))  # fmt: skip
    assert {"eval_mse", "eval_pearson", "eval_spearmanr", "eval_mae"} <= set(metrics)
    assert json.loads((out / "config.json").read_text())["problem_type"] == "regression"
    predictions = [float(line.split("\t")[1]) for line in (out / "predict_results.txt").read_text().splitlines()[1:]]
    assert len(predictions) == 4
    # BERT's 64 positions are the limit: the report says so.
    assert json.loads((out / "token_lengths.json").read_text())["eval"]["max_length"] == 64


def test_hub_class_labels_become_their_names():
    data = Dataset.from_dict(
        {"text": ["a", "b", "c"], "label": [1, 0, 1]},
        features=Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])}),
    )
    named = run_classification.class_names(data, "label")
    assert named["label"] == ["pos", "neg", "pos"]
    assert run_classification.task_kind(named.features["label"]) == run_classification.SINGLE_LABEL
    assert run_classification.label_names(run_classification.SINGLE_LABEL, {"train": named}, "label", None) == [
        "neg", "pos"
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Long documents: chunks, aggregation, the length report
# ---------------------------------------------------------------------------------------------------------------


def test_chunk_token_ids_cover_the_document_with_the_overlap():
    ids = [101] + list(range(1000, 1023)) + [102]  # 23 text tokens between [CLS] and [SEP]
    windows = chunk_token_ids(ids, max_length=10, stride=3)
    assert all(w[0] == 101 and w[-1] == 102 and len(w) <= 10 for w in windows)
    bodies = [w[1:-1] for w in windows]
    assert bodies[0] == list(range(1000, 1008))
    for before, after in zip(bodies, bodies[1:]):
        assert before[-3:] == after[:3]  # stride = overlap
    assert sorted({t for b in bodies for t in b}) == list(range(1000, 1023))
    assert chunk_token_ids(ids[:8], max_length=10, stride=3) == [ids[:8]]
    with pytest.raises(ValueError, match="stride 8"):
        chunk_token_ids(ids, max_length=10, stride=8)
    windows, owners = document_windows([ids, ids[:5]], 10, "truncate", 3)
    assert windows == [ids[:9] + [102], ids[:5]] and owners == [0, 1]


def test_aggregate_chunks_mean_and_max():
    logits = torch.tensor([[1.0, 4.0], [3.0, 0.0], [5.0, 5.0], [-1.0, 2.0]])
    owners = [0, 0, 1, 0]
    torch.testing.assert_close(aggregate_chunks(logits, owners, 2, "mean"), torch.tensor([[1.0, 2.0], [5.0, 5.0]]))
    torch.testing.assert_close(aggregate_chunks(logits, owners, 2, "max"), torch.tensor([[3.0, 4.0], [5.0, 5.0]]))
    with pytest.raises(ValueError, match="at least one"):
        aggregate_chunks(logits, owners, 3)


def test_token_length_report_counts_what_truncation_loses():
    report = utils_examples.token_length_report([10, 50, 200, 30], 40, [10, 40, 40, 30])
    assert report["median"] == 40.0 and report["longest"] == 200
    assert report["truncated_documents"] == 2 and report["tokens_lost_to_truncation"] == 10 + 160
    assert report["tokens_read"] == 120 and report["windows"] == 4
    line = utils_examples.describe_token_lengths("eval", report)
    assert "2 (50%) longer than the model's 40 tokens" in line and "170 of 290 tokens" in line


def scoring_model(longformer_dir: Path, path: Path):
    """A regression head on the tiny Longformer, saved to ``path`` with its tokenizer: ``predict_results.txt`` then
    carries each document's aggregated logit itself. Returns ``(model, tokenizer)``."""
    tokenizer = AutoTokenizer.from_pretrained(longformer_dir)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(longformer_dir, num_labels=1).eval()
    with torch.no_grad():  # a head of large weights: documents' scores then differ beyond the file's 3 decimals
        for parameter in model.classifier.parameters():
            parameter.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def test_chunked_evaluation_is_the_mean_of_each_windows_logits(longformer_dir, cache_dir, tmp_path):
    texts = documents(6, seed=1)
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": t, "label": float(i)} for i, t in enumerate(texts)])
    model, tokenizer = scoring_model(longformer_dir, tmp_path / "model")
    base = common(tmp_path / "model", tmp_path / "out", cache_dir, "--validation_file", dev, "--test_file", dev,
                  "--do_eval", "--do_predict", "--max_seq_length", "24", "--doc_stride", "6")  # fmt: skip
    chunked = run_classification.main([*base, "--long_documents", "chunks"])
    truncated = run_classification.main(
        [*base, "--long_documents", "truncate", "--output_dir", str(tmp_path / "cut"), "--padding_free"]
    )
    assert chunked["eval_windows"] > truncated["eval_windows"] == len(texts)
    assert chunked["eval_tokens_per_document"] > truncated["eval_tokens_per_document"]
    # By hand: each window of 24 tokens on its own; chunks take the mean of a document's windows' logits.
    ids = tokenizer(texts)["input_ids"]
    written = {}
    for folder, mode in (("out", "chunks"), ("cut", "truncate")):
        windows, owners = document_windows(ids, 24, mode, 6, *special_token_layout(tokenizer))
        with torch.no_grad():
            logits = torch.cat([model(input_ids=torch.tensor([w])).logits for w in windows])
        expected = aggregate_chunks(logits, owners, len(texts)).reshape(-1)
        lines = (tmp_path / folder / "predict_results.txt").read_text().splitlines()[1:]
        written[mode] = torch.tensor([float(line.split("\t")[1]) for line in lines])
        torch.testing.assert_close(written[mode], expected, atol=1e-3, rtol=0, msg=mode)
    assert not torch.allclose(written["chunks"], written["truncate"], atol=1e-3)


def test_chunked_evaluation_under_torchrun_is_the_single_process_one(longformer_dir, cache_dir, tmp_path):
    """Two CPU processes share the windows (an odd number of them: Trainer pads the last batch and drops the
    copies when it gathers), and the documents come out whole and in order."""
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": t, "label": 1.0} for t in documents(5, seed=3)])
    scoring_model(longformer_dir, tmp_path / "model")

    def args(out: str) -> list[str]:
        return common(tmp_path / "model", tmp_path / out, cache_dir, "--validation_file", dev, "--test_file", dev,
                      "--do_eval", "--do_predict", "--max_seq_length", "24", "--doc_stride", "6",
                      "--long_documents", "chunks", "--per_device_eval_batch_size", "3", "--disable_tqdm", "true")  # fmt: skip

    single = run_classification.main(args("single"))
    torchrun("examples.run_classification", args("double"))
    assert single["eval_windows"] % 2 == 1
    results = json.loads((tmp_path / "double" / "eval_results.json").read_text())
    assert results["eval_windows"] == single["eval_windows"]
    assert results["eval_mse"] == pytest.approx(single["eval_mse"], rel=1e-4)
    predicted = [(tmp_path / out / "predict_results.txt").read_text() for out in ("single", "double")]
    assert predicted[0] == predicted[1]


# ---------------------------------------------------------------------------------------------------------------
# Errors name the fix
# ---------------------------------------------------------------------------------------------------------------


def test_clear_errors(longformer_dir, cache_dir, tmp_path, capsys):
    rows = [{"text": t, "label": TOPICS[i % 2]} for i, t in enumerate(documents(6))]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": "hello world", "label": "cooking"}])
    args = common(longformer_dir, tmp_path / "out", cache_dir, "--train_file", train, "--do_train")
    with refused(
        capsys, r"eval data: label\(s\) \['cooking'\] are not among the training labels \['politics', 'sports'\]"
    ):
        run_classification.main([*args, "--validation_file", dev, "--do_eval"])
    with refused(capsys, "--metric_name 'mae' does not apply"):
        run_classification.main([*args, "--metric_name", "mae"])
    with refused(capsys, "--long_documents must be one of"):
        run_classification.main([*args, "--long_documents", "slide"])
    with refused(capsys, "--do_eval needs --validation_file"):
        run_classification.main([*args, "--do_eval"])


# ---------------------------------------------------------------------------------------------------------------
# Labels as transformers finds them: the model's ids, integers as integers, the whole training split
# ---------------------------------------------------------------------------------------------------------------


def classifier(longformer_dir: Path, path: Path, id2label: dict, texts: list[str] = ()):
    """The tiny Longformer with a classification head of ``len(id2label)`` classes named ``id2label``, saved to
    ``path`` with its tokenizer. With ``texts``, a planted head whose predictions of ``texts`` spread over the
    classes: a random encoder's pooled states differ little from text to text (all would take one class), so the
    head's dense layer reads them centred and scaled (over ``texts``) with random weights, and its output layer's
    logits average 0 per class."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        longformer_dir, num_labels=len(id2label), id2label=id2label, label2id={v: k for k, v in id2label.items()}
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(longformer_dir)
    head = model.classifier
    if texts:
        with torch.no_grad():
            batch = tokenizer(list(texts), padding=True, return_tensors="pt")
            pooled = []
            hook = head.dense.register_forward_hook(lambda module, args, output: pooled.append(args[0]))
            model(**batch)
            hook.remove()
            head.dense.weight.copy_(torch.randn_like(head.dense.weight) / pooled[0].std(dim=0))
            head.dense.bias.copy_(-head.dense.weight @ pooled[0].mean(dim=0))
            head.out_proj.weight.normal_(0.0, 1.0)
            head.out_proj.bias -= model(**batch).logits.mean(dim=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def word_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` short documents (3 to 12 words of :data:`SENTENCES`; all within the tiny model's 128 tokens)."""
    words = " ".join(SENTENCES).replace(",", "").split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 13)))) for _ in range(n)]


@pytest.mark.parametrize("names", ["ints", "LABEL_k"])
def test_eval_only_integer_labels_are_the_model_ids(names, longformer_dir, cache_dir, tmp_path):
    """Evaluation alone (no training split) with a 12-class model whose ``id2label`` holds the ints (as transformers
    saves them) or transformers' default ``LABEL_k``: integer label ``k`` is class ``k``. The gold labels are the
    model's own predictions, so accuracy is 1.0 exactly when the ids are right (sorted as strings, '10' and '11'
    came before '2', and a class's id was its rank among the classes present)."""
    id2label = {i: i if names == "ints" else f"LABEL_{i}" for i in range(12)}
    texts = word_documents(48)
    model = classifier(longformer_dir, tmp_path / "model", id2label, texts)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    predicted = logits.argmax(dim=-1).tolist()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no near-ties: batching may not change a prediction
    classes = sorted(set(predicted))
    # The case that went wrong: classes whose order as strings, or whose rank, is not their id.
    assert sorted(classes, key=str) != classes or classes != list(range(len(classes))), classes
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": t, "label": k} for t, k in zip(texts, predicted)])
    metrics = run_classification.main(common(tmp_path / "model", tmp_path / "out", cache_dir, "--validation_file",
                                             dev, "--do_eval"))  # fmt: skip
    assert metrics["eval_accuracy"] == 1.0


def test_eval_label_the_model_does_not_know_is_refused(longformer_dir, cache_dir, tmp_path, capsys):
    classifier(longformer_dir, tmp_path / "model", {0: "negative", 1: "positive"})
    # Before, the evaluation labels sorted became the ids: 'neutral' was the model's 'negative' (id 0).
    rows = [{"text": t, "label": ["neutral", "positive"][i % 2]} for i, t in enumerate(word_documents(6))]
    dev = write_jsonl(tmp_path / "dev.jsonl", rows)
    with refused(capsys, r"eval data: label\(s\) \['neutral'\] are not among the model's labels .*"
                         r"\['negative', 'positive'\]"):  # fmt: skip
        run_classification.main(common(tmp_path / "model", tmp_path / "out", cache_dir, "--validation_file", dev,
                                       "--do_eval"))  # fmt: skip


def test_max_train_samples_keeps_every_training_label(longformer_dir, cache_dir, tmp_path):
    """transformers builds the label list from the whole training split, then samples: a class outside the first
    ``--max_train_samples`` rows is still a class (here 'founding', which the evaluation set holds)."""
    texts = word_documents(12)
    labels = ["war", "economy"] * 3 + ["founding"] * 6
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t, "label": k} for t, k in zip(texts, labels)])
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": t, "label": k} for t, k in zip(texts[4:8], labels[4:8])])
    out = tmp_path / "out"
    metrics = run_classification.main(common(longformer_dir, out, cache_dir, "--train_file", train,
                                             "--validation_file", dev, "--max_train_samples", "4", "--max_steps", "1",
                                             "--do_train", "--do_eval"))  # fmt: skip
    assert metrics["train_samples"] == 4 and metrics["eval_samples"] == 4
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "economy", "1": "founding", "2": "war"}


def test_float_class_ids_are_regression_with_a_warning(longformer_dir, cache_dir, tmp_path, capsys):
    rows = [{"text": t, "label": float(i % 3)} for i, t in enumerate(word_documents(6))]
    dev = write_jsonl(tmp_path / "dev.jsonl", rows)
    args = common(longformer_dir, tmp_path / "out", cache_dir, "--validation_file", dev, "--do_eval")
    metrics = run_classification.main(args)
    assert "eval_mse" in metrics
    warned = [line for line in capsys.readouterr().out.splitlines() if " WARNING run_classification: " in line]
    assert len(warned) == 1 and "float64" in warned[0] and "--problem_type single_label_classification" in warned[0]
    # As the warning says: classes 0, 1, 2.
    metrics = run_classification.main([*args, "--problem_type", "single_label_classification"])
    assert "eval_accuracy" in metrics and "eval_mse" not in metrics
    # The script's own warning only: transformers' load report (a WARNING naming the new head) may come or not.
    assert " WARNING run_classification: " not in capsys.readouterr().out
    with refused(capsys, "--problem_type multi_label_classification does not fit a label column that holds one"):
        run_classification.main([*args, "--problem_type", "multi_label_classification"])


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("train.csv", "", "the file is empty; a csv file needs a header row"),
        ("train.csv", "text,label\n\n", r"the file has a header row \(text,label\) but no rows of data"),
        ("train.jsonl", "\n", "the file holds no records"),
        ("train.json", "[ ]", "the file holds no records"),
    ],
)
def test_files_without_rows_are_named(name, text, match, longformer_dir, cache_dir, tmp_path, capsys):
    """One line that names the file and what it lacks, exit status 2 (was a traceback of datasets' that named no
    file: "Instruction 'train' corresponds to no data!", or pandas' EmptyDataError)."""
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as caught:
        run_classification.main(common(longformer_dir, tmp_path / "out", cache_dir, "--train_file",
                                       str(tmp_path / name), "--do_train"))  # fmt: skip
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.count("\n") == 1, error
    assert re.fullmatch(f"run_classification.py: error: {re.escape(str(tmp_path / name))}: {match}.*\n", error)


# ---------------------------------------------------------------------------------------------------------------
# Long against truncated, one command
# ---------------------------------------------------------------------------------------------------------------


def test_long_vs_truncated_end_to_end(tmp_path, monkeypatch, caplog):
    """Started in a folder outside the repository with relative paths, as the docs allow: every path is read from
    that folder, and nothing is written into the repository. The first run is a real process (examples/
    run_classification.py as a file, started in that folder); the other three run in-process (a process each would
    take a minute here). run_classification's options reach every run; --padding_free only the long model's, the
    truncated BERT baseline padding its own."""
    caller = tmp_path / "caller"
    (caller / "data").mkdir(parents=True)
    monkeypatch.chdir(caller)
    tokenizer = bert_tokenizer()
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37, max_position_embeddings=32)).save_pretrained("bert")  # fmt: skip
    tokenizer.save_pretrained("bert")
    rows = [{"text": t, "label": TOPICS[i % 2]} for i, t in enumerate(documents(12, seed=2))]
    write_jsonl(Path("data/train.jsonl"), rows[:8])
    write_jsonl(Path("data/dev.jsonl"), rows[8:])
    output_dir = f"out-{tmp_path.name}/lvt"  # relative: before, the runs wrote it into the repository
    runs = []

    def first_a_process(args: list[str], log_path: Path) -> tuple[float, float, float]:
        runs.append(args)
        if len(runs) == 1:
            return long_vs_truncated.run_measured(args, log_path)
        started, cpu = time.perf_counter(), time.process_time()
        run_classification.main(args)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return time.perf_counter() - started, time.process_time() - cpu, peak

    caplog.set_level("INFO", logger="long_vs_truncated")
    table = long_vs_truncated.main([
        "--source", "bert", "--train_file", "data/train.jsonl", "--validation_file", "data/dev.jsonl",
        "--long_max_length", "96", "--attention_window", "8", "--doc_stride", "4", "--max_steps", "2",
        "--gradient_accumulation_steps", "2", "--output_dir", output_dir,
        # passed on to run_classification.py
        "--padding_free", "--use_cpu", "--warmup_steps", "0", "--weight_decay", "0.0", "--lr_scheduler_type",
        "constant",
    ], runner=first_a_process)  # fmt: skip
    assert [row["run"] for row in table] == [
        "truncated", "long", "truncated, chunked evaluation", "long, chunked evaluation"
    ]  # fmt: skip
    short, long, short_chunks, long_chunks = table
    assert short["max_length"] == 32 and long["max_length"] == 96
    # The long model reads more of each document than the truncated source, chunked evaluation all of it.
    assert long["train_tokens_per_document"] > short["train_tokens_per_document"]
    assert short_chunks["eval_tokens_per_document"] > short["eval_tokens_per_document"]
    assert all(row["peak_mib"] > 0 and row["wall_s"] > 0 and 0 <= row["accuracy"] <= 1 for row in table)
    written = (caller / output_dir / "long_vs_truncated.md").read_text()
    assert written.count("\n") == 6 and "| long, chunked evaluation | 96 tokens |" in written
    assert not (REPO / output_dir.split("/")[0]).exists()
    # Every path a run reads or writes is the caller's; the options passed on reach every run.
    for args in runs:
        model_args, data_args, training_args, _ = run_classification.parse_args(args)
        for path in (model_args.model_name_or_path, data_args.validation_file, training_args.output_dir):
            assert Path(path).is_absolute() and Path(path).is_relative_to(caller), path
        assert data_args.padding_free == ("/long" in training_args.output_dir)
        assert training_args.use_cpu and training_args.weight_decay == 0.0
        assert training_args.lr_scheduler_type == "constant"
        if training_args.do_train:
            assert training_args.warmup_steps == 0 and training_args.learning_rate == 5e-5
    assert "the truncated baseline (" in caplog.text and "pads its own: BertForSequenceClassification" in caplog.text
