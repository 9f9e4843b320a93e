"""torch.compile, torch.export and ONNX for every architecture (issue 14).

* ``torch.export.export`` with a dynamic batch and sequence length (Swin: height and width); the exported program
  equals eager at lengths other than the traced one, including lengths that need internal padding to a
  window / block / chunk multiple, with padded rows in the batch; Longformer also with a static batch (1 or 2).
* ``torch.onnx.export(..., dynamo=True)`` of that program, run by onnxruntime at such lengths: equal to eager to 1e-4.
* ``torch.compile(fullgraph=True, dynamic=True)``: one graph for every length, no recompilation for a new length or
  one seen before (dynamo's counters).
* Returned attention maps are part of the autograd graph.

Lengths are chosen above the few shape branches that stay in the graphs (a graph is specialised on them, so an
exported program serves one side): BigBird inputs longer than one block, Longformer inputs longer than one query
block, Reformer inputs longer than its smallest chunk, Swin images whose last stage's map is larger than the window
(here 17 px and more: patch 2, two stages, window 4). Everything else (padding amounts, block counts, BigBird's
random-block pattern, Linformer's masks, Performer's feature blocks, ACT's halting) is computed by tensor operations
inside one graph.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.export import Dim

import hf_xformers as H
from tests import (
    test_bigbird,
    test_linformer,
    test_longformer,
    test_performer,
    test_reformer,
    test_swin,
    test_transfo_xl,
    test_universal,
)

ATOL = 1e-4
TRACE_LENGTH = 16
# Eager / exported / ONNX comparisons: odd lengths need internal padding in every blocked kernel (Longformer's query
# blocks of 2, BigBird's blocks of 4, Reformer's chunk multiple of 8, Performer's causal chunks); 24 is a multiple.
LENGTHS = (11, 24, 37)
MIN_LENGTH, MAX_LENGTH = 9, 40  # 40: the tiny Linformer's n (rows of E and F)
SWIN_TRACE = (32, 24)  # not square: dynamo's duck sizing would give equal sizes one symbol (a recompile later)
SWIN_SIZES = ((17, 17), (40, 33), (64, 48))  # 17: stage maps 9 x 9 and 5 x 5, both padded to the window of 4

TEXT_ARCHS = ["longformer", "bigbird", "linformer", "performer", "reformer", "transfo_xl", "universal", "universal_act"]
ARCHS = TEXT_ARCHS + ["swin"]


def build(arch: str) -> torch.nn.Module:
    """The base model of ``arch`` with a tiny config (hidden <= 64, 2 layers), weights perturbed so that every
    tensor matters (biases and LayerNorms are not left at their 0 / 1 init), in eval mode."""
    torch.manual_seed(0)
    if arch == "longformer":
        model = H.HfxLongformerModel(H.HfxLongformerConfig(**test_longformer.TINY, attention_window=4))
    elif arch == "bigbird":
        model = H.HfxBigBirdModel(H.HfxBigBirdConfig(**test_bigbird.TINY, block_size=4, num_random_blocks=1))
    elif arch == "linformer":
        model = H.HfxLinformerModel(H.HfxLinformerConfig(**test_linformer.TINY, linformer_k=8))
    elif arch == "performer":
        model = H.HfxPerformerModel(H.HfxPerformerConfig(**test_performer.TINY))
    elif arch == "reformer":  # two hashing rounds: the round-combining and short-example paths trace too
        model = H.HfxReformerModel(test_reformer.configs(num_hashes=2)[1])
    elif arch == "transfo_xl":
        model = H.HfxTransfoXLModel(test_transfo_xl.tiny())
    elif arch == "universal":
        model = H.HfxUniversalModel(test_universal.config(use_act=False))
    elif arch == "universal_act":  # 8 steps at most: positions halt before the cap, so eager stops early
        model = H.HfxUniversalModel(test_universal.config(use_act=True, act_max_steps=8))
    elif arch == "swin":
        model = H.HfxSwinModel(H.HfxSwinConfig(**test_swin.TINY))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


class TextEncoder(torch.nn.Module):
    """``(input_ids, attention_mask) -> last_hidden_state``: the traced entry point of a text model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class ImageEncoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).last_hidden_state


def text_inputs(length: int, batch: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and a mask whose second row is right-padded (its last third is padding)."""
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(5, 99, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, length - length // 3 :] = 0
        ids[1, length - length // 3 :] = 1  # the pad token
    return ids, mask


def image_inputs(size: tuple[int, int], batch: int = 2) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(size[0] * 100 + size[1])),)


def wrapper(arch: str) -> torch.nn.Module:
    model = build(arch)
    return ImageEncoder(model) if arch == "swin" else TextEncoder(model)


def dynamic_shapes(arch: str) -> dict:
    batch = Dim("batch", min=1, max=8)
    if arch == "swin":
        return {"pixel_values": {0: batch, 2: Dim("height", min=17, max=64), 3: Dim("width", min=17, max=64)}}
    length = Dim("length", min=MIN_LENGTH, max=MAX_LENGTH)
    return {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}


def example(arch: str, size=None) -> tuple:
    if arch == "swin":
        return image_inputs(size or SWIN_TRACE)
    return text_inputs(size or TRACE_LENGTH, batch=2)


def sizes_for(arch: str) -> list:
    return list(SWIN_SIZES) if arch == "swin" else list(LENGTHS)


def inputs_for(arch: str, size) -> tuple:
    return image_inputs(size, batch=3) if arch == "swin" else text_inputs(size)


def real_rows(arch: str, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """Outputs at real tokens only (padded positions carry no meaning and differ between formulations)."""
    if arch == "swin":
        return output
    return output * inputs[1][..., None]


def torch_export(module: torch.nn.Module, arch: str):
    """Plain ``torch.export.export`` with the dynamic shapes above (no tracer settings: a guard the tracer cannot
    prove for every length in the range fails the export)."""
    return torch.export.export(module, example(arch), dynamic_shapes=dynamic_shapes(arch))


@functools.cache
def exported(arch: str):
    """``(module, ExportedProgram)``, exported once per architecture for the export and ONNX tests."""
    module = wrapper(arch)
    return module, torch_export(module, arch)


# ----- torch.export --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_export_with_dynamic_shapes_matches_eager(arch):
    module, program = exported(arch)
    exported_module = program.module()
    for size in sizes_for(arch):
        inputs = inputs_for(arch, size)
        with torch.no_grad():
            expected = module(*inputs)
            got = exported_module(*inputs)
        assert got.shape == expected.shape
        torch.testing.assert_close(real_rows(arch, inputs, got), real_rows(arch, inputs, expected), atol=ATOL, rtol=0)


def test_value_checks_do_not_run_while_tracing():
    """The vocabulary check reads ``input_ids.max()``: in eager mode it raises, in a traced graph it is absent (an
    id out of range then fails inside the embedding lookup, as in any exported model)."""
    module, program = exported("longformer")
    ids, mask = text_inputs(12)
    ids[0, 3] = 500
    with pytest.raises(ValueError, match="vocab_size"):
        module(ids, mask)
    ids[0, 3] = 7
    torch.testing.assert_close(program.module()(ids, mask) * mask[..., None], module(ids, mask) * mask[..., None])


@pytest.mark.parametrize(("window", "min_length"), [(16, 9), (128, 17)])
def test_longformer_export_needs_more_than_one_query_block(window, min_length):
    """README's Longformer condition: the banded graph is specialised on more than one query block (``b`` = the
    one-sided window ``w = attention_window // 2``, or ``w // 4`` from ``w = 64`` on), so an exported length ``Dim``
    must start at ``b + 1``: below it the export is refused with the bound as the suggested fix, at it one program
    serves every length up to the maximum."""
    torch.manual_seed(0)
    config = H.HfxLongformerConfig(**test_longformer.TINY, attention_window=window)
    module = TextEncoder(H.HfxLongformerModel(config).eval())
    max_length = config.max_position_embeddings - 2  # RoBERTa's position offset

    def export(low: int):
        batch, length = Dim("batch", min=1, max=8), Dim("length", min=low, max=max_length)
        shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
        return torch.export.export(module, text_inputs(min_length + 7, batch=2), dynamic_shapes=shapes)

    with pytest.raises(torch._dynamo.exc.UserError, match=rf"Constraints violated \(length\)[\s\S]*min={min_length}\b"):
        export(min_length - 1)
    program = export(min_length).module()
    for length in (min_length, 37, max_length):
        inputs = text_inputs(length)
        with torch.no_grad():
            expected, got = module(*inputs), program(*inputs)
        torch.testing.assert_close(
            real_rows("longformer", inputs, got), real_rows("longformer", inputs, expected), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize(("batch", "with_globals"), [(1, False), (2, False), (1, True)])
def test_longformer_exports_with_a_static_batch(batch, with_globals):
    """The serving shape: a static batch and a dynamic length from README's bound (``min=9`` for window 16).

    Reshapes that merged the static batch ``B`` with the symbolic query-block count ``ceil(L / 8)`` made the tracer
    decide ``B % (B * ceil(L / 8)) != 0``, which export refused as a guard on the length (a dynamic batch hid it). The
    program must equal eager at lengths with and without internal padding up to the position table's limit, with a
    padded row (batch 2) and with global tokens (traced as one slot per position).
    """
    torch.manual_seed(0)
    config = H.HfxLongformerConfig(**test_longformer.TINY, attention_window=16)
    model = H.HfxLongformerModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, global_attention_mask=None):
            return self.model(input_ids, attention_mask, global_attention_mask).last_hidden_state

    def inputs(length: int) -> tuple:
        ids, mask = text_inputs(length, batch=batch)
        if not with_globals:
            return ids, mask
        globals_ = torch.zeros_like(mask)
        globals_[:, 0] = 1
        globals_[0, length // 2] = 1
        return ids, mask, globals_

    module = Encoder()
    max_length = config.max_position_embeddings - 2  # RoBERTa's position offset
    length = Dim("length", min=9, max=max_length)
    shapes = {"input_ids": {1: length}, "attention_mask": {1: length}}
    if with_globals:
        shapes["global_attention_mask"] = {1: length}
    program = torch.export.export(module, inputs(23), dynamic_shapes=shapes).module()
    # Query blocks of 8: 9, 23, 37 and the maximum (126) are padded inside, 16 and 64 are whole blocks.
    for n in (9, 16, 23, 37, 64, max_length):
        args = inputs(n)
        with torch.no_grad():
            expected, got = module(*args), program(*args)
        assert got.shape == expected.shape == (batch, n, config.hidden_size)
        torch.testing.assert_close(got * args[1][..., None], expected * args[1][..., None], atol=1e-5, rtol=0)


def test_transfo_xl_exports_with_memories():
    """Transformer-XL with memories of ``mem_len`` positions (the steady state of a stream) as inputs and the new
    memories as outputs; batch and segment length dynamic."""
    torch.manual_seed(0)
    model = build("transfo_xl")
    mem_len = model.config.mem_len

    class WithMemories(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, mem0, mem1):
            out = self.model(input_ids=input_ids, mems=(mem0, mem1))
            return (out.last_hidden_state, *out.mems)

    module = WithMemories().eval()
    batch, length = Dim("batch", min=1, max=8), Dim("length", min=2, max=40)
    shapes = {"input_ids": {0: batch, 1: length}, "mem0": {0: batch}, "mem1": {0: batch}}

    def inputs(b, n):
        g = torch.Generator().manual_seed(n)
        mems = [torch.randn(b, mem_len, model.config.d_model, generator=g) for _ in range(2)]
        return (torch.randint(5, 99, (b, n), generator=g), *mems)

    program = torch.export.export(module, inputs(2, 6), dynamic_shapes=shapes)
    for b, n in ((1, 3), (3, 17)):
        args = inputs(b, n)
        with torch.no_grad():
            for got, expected in zip(program.module()(*args), module(*args)):
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# ----- ONNX ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_onnx_export_matches_eager_at_other_lengths(arch, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    module, program = exported(arch)
    path = tmp_path / f"{arch}.onnx"
    torch.onnx.export(program, dynamo=True, optimize=False, verbose=False).save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for size in sizes_for(arch):
        inputs = inputs_for(arch, size)
        got = torch.from_numpy(session.run(None, dict(zip(names, (t.numpy() for t in inputs))))[0])
        with torch.no_grad():
            expected = module(*inputs)
        assert got.shape == expected.shape
        torch.testing.assert_close(real_rows(arch, inputs, got), real_rows(arch, inputs, expected), atol=ATOL, rtol=0)


# ----- torch.compile -------------------------------------------------------------------------------------------


def compile_and_count(module: torch.nn.Module, calls) -> tuple[int, list]:
    """Run ``calls`` (argument tuples) through ``torch.compile(module, fullgraph=True, dynamic=True)`` (eager backend);
    returns the number of graphs dynamo compiled and the outputs."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        outputs = [compiled(*args) for args in calls]
    return counters["stats"]["unique_graphs"], outputs


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_fullgraph_does_not_recompile_for_new_lengths(arch):
    module = wrapper(arch)
    sizes = [SWIN_TRACE, *SWIN_SIZES, SWIN_TRACE] if arch == "swin" else [TRACE_LENGTH, *LENGTHS, TRACE_LENGTH]
    calls = [inputs_for(arch, size) for size in sizes]
    graphs, outputs = compile_and_count(module, calls)
    assert graphs == 1, f"{graphs} graphs for {len(calls)} calls of different sizes"
    for args, got in zip(calls, outputs):
        with torch.no_grad():
            expected = module(*args)
        torch.testing.assert_close(real_rows(arch, args, got), real_rows(arch, args, expected), atol=ATOL, rtol=0)


def test_compile_longformer_with_global_attention():
    """Global tokens (a value-dependent count in eager mode) trace as length-many masked slots."""
    model = build("longformer")

    class WithGlobals(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, global_attention_mask):
            return self.model(input_ids, attention_mask, global_attention_mask).last_hidden_state

    module = WithGlobals()
    calls = []
    for length in (16, 23, 30):
        ids, mask = text_inputs(length)
        globals_ = torch.zeros_like(mask)
        globals_[:, 0] = 1
        globals_[0, 5] = 1
        calls.append((ids, mask, globals_))
    graphs, outputs = compile_and_count(module, calls)
    assert graphs == 1
    for args, got in zip(calls, outputs):
        with torch.no_grad():
            torch.testing.assert_close(got * args[1][..., None], module(*args) * args[1][..., None], atol=ATOL, rtol=0)


def test_compile_performer_causal_lm():
    model = H.HfxPerformerForCausalLM(H.HfxPerformerConfig(**test_performer.TINY)).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

    module = Logits()
    # Causal chunks of 64: lengths above one chunk (a single chunk is a graph of its own), padded, exact, padded.
    calls = [(text_inputs(n, batch=2)[0],) for n in (70, 128, 93, 70)]
    graphs, outputs = compile_and_count(module, calls)
    assert graphs == 1
    for args, got in zip(calls, outputs):
        with torch.no_grad():
            torch.testing.assert_close(got, module(*args), atol=ATOL, rtol=0)


def test_compile_bigbird_training_mode_draws_random_blocks_in_graph():
    """Training mode (fresh random blocks every call) compiles into one graph too: the draw is vectorised over the
    examples instead of a Python loop over their block counts."""
    model = build("bigbird").train()
    module = TextEncoder(model)
    calls = [text_inputs(n) for n in (16, 29, 40)]
    graphs, outputs = compile_and_count(module, calls)
    assert graphs == 1
    assert all(torch.isfinite(o).all() for o in outputs)


def test_act_runs_every_step_under_tracing_with_eager_results():
    """ACT's loop stops early in eager mode once no position runs; a traced graph runs all ``act_max_steps`` steps
    (the extra steps have update weight 0), and the outputs agree, ponder counts included."""
    model = build("universal_act")
    ids, mask = text_inputs(20)

    class Ponder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.ponder_steps, out.ponder_remainders

    module = Ponder()
    with torch.no_grad():
        eager = module(ids, mask)
    assert eager[1].max() < model.config.act_max_steps  # the eager loop did stop early
    program = torch.export.export(module, (ids, mask))
    for got, expected in zip(program.module()(ids, mask), eager):
        torch.testing.assert_close(got * mask[..., None] if got.dim() == 3 else got * mask, expected * (
            mask[..., None] if expected.dim() == 3 else mask), atol=ATOL, rtol=0)  # fmt: skip


def test_inductor_compiles_a_small_model():
    """One real compile with the default (inductor) backend, dynamic lengths, on a one-layer Linformer (about 25 s
    with a cold inductor cache on 2 CPU cores, mostly C++ compilation of the generated kernels)."""
    torch.manual_seed(0)
    config = H.HfxLinformerConfig(**{**test_linformer.TINY, "num_hidden_layers": 1}, linformer_k=8)
    module = TextEncoder(H.HfxLinformerModel(config).eval())
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for length in (16, 23):
        ids, mask = text_inputs(length)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, mask) * mask[..., None], module(ids, mask) * mask[..., None],
                                       atol=ATOL, rtol=0)  # fmt: skip
    assert time.perf_counter() - start < 120


# ----- attention maps in the autograd graph --------------------------------------------------------------------


@pytest.mark.parametrize("length", [24, 21], ids=["no-internal-padding", "internal-padding"])
@pytest.mark.parametrize("arch", ARCHS)
def test_returned_attention_maps_get_gradients(arch, length):
    model = build(arch)
    if arch == "swin":
        inputs = {"pixel_values": image_inputs((32, 32) if length == 24 else (30, 27))[0]}
    else:
        # 24 is a multiple of every tiny config's blocks and chunks; 21 makes the blocked kernels pad inside and cut
        # back, so the returned maps must be the cut that the context is computed from.
        inputs = {"input_ids": text_inputs(length, batch=2)[0]}
    out = model(**inputs, output_attentions=True)
    maps = [a for a in out.attentions if a is not None]
    assert maps
    for a in maps:
        a.retain_grad()
    out.last_hidden_state.pow(2).sum().backward()
    assert all(a.grad is not None for a in maps), "an attention map is a detached branch"
    assert any(a.grad.abs().sum() > 0 for a in maps)
