"""Length generalisation on a generated algorithmic task: Universal Transformer with ACT vs a vanilla Transformer.

The Universal Transformer paper (Dehghani et al., 2019, section 3.3) trains on copy, reverse and addition of digit
strings and tests on longer strings. Its bAbI data cannot be downloaded here, so this script generates the strings:

* ``copy``: ``3 1 4`` -> ``3 1 4``; ``reverse``: ``3 1 4`` -> ``4 1 3``;
* ``addition``: ``1 2 + 3 9`` -> ``5 1`` (both operands have ``n`` digits; ``n`` is the example's length).

Both models are encoder-decoders of the same width (``--hidden-size``, ``--num-heads``, ``--intermediate-size``)
trained with the same batches, optimiser and number of steps on lengths ``1 .. L`` (``--train-max-length``), then
decoded greedily on lengths ``1 .. 2L``:

* ``universal_act``: ``HfxUniversalForSeq2SeqLM`` with ACT (at most ``--act-max-steps`` steps per position, one
  shared block in the encoder and one in the decoder, position and timestep signals at every step);
* ``vanilla``: ``torch.nn.Transformer`` (post-LN, GELU) with ``--num-steps`` distinct layers on each side,
  sinusoidal positions added once, the softmax tied to the embeddings.

Reported (JSON, a markdown table and a PNG plot): sequence accuracy (the whole output, end token included, must be
right) on lengths up to L and on lengths L+1 .. 2L, accuracy by length, and the mean number of steps each input
(and output) position took: the UT's ACT ponder steps, the vanilla model's fixed number of layers.

The committed results (``benchmarks/results/universal_algorithmic_reverse.*``, 7 minutes on one CPU thread)::

    OMP_NUM_THREADS=1 python -m examples.run_algorithmic_task --task reverse --train-max-length 8 --train-steps 3000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python examples/<script>.py): the repository root on sys.path, for `examples`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

from examples.utils_examples import script_parser  # noqa: E402
from hf_xformers import HfxUniversalConfig, HfxUniversalForSeq2SeqLM  # noqa: E402
from hf_xformers.models.universal.recurrent_block import timing_signal  # noqa: E402

BOS, PAD, EOS = 0, 1, 2
DIGIT0, PLUS = 5, 15  # digits 0-9 are ids 5-14
VOCAB_SIZE = 16
TASKS = ("copy", "reverse", "addition")


# ----- data --------------------------------------------------------------------------------------------------------


def make_example(task: str, length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """One ``(source tokens, target tokens)`` pair, without the end token."""
    if task == "addition":
        low = 10 ** (length - 1) if length > 1 else 0
        a, b = rng.randint(low, 10**length - 1), rng.randint(low, 10**length - 1)
        source = [DIGIT0 + int(c) for c in str(a)] + [PLUS] + [DIGIT0 + int(c) for c in str(b)]
        return source, [DIGIT0 + int(c) for c in str(a + b)]
    digits = [DIGIT0 + rng.randrange(10) for _ in range(length)]
    return digits, (digits if task == "copy" else digits[::-1])


def collate(pairs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` (source + EOS) and ``labels`` (target + EOS, -100 padding)."""
    sources = [s + [EOS] for s, _ in pairs]
    targets = [t + [EOS] for _, t in pairs]
    src = torch.full((len(pairs), max(map(len, sources))), PAD)
    labels = torch.full((len(pairs), max(map(len, targets))), -100)
    for i, (s, t) in enumerate(zip(sources, targets)):
        src[i, : len(s)] = torch.tensor(s)
        labels[i, : len(t)] = torch.tensor(t)
    return {"input_ids": src, "attention_mask": (src != PAD).long(), "labels": labels}


def training_batch(task: str, max_length: int, batch_size: int, rng: random.Random) -> dict[str, torch.Tensor]:
    return collate([make_example(task, rng.randint(1, max_length), rng) for _ in range(batch_size)])


# ----- the vanilla Transformer ---------------------------------------------------------------------------------------


class VanillaTransformer(nn.Module):
    """Embeddings * sqrt(hidden) + sinusoidal positions (once), ``nn.Transformer`` with distinct layers, tied softmax."""

    def __init__(self, hidden: int, heads: int, intermediate: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(VOCAB_SIZE, hidden, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=hidden**-0.5)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d_model=hidden, nhead=heads, num_encoder_layers=layers, num_decoder_layers=layers,
            dim_feedforward=intermediate, dropout=dropout, activation="gelu", batch_first=True,
        )  # fmt: skip

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.embed(ids) * self.hidden**0.5 + timing_signal(positions, self.hidden))

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        """``src``/``src_mask`` ``(batch, src_len)``, ``decoder_ids`` ``(batch, tgt_len)`` -> logits ``(.., vocab)``."""
        causal = nn.Transformer.generate_square_subsequent_mask(decoder_ids.shape[1], device=src.device)
        padding = ~src_mask.bool()
        out = self.transformer(
            self._embed(src), self._embed(decoder_ids), tgt_mask=causal, src_key_padding_mask=padding,
            memory_key_padding_mask=padding, tgt_is_causal=True,
        )  # fmt: skip
        return out @ self.embed.weight.T

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        decoder_ids = torch.cat([torch.full_like(labels[:, :1], BOS), labels[:, :-1]], 1)
        decoder_ids = decoder_ids.masked_fill(decoder_ids == -100, PAD)  # only after the end token (causal)
        logits = self(batch["input_ids"], batch["attention_mask"], decoder_ids)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1), ignore_index=-100)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, src_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        out = torch.full((src.shape[0], 1), BOS)
        for _ in range(max_new_tokens):
            out = torch.cat([out, self(src, src_mask, out)[:, -1].argmax(-1, keepdim=True)], 1)
        return out


# ----- training and evaluation ---------------------------------------------------------------------------------------


def build_universal(args: argparse.Namespace) -> HfxUniversalForSeq2SeqLM:
    config = HfxUniversalConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_steps, use_act=True,
        act_max_steps=args.act_max_steps, act_loss_weight=args.act_loss_weight, hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout, max_position_embeddings=8 * args.train_max_length + 8,
        type_vocab_size=1, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
    )  # fmt: skip
    return HfxUniversalForSeq2SeqLM(config)


def train(model: nn.Module, loss_fn, args: argparse.Namespace, log_name: str) -> dict:
    """``--train-steps`` AdamW steps (linear warm-up, then constant) on freshly generated batches; the batches depend
    only on ``--seed``, so both models see the same data."""
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.train_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(args.train_steps):
        batch = training_batch(args.task, args.train_max_length, args.batch_size, rng)
        loss = loss_fn(model, batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % max(1, args.train_steps // 10) == 0:
            recent = sum(losses[-50:]) / len(losses[-50:])
            print(f"[{log_name}] step {step + 1}/{args.train_steps} loss {recent:.4f}", flush=True)
    model.eval()
    return {
        "train_seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
    }


def _correct(generated: torch.Tensor, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
    """Per example: the tokens after the start token are the target followed by the end token."""
    result = []
    for row, (_, target) in zip(generated.tolist(), pairs):
        expected = target + [EOS]
        result.append(row[1 : 1 + len(expected)] == expected)
    return result


def _mean_by_position(sums: list[float], counts: list[int]) -> list[float | None]:
    return [round(s / c, 4) if c else None for s, c in zip(sums, counts)]


@torch.no_grad()
def evaluate(model: nn.Module, kind: str, args: argparse.Namespace) -> dict:
    """Sequence accuracy by length 1..2L (greedy decoding) and mean steps per input / output position."""
    rng = random.Random(args.seed + 1)
    eval_max = 2 * args.train_max_length
    max_src = 2 * eval_max + 1 if args.task == "addition" else eval_max
    max_tgt = eval_max + 2
    src_sum, src_count = [0.0] * max_src, [0] * max_src
    tgt_sum, tgt_count = [0.0] * max_tgt, [0] * max_tgt
    by_length = {}
    for length in range(1, eval_max + 1):
        pairs = [make_example(args.task, length, rng) for _ in range(args.eval_examples)]
        batch = collate(pairs)
        max_new = batch["labels"].shape[1]
        if kind == "universal_act":
            generated = model.generate(
                batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=max_new,
                do_sample=False, eos_token_id=None, pad_token_id=PAD,
            )  # fmt: skip
            out = model(**batch)  # teacher-forced pass for the decoder's ponder steps on the gold outputs
            src_steps, tgt_steps = out.encoder_ponder_steps, out.decoder_ponder_steps
        else:
            generated = model.greedy(batch["input_ids"], batch["attention_mask"], max_new)
            src_steps = batch["attention_mask"].float() * args.num_steps
            tgt_steps = batch["labels"].ne(-100).float() * args.num_steps
        by_length[length] = sum(_correct(generated, pairs)) / len(pairs)
        src_real = batch["attention_mask"].bool()
        src_real[torch.arange(len(pairs)), src_real.sum(1) - 1] = False  # the end token is no input position
        for steps, real, sums, counts in (
            (src_steps, src_real, src_sum, src_count),
            (tgt_steps, batch["labels"].ne(-100), tgt_sum, tgt_count),
        ):
            for pos in range(min(real.shape[1], len(sums))):
                sums[pos] += float(steps[:, pos][real[:, pos]].sum())
                counts[pos] += int(real[:, pos].sum())
    L = args.train_max_length
    inside = [by_length[n] for n in range(1, L + 1)]
    longer = [by_length[n] for n in range(L + 1, eval_max + 1)]
    return {
        "sequence_accuracy": {
            "in_distribution": round(sum(inside) / len(inside), 4),
            "longer": round(sum(longer) / len(longer), 4),
        },
        "accuracy_by_length": {str(n): round(a, 4) for n, a in by_length.items()},
        "ponder_by_input_position": _mean_by_position(src_sum, src_count),
        "ponder_by_output_position": _mean_by_position(tgt_sum, tgt_count),
    }


# ----- report --------------------------------------------------------------------------------------------------------


def write_report(results: dict, output_dir: Path, name: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    L, models = results["train_max_length"], results["models"]
    lines = [
        f"# Universal Transformer vs vanilla Transformer: `{results['task']}`, trained on lengths 1-{L}, tested on 1-{2 * L}",
        "",
        f"Command: `{results['command']}`",
        "",
        "| model | parameters | train time (s) | final train loss | seq. accuracy, lengths <= L | seq. accuracy, lengths L+1..2L | mean steps per input position |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for key, m in models.items():
        steps = [v for v in m["ponder_by_input_position"] if v is not None]
        lines.append(
            f"| {key} | {m['parameters']:,} | {m['train_seconds']} | {m['final_train_loss']} | "
            f"{m['sequence_accuracy']['in_distribution']:.3f} | {m['sequence_accuracy']['longer']:.3f} | "
            f"{sum(steps) / len(steps):.2f} |"
        )
    lengths = list(models["vanilla"]["accuracy_by_length"])
    lines += [
        "",
        "Sequence accuracy by length:",
        "",
        "| length | " + " | ".join(lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for key, m in models.items():
        lines.append(f"| {key} | " + " | ".join(f"{m['accuracy_by_length'][n]:.2f}" for n in lengths) + " |")
    ut = models["universal_act"]
    for which in ("input", "output"):
        values = ut[f"ponder_by_{which}_position"]
        lines += [
            "",
            f"Universal Transformer: mean ACT steps by {which} position (1-based; vanilla: {results['settings']['num_steps']} layers everywhere):",
            "",
            "| position | " + " | ".join(str(i + 1) for i in range(len(values))) + " |",
            "|---" * (len(values) + 1) + "|",
            "| steps | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values) + " |",
        ]  # fmt: skip
    (output_dir / f"{name}.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label, style in (
        ("ponder_by_input_position", "UT encoder (ACT), per input position", "o-"),
        ("ponder_by_output_position", "UT decoder (ACT), per output position", "s-"),
    ):
        values = ut[key]
        xs = [i + 1 for i, v in enumerate(values) if v is not None]
        ax.plot(xs, [v for v in values if v is not None], style, label=label)
    vanilla = models["vanilla"]["ponder_by_input_position"]
    ax.plot(
        [i + 1 for i in range(len(vanilla))],
        [results["settings"]["num_steps"]] * len(vanilla),
        "k--",
        label="vanilla Transformer (fixed layers)",
    )
    ax.axvline(L + 0.5, color="grey", linestyle=":", label=f"longest training length (L = {L})")
    acc = {k: m["sequence_accuracy"] for k, m in models.items()}
    ax.set_title(
        f"{results['task']}: UT acc {acc['universal_act']['in_distribution']:.2f} (<=L) / {acc['universal_act']['longer']:.2f} (>L), "
        f"vanilla {acc['vanilla']['in_distribution']:.2f} / {acc['vanilla']['longer']:.2f}",
        fontsize=10,
    )  # fmt: skip
    ax.set_xlabel("position (1-based)")
    ax.set_ylabel("mean ponder steps")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_dir / f"{name}.png", dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--task", choices=TASKS, default="reverse")
    parser.add_argument("--train-max-length", type=int, default=8, help="L: training lengths are 1..L, test 1..2L")
    parser.add_argument("--train-steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=4, help="vanilla layers per side (and UT fixed steps)")
    parser.add_argument("--act-max-steps", type=int, default=8)
    parser.add_argument("--act-loss-weight", type=float, default=0.01)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--eval-examples", type=int, default=100, help="test examples per length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default=None, help="file name stem (default: universal_algorithmic_<task>)")
    args = parser.parse_args(argv)
    for field in ("train_max_length", "train_steps", "batch_size", "eval_examples", "num_steps", "act_max_steps"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be at least 1, got {getattr(args, field)}.")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    results = {
        "task": args.task,
        "train_max_length": args.train_max_length,
        "eval_max_length": 2 * args.train_max_length,
        "settings": vars(args),
        "command": "python -m examples.run_algorithmic_task " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch_threads": torch.get_num_threads(),
        "models": {},
    }

    def universal_loss(model, batch):
        return model(**batch).loss  # task loss + ponder loss

    def vanilla_loss(model, batch):
        return model.loss(batch)

    for kind, build, loss_fn in (
        ("universal_act", lambda: build_universal(args), universal_loss),
        ("vanilla", lambda: VanillaTransformer(args.hidden_size, args.num_heads, args.intermediate_size, args.num_steps, args.dropout), vanilla_loss),
    ):  # fmt: skip
        torch.manual_seed(args.seed)
        model = build()
        entry = {"parameters": sum(p.numel() for p in model.parameters())}
        entry.update(train(model, loss_fn, args, kind))
        entry.update(evaluate(model, kind, args))
        results["models"][kind] = entry
        print(f"[{kind}] {json.dumps(entry['sequence_accuracy'])}", flush=True)
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    write_report(results, Path(args.output_dir), args.name or f"universal_algorithmic_{args.task}")
    return results


if __name__ == "__main__":
    main()
