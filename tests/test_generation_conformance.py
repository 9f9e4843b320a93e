"""The generation conformance suite: what transformers' own generation tests expect, for every generating class.

Every class registered as ``AutoModelForCausalLM`` or ``AutoModelForSeq2SeqLM`` (``tests/test_generation.py``'s
``CASES``) runs each test: greedy, sampling and beam search give the same tokens with and without the cache; left
padding under ``attention_mask``; ``output_scores`` / ``output_attentions`` / ``output_hidden_states`` under
``return_dict_in_generate``, unpadded and left-padded (cached steps feed the new token alone and give the uncached
logits; the cached step's attention row equals the full forward's last row); length controls
(``max_new_tokens``, ``min_new_tokens``, stopping criteria, ``num_return_sequences``); ``generate()`` without a prompt;
keyword arguments such as ``token_type_ids`` reaching ``forward``; assisted decoding and prompt lookup refused with
transformers' error for stateful models. And the contract transformers' own generating models keep:
``GenerationMixin`` among the direct bases, ``prepare_inputs_for_generation`` passing other keyword arguments on,
``position_ids`` given to ``generate()`` (counted from 0 over the mask, as ``generate()`` counts them) giving the same
tokens as none, and the base model stored under ``base_model_prefix`` (loading a base checkpoint fills it).
"""

from __future__ import annotations

import inspect
import tempfile

import pytest
import torch
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList

from hf_xformers.ops.compat import CACHE_NAME
from hf_xformers.registration import REGISTRY

from .generation_checks import greedy_by_hand
from .test_generation import CASES, TINY_CONFIGS, VOCAB, _model, _prompt

PAD = 1
IDS = [f"{t}-{c.__name__}" for t, _, c in CASES]
CAUSAL = [case for case in CASES if case[1] == "AutoModelForCausalLM"]
CAUSAL_IDS = [f"{t}-{c.__name__}" for t, _, c in CAUSAL]
# Reformer's positions count from the first slot, padding included (as in transformers' Reformer), so a left-padded
# prompt is a different input; everywhere else positions (or relative distances) ignore padding.
POSITIONS_FROM_FIRST_SLOT = {"hfx-reformer"}


def _generate(model, prompt, **kwargs):
    kwargs = {"max_new_tokens": 5, "pad_token_id": PAD, "eos_token_id": None, **kwargs}
    return model.generate(prompt, **kwargs)


def _new_tokens(model, out: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """The generated part of ``generate()``'s sequences (seq2seq outputs start with the decoder start token)."""
    return out[:, 1:] if model.config.is_encoder_decoder else out[:, prompt.shape[1] :]


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_cache_gives_the_same_tokens(model_type, task, model_class, mode):
    model = _model(model_type, model_class)
    prompt = _prompt(2, 6)
    kwargs = {
        "greedy": dict(do_sample=False),
        "sample": dict(do_sample=True, top_k=0, temperature=1.0),
        "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    }[mode]
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        outs.append(_generate(model, prompt, use_cache=use_cache, **kwargs))
    assert torch.equal(outs[0], outs[1])
    rows = 4 if mode == "beam" else 2
    assert outs[0].shape[0] == rows and _new_tokens(model, outs[0], prompt).shape[1] == 5


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
def test_left_padding_with_attention_mask(model_type, task, model_class):
    """A batch of a long and a left-padded short prompt: the ids under the mask never matter, the unpadded row is
    generated as it is alone, and (positions ignoring padding) so is the padded one."""
    model = _model(model_type, model_class)
    long, short = _prompt(1, 8)[0], _prompt(1, 5)[0].flip(0)
    batch = torch.stack([long, torch.cat([torch.full((3,), PAD), short])])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = _new_tokens(model, _generate(model, batch, attention_mask=mask, do_sample=False), batch)
    other = batch.clone()
    other[1, :3] = 7  # other ids under the mask
    assert torch.equal(_new_tokens(model, _generate(model, other, attention_mask=mask, do_sample=False), other), out)
    alone_long = _new_tokens(model, _generate(model, long[None], do_sample=False), long[None])
    assert torch.equal(out[0], alone_long[0])
    if model_type not in POSITIONS_FROM_FIRST_SLOT:
        alone_short = _new_tokens(model, _generate(model, short[None], do_sample=False), short[None])
        assert torch.equal(out[1], alone_short[0])


def _per_step(outputs, name: str):
    """``attentions`` / ``hidden_states`` of a causal LM, ``decoder_*`` of a seq2seq model: one tuple per step."""
    return outputs.get(name) if name in outputs else outputs.get(f"decoder_{name}")


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_dict_outputs(model_type, task, model_class, use_cache):
    model = _model(model_type, model_class)
    prompt = _prompt(2, 6)
    kwargs = dict(
        do_sample=False, use_cache=use_cache, return_dict_in_generate=True, output_scores=True, output_logits=True,
        output_attentions=True, output_hidden_states=True,
    )  # fmt: skip
    out = _generate(model, prompt, **kwargs)
    steps = 5
    assert len(out.scores) == len(out.logits) == steps
    assert all(s.shape == (2, VOCAB) for s in out.scores)
    # Greedy: each step's token is the argmax of its scores.
    assert torch.equal(torch.stack([s.argmax(-1) for s in out.scores], 1), _new_tokens(model, out.sequences, prompt))
    seen = 1 if model.config.is_encoder_decoder else prompt.shape[1]  # decoder tokens before the first step
    hidden = _per_step(out, "hidden_states")
    assert len(hidden) == steps
    for step, layers in enumerate(hidden):
        queries = seen + step if (step == 0 or not use_cache) else 1
        assert len(layers) >= 2 and all(h.shape == (2, queries, model.config.hidden_size) for h in layers)
    if not kwargs["output_attentions"]:
        return
    attentions = _per_step(out, "attentions")
    assert len(attentions) == steps
    for step, layers in enumerate(attentions):
        queries = seen + step if (step == 0 or not use_cache) else 1
        assert len(layers) >= 1
        for a in layers:
            assert a.shape[0] == 2 and a.shape[-2:] == (queries, seen + step)
            torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)), atol=1e-5, rtol=0)
    if model.config.is_encoder_decoder:
        assert len(out.encoder_attentions) >= 1 and len(out.cross_attentions) == steps


# transformers' four dict-output generation tests (test_greedy_generate_dict_outputs, test_sample_generate_dict_output,
# test_beam_search_generate_dict_output, test_beam_sample_generate_dict_output): their generate() arguments and the
# rows generate() runs (num_return_sequences samples, num_beams beams per prompt).
TRANSFORMERS_DICT_OUTPUT_TESTS = {
    "greedy": (dict(do_sample=False, num_beams=1), 1),
    "sample": (dict(do_sample=True, num_beams=1, num_return_sequences=2, top_k=10, top_p=0.7, temperature=0.7), 2),
    "beam_search": (dict(do_sample=False, num_beams=2, early_stopping=False, length_penalty=2.0), 2),
    "beam_sample": (dict(do_sample=True, num_beams=2, early_stopping=False, length_penalty=2.0, top_k=10), 2),
}
# A memory shorter than the prompt: a cached step sees the memory and the new token, yet reports every token so far.
SHORT_MEMORY = {"hfx-transfo-xl": dict(mem_len=4)}


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", list(TRANSFORMERS_DICT_OUTPUT_TESTS))
def test_transformers_dict_output_tests(model_type, task, model_class, mode):
    """What transformers' ``_check_generate_outputs`` reads from those four tests with the cache, on an unpadded
    prompt (whose all-ones mask ``generate()`` drops before the first step): the cache comes back; scores and logits
    per step; attentions ``(rows, heads, queries, keys)`` with one query per step after the first and keys over every
    token so far; hidden states of one position per step after the first. (Without the cache every step is a full
    forward: ``test_dict_outputs`` and ``test_left_padded_dict_outputs_use_the_cache``.)"""
    config_class = REGISTRY[model_type][0]
    torch.manual_seed(0)
    config = config_class(vocab_size=VOCAB, **{**TINY_CONFIGS[model_type], **SHORT_MEMORY.get(model_type, {})})
    model = model_class(config).eval()
    prompt = _prompt(2, 7)
    kwargs, rows_per_prompt = TRANSFORMERS_DICT_OUTPUT_TESTS[mode]
    torch.manual_seed(0)
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, use_cache=True, pad_token_id=PAD,
        eos_token_id=None, bad_words_ids=[[1, 0]], repetition_penalty=1.2, remove_invalid_values=True,
        output_scores=True, output_logits=True, output_attentions=True, output_hidden_states=True,
        return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    rows, steps = 2 * rows_per_prompt, 3
    assert getattr(out, CACHE_NAME) is not None
    assert len(out.scores) == len(out.logits) == steps
    assert all(tuple(s.shape) == (rows, VOCAB) for s in (*out.scores, *out.logits))
    config = model.config  # the seq2seq head sets is_encoder_decoder on its own copy
    seen = 1 if config.is_encoder_decoder else prompt.shape[1]
    for step, (hidden, attentions) in enumerate(
        zip(_per_step(out, "hidden_states"), _per_step(out, "attentions"), strict=True)
    ):
        queries = 1 if step > 0 else seen
        assert {tuple(h.shape) for h in hidden} == {(rows, queries, config.hidden_size)}, step
        expected = (rows, config.num_attention_heads, queries, seen + step)
        assert {tuple(a.shape) for a in attentions} == {expected}, step


def _mask_with_holes(batch: int, length: int) -> torch.Tensor:
    """An attention mask as transformers' model testers draw one (``random_attention_mask``): the first column real,
    padding anywhere else, ``(batch, length)``; here a hole per row at a different place, and the last row's prompt
    ends in padding (``generate()`` then numbers the first new token from the padded slot's position, so its
    ``position_ids`` restart among the real tokens: an ordinary input all the same)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        mask[row, 1 + 2 * row] = 0
    mask[-1, -1] = 0
    return mask


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", list(TRANSFORMERS_DICT_OUTPUT_TESTS))
@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_a_returned_cache_means_one_query_per_step(model_type, task, model_class, mode, use_cache):
    """transformers' ``_check_generate_outputs`` reads a returned cache as the promise that every step after the
    first fed the new token alone: with one, each later step's attentions are ``(rows, heads, 1, keys so far)``
    (Transformer-XL's memories count as keys); without one, ``(rows, heads, n, n)`` over every token so far. So a
    cache comes back exactly when ``use_cache`` asks for it, also under a mask with holes (what its model testers pass;
    transformers' four dict-output tests run without the cache, and a prompt ending in padding once made Performer,
    Transformer-XL and the Universal Transformer refuse those inputs as a packed batch)."""
    config_class = REGISTRY[model_type][0]
    torch.manual_seed(0)
    config = config_class(vocab_size=VOCAB, **{**TINY_CONFIGS[model_type], **SHORT_MEMORY.get(model_type, {})})
    model = model_class(config).eval()
    prompt = _prompt(2, 7)
    kwargs, rows_per_prompt = TRANSFORMERS_DICT_OUTPUT_TESTS[mode]
    torch.manual_seed(0)
    out = model.generate(
        prompt, attention_mask=_mask_with_holes(2, 7), max_new_tokens=3, min_new_tokens=3, use_cache=use_cache,
        pad_token_id=PAD, eos_token_id=None, output_attentions=True, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    assert (getattr(out, CACHE_NAME) is not None) is use_cache
    config = model.config
    seen = 1 if config.is_encoder_decoder else prompt.shape[1]
    attentions = _per_step(out, "attentions")
    assert len(attentions) == 3
    for step, layers in enumerate(attentions):
        queries = 1 if (use_cache and step > 0) else seen + step
        expected = (2 * rows_per_prompt, config.num_attention_heads, queries, seen + step)
        assert [tuple(a.shape) for a in layers] == [expected] * len(layers), (step, use_cache)


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam"])
def test_left_padded_dict_outputs_use_the_cache(model_type, task, model_class, num_beams):
    """transformers' per-step contract under left padding (a batch as a tokenizer pads it for generate()): with the
    cache every step after the first feeds the new token alone (hidden states and attention queries of length 1,
    keys of every token so far) and the cache comes back; without it every step is a full forward and no cache comes
    back; and both give the same logits at every step."""
    model = _model(model_type, model_class)
    prompt = _prompt(2, 7)
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = PAD, 0
    kwargs = dict(
        attention_mask=mask, do_sample=False, num_beams=num_beams, return_dict_in_generate=True, output_logits=True,
        output_attentions=True, output_hidden_states=True,
    )  # fmt: skip
    runs = {use_cache: _generate(model, prompt, use_cache=use_cache, **kwargs) for use_cache in (True, False)}
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for cached_logits, full_logits in zip(runs[True].logits, runs[False].logits, strict=True):
        torch.testing.assert_close(cached_logits, full_logits, atol=1e-5, rtol=0)
    assert getattr(runs[True], CACHE_NAME) is not None and getattr(runs[False], CACHE_NAME) is None
    seen = 1 if model.config.is_encoder_decoder else prompt.shape[1]
    rows = 2 * num_beams
    for use_cache, out in runs.items():
        steps = zip(_per_step(out, "hidden_states"), _per_step(out, "attentions"), strict=True)
        for step, (hidden, attentions) in enumerate(steps):
            queries = 1 if (use_cache and step > 0) else seen + step
            assert all(h.shape == (rows, queries, model.config.hidden_size) for h in hidden), (use_cache, step)
            assert all(a.shape[0] == rows and a.shape[-2:] == (queries, seen + step) for a in attentions)


@pytest.mark.parametrize(("model_type", "task", "model_class"), CAUSAL, ids=CAUSAL_IDS)
def test_cached_step_attends_as_the_full_forward(model_type, task, model_class):
    """The attention probabilities of a cached step equal the last row of a full forward over the same tokens."""
    model = _model(model_type, model_class)
    prompt = _prompt(2, 7)
    out = _generate(
        model, prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_attentions=True
    )
    with torch.no_grad():
        full = model(input_ids=out.sequences[:, :-1], output_attentions=True).attentions
    cached = out.attentions[1]  # the step that fed one token
    assert len(cached) == len(full)
    for step_probs, full_probs in zip(cached, full):
        torch.testing.assert_close(step_probs[..., 0, :], full_probs[..., -1, :], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
def test_length_controls(model_type, task, model_class):
    model = _model(model_type, model_class)
    prompt = _prompt(2, 6)
    free = _new_tokens(model, _generate(model, prompt, max_new_tokens=6, do_sample=False), prompt)
    assert free.shape[1] == 6
    # The first generated token of row 0 as eos: row 0 stops at once (then pads), unless min_new_tokens holds it.
    eos = int(free[0, 0])
    stopped = _new_tokens(model, _generate(model, prompt, max_new_tokens=6, do_sample=False, eos_token_id=eos), prompt)
    assert int(stopped[0, 0]) == eos and bool((stopped[0, 1:] == PAD).all())
    held = _new_tokens(
        model, _generate(model, prompt, max_new_tokens=6, min_new_tokens=3, do_sample=False, eos_token_id=eos), prompt
    )
    assert bool((held[:, :3] != eos).all())

    class StopAfter(StoppingCriteria):
        def __init__(self, length: int) -> None:
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    start = 1 if model.config.is_encoder_decoder else prompt.shape[1]
    cut = _generate(
        model, prompt, max_new_tokens=6, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter(start + 2)])
    )
    assert torch.equal(_new_tokens(model, cut, prompt), free[:, :2])
    torch.manual_seed(0)
    several = _generate(model, prompt, max_new_tokens=3, do_sample=True, num_return_sequences=3)
    assert several.shape[0] == 6


@pytest.mark.parametrize(("model_type", "task", "model_class"), CAUSAL, ids=CAUSAL_IDS)
def test_generate_without_a_prompt(model_type, task, model_class):
    """From the config's ``bos_token_id`` (or one given to generate(); without either, transformers' error)."""
    model = _model(model_type, model_class)
    bos = model.config.bos_token_id
    if bos is None:
        with pytest.raises(ValueError, match="bos_token_id"):
            model.generate(max_new_tokens=3, do_sample=False, pad_token_id=PAD, eos_token_id=None)
        bos = 2
    out = model.generate(max_new_tokens=3, do_sample=False, pad_token_id=PAD, eos_token_id=None, bos_token_id=bos)
    assert out.shape == (1, 4) and int(out[0, 0]) == bos
    assert torch.equal(out, greedy_by_hand(model, out[:, :1], 3))


@pytest.mark.parametrize(("model_type", "task", "model_class"), CAUSAL, ids=CAUSAL_IDS)
def test_forward_keywords_reach_the_model(model_type, task, model_class):
    """Keyword arguments given to generate() that forward accepts (token types here) are used at every step."""
    import inspect

    if "token_type_ids" not in inspect.signature(model_class.forward).parameters:
        pytest.skip("no token types in this architecture")
    config_class = _model(model_type, model_class).config_class
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=VOCAB, type_vocab_size=2, **TINY_CONFIGS[model_type])).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompt = _prompt(2, 6)
    types = torch.ones_like(prompt)
    out = _generate(model, prompt, token_type_ids=types, do_sample=False, max_new_tokens=4)
    assert torch.equal(out, greedy_by_hand(model, prompt, 4, token_type_ids=types))
    # The scores, not the tokens: a tiny random model may pick the same greedy tokens with and without token types.
    scored = {"do_sample": False, "max_new_tokens": 4, "output_scores": True, "return_dict_in_generate": True}
    with_types = _generate(model, prompt, token_type_ids=types, **scored).scores
    without = _generate(model, prompt, **scored).scores
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(with_types, without))


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
def test_assisted_decoding_is_refused(model_type, task, model_class):
    """Assisted decoding and prompt lookup roll the cache back to the accepted tokens, which our caches (recurrent
    states, memories, buckets) cannot do: transformers' own refusal for stateful models."""
    model = _model(model_type, model_class)
    prompt = _prompt(1, 6)
    with pytest.raises(ValueError, match="stateful"):
        _generate(model, prompt, do_sample=False, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="stateful"):
        _generate(model, prompt, do_sample=False, assistant_model=model)


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
def test_generation_mixin_is_a_direct_base(model_type, task, model_class):
    """transformers 5 recognises a generating class by ``GenerationMixin`` among its direct bases (``can_generate``
    then gives the model a ``generation_config``), as its own models list it."""
    assert GenerationMixin in model_class.__bases__
    assert model_class.can_generate()
    assert _model(model_type, model_class).generation_config is not None


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
def test_prepare_inputs_passes_other_keywords_on(model_type, task, model_class):
    """As transformers' ``prepare_inputs_for_generation``: a keyword argument it does not know reaches ``forward``
    (which refuses an unknown name rather than ignoring it); generate()'s bookkeeping, transformers-wide keywords this
    forward has no parameter for, and (encoder-decoder) the encoder's own arguments do not."""
    model = _model(model_type, model_class)
    ids = _prompt(2, 3)
    encoder_only = set()
    if model.config.is_encoder_decoder:
        encoder_only = set(inspect.signature(model.get_encoder().forward).parameters)
        encoder_only -= set(inspect.signature(model.forward).parameters)
    extra = {key: torch.zeros(2, 3) for key in sorted(encoder_only)}
    inputs = model.prepare_inputs_for_generation(
        ids, attention_mask=torch.ones_like(ids), use_cache=False, marker="kept", is_first_iteration=True,
        next_sequence_length=1, labels=ids, output_router_logits=True, **extra,
    )  # fmt: skip
    assert inputs["marker"] == "kept"
    dropped = {"is_first_iteration", "next_sequence_length", "labels", "output_router_logits", *encoder_only}
    assert not dropped & set(inputs)
    with pytest.raises(TypeError, match="marker"):
        model(**inputs)


@pytest.mark.parametrize(("model_type", "task", "model_class"), CAUSAL, ids=CAUSAL_IDS)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_explicit_positions_give_the_same_tokens(model_type, task, model_class, padded):
    """``position_ids`` as ``generate()`` infers them (counted from 0 over the attention mask, 0 at padding) change
    nothing, cached or not: a model whose table starts elsewhere (RoBERTa's, from ``padding_idx + 1``) moves them."""
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        pytest.skip("no position_ids in this architecture")
    if padded and model_type in POSITIONS_FROM_FIRST_SLOT:
        pytest.skip("positions count from the first slot, padding included")
    model = _model(model_type, model_class)
    prompt = _prompt(2, 7)
    mask = torch.ones_like(prompt)
    if padded:
        prompt[1, :3], mask[1, :3] = PAD, 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    for use_cache in (True, False):
        kwargs = dict(attention_mask=mask, do_sample=False, use_cache=use_cache)
        with_positions = _generate(model, prompt, position_ids=positions, **kwargs)
        assert torch.equal(with_positions, _generate(model, prompt, **kwargs))


@pytest.mark.parametrize(("model_type", "task", "model_class"), CASES, ids=IDS)
def test_base_model_prefix_holds_the_base_model(model_type, task, model_class):
    """The one child of the base model's class is the attribute ``base_model_prefix`` names (transformers adds or
    strips that prefix to move weights between base and head checkpoints), and a base checkpoint fills it."""
    model = _model(model_type, model_class)
    base_class = REGISTRY[model_type][1]["AutoModel"]
    children = [name for name, child in model.named_children() if type(child) is base_class]
    assert children == [model.base_model_prefix]
    torch.manual_seed(1)
    base = base_class(model.config)
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        loaded, info = model_class.from_pretrained(tmp, output_loading_info=True)
    shared = {f"{model.base_model_prefix}.{key}" for key in getattr(loaded, loaded.base_model_prefix).state_dict()}
    shared &= {f"{model.base_model_prefix}.{key}" for key in base.state_dict()}
    assert shared and not shared & set(info["missing_keys"])
    for key in sorted(shared)[:8]:
        name = key.split(".", 1)[1]
        torch.testing.assert_close(loaded.state_dict()[key], base.state_dict()[name])
