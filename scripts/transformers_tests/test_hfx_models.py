"""transformers' own common model tests and generation tests, run on every hf_xformers class.

Not part of this project's suite: it imports ``tests.test_modeling_common`` and ``tests.generation.test_utils`` from a
transformers checkout, and ``scripts/run_transformers_tests.py`` runs it there (see ``docs/development.md``). Each
architecture gets what a transformers model test file holds: a model tester with a tiny config and inputs, a test class
that mixes in ``ModelTesterMixin`` (and ``GenerationTesterMixin`` where a class can generate), and skips with the reason
where a test does not apply. Our classes are entered in transformers' Auto name tables under their model types, as a
model added to transformers would be, so that the mixins build labels and pick heads for them as for their own.
"""

from __future__ import annotations

import unittest

import torch
from tests.generation.test_utils import GenerationTesterMixin
from tests.test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor, random_attention_mask
from transformers.models.auto import modeling_auto
from transformers.testing_utils import torch_device

from hf_xformers.registration import REGISTRY

# The Auto classes we register and transformers' table of class names behind each.
_NAME_TABLES = {
    "AutoModel": modeling_auto.MODEL_MAPPING_NAMES,
    "AutoModelForMaskedLM": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "AutoModelForSeq2SeqLM": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    "AutoModelForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForMultipleChoice": modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
    "AutoModelForQuestionAnswering": modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    "AutoModelForTokenClassification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForImageClassification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForMaskedImageModeling": modeling_auto.MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES,
    "AutoBackbone": modeling_auto.MODEL_FOR_BACKBONE_MAPPING_NAMES,
}
for _model_type, (_, _heads) in REGISTRY.items():
    for _task, _cls in _heads.items():
        if _task in _NAME_TABLES:
            _NAME_TABLES[_task].setdefault(_model_type, _cls.__name__)

VOCAB = 99


def classes(model_type: str, *tasks: str) -> tuple:
    """The registered model classes of ``model_type`` (those of ``tasks`` only, when given)."""
    heads = REGISTRY[model_type][1]
    return tuple(cls for task, cls in heads.items() if task != "AutoImageProcessor" and (not tasks or task in tasks))


class TextModelTester:
    """Tiny config and inputs of one text architecture, in the shape of transformers' model testers."""

    def __init__(self, parent, model_type: str, config_kwargs: dict, seq_length: int, batch_size: int = 3):
        self.parent = parent
        self.config_class = REGISTRY[model_type][0]
        self.config_kwargs = config_kwargs
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = True
        self.vocab_size = VOCAB
        self.num_labels = 3
        self.num_choices = 2
        self.type_sequence_label_size = 3
        config = self.get_config()
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.num_attention_heads = config.num_attention_heads

    def get_config(self):
        return self.config_class(vocab_size=VOCAB, num_labels=self.num_labels, **self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        # Ids 0-4 are the special tokens (pad = 1): real tokens come from above them.
        input_ids = ids_tensor([self.batch_size, self.seq_length], VOCAB - 5) + 5
        # A separator (id 2) mid-row and at the end, as a tokenizer encodes a text pair: Longformer's question
        # answering and multiple choice heads put global attention on the tokens before the first one.
        input_ids[:, self.seq_length // 2] = 2
        input_ids[:, -1] = 2
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class LongformerModelTester(TextModelTester):
    """As transformers' Longformer tester: one explicit global token (the last) in every input, so that every head has
    the same attention layout, ``(batch, heads, seq, 1 + window + 1)``: the global key, then the band."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_length = self.get_config().attention_window + 2

    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        global_attention_mask = torch.zeros_like(inputs["input_ids"])
        global_attention_mask[:, -1] = 1
        inputs["global_attention_mask"] = global_attention_mask
        # The global token is a real token: random_attention_mask keeps only the first one, and a padded token never
        # attends globally (as in transformers' Longformer), so with the last token padded in all 3 rows (1 draw in
        # 8) no row had a global key and the attentions were a column narrower than key_length.
        inputs["attention_mask"][:, -1] = 1
        return config, inputs


class LinformerModelTester(TextModelTester):
    """Linformer's keys and values are projected to ``linformer_k`` rows: its attentions are ``(batch, heads, seq, k)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_length = self.get_config().linformer_k


class Seq2SeqModelTester(TextModelTester):
    """Encoder and decoder inputs for an encoder-decoder head."""

    def get_config(self):
        return self.config_class(
            vocab_size=VOCAB, num_labels=self.num_labels, is_encoder_decoder=True, **self.config_kwargs
        )

    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], VOCAB - 5) + 5
        inputs.update(
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_input_ids.new_ones(decoder_input_ids.shape),
        )
        return config, inputs


class SwinModelTester:
    """Tiny Swin (two stages) and images."""

    def __init__(self, parent, config_kwargs: dict, batch_size: int = 3):
        self.parent = parent
        self.config_class = REGISTRY["hfx-swin"][0]
        self.config_kwargs = config_kwargs
        self.batch_size = batch_size
        self.is_training = True
        self.num_labels = 3
        self.type_sequence_label_size = 3
        self.num_channels = 3
        self.image_size = config_kwargs["image_size"]
        self.patch_size = config_kwargs["patch_size"]
        config = self.get_config()
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.seq_length = (self.image_size // self.patch_size) ** 2
        # Masked image modelling masks this many patches in the common tests' inputs (forward takes bool_masked_pos).
        self.num_masks = self.seq_length // 2

    def get_config(self):
        return self.config_class(num_labels=self.num_labels, **self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        return self.get_config(), {"pixel_values": pixel_values}


class HfxTextTests(ModelTesterMixin):
    """What every text architecture's test class shares."""

    model_type: str = ""
    config_kwargs: dict = {}
    seq_length = 16
    model_tester_class = TextModelTester

    def setUp(self):
        self.model_tester = self.model_tester_class(self, self.model_type, self.config_kwargs, self.seq_length)


_TEXT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64
)


class HfxLongformerTest(HfxTextTests, unittest.TestCase):
    model_type = "hfx-longformer"
    # One window for both layers, as in transformers' tester: the common attention test expects one shape per class
    # (per-layer windows are checked by tests/test_longformer.py).
    config_kwargs = dict(_TEXT, attention_window=4, type_vocab_size=1)
    model_tester_class = LongformerModelTester
    all_model_classes = classes(model_type)


class HfxBigBirdTest(HfxTextTests, unittest.TestCase):
    model_type = "hfx-bigbird"
    config_kwargs = dict(_TEXT, block_size=4, num_random_blocks=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    seq_length = 32
    all_model_classes = classes(model_type)


class HfxLinformerTest(HfxTextTests, unittest.TestCase):
    model_type = "hfx-linformer"
    config_kwargs = dict(_TEXT, linformer_k=8, type_vocab_size=1, max_position_embeddings=18)
    model_tester_class = LinformerModelTester
    all_model_classes = classes(model_type)


class HfxPerformerTest(HfxTextTests, GenerationTesterMixin, unittest.TestCase):
    model_type = "hfx-performer"
    config_kwargs = dict(_TEXT, num_random_features=16, type_vocab_size=1)
    all_model_classes = classes(model_type)

    @unittest.skip(
        reason="(transformers 5.24) It forces use_cache=True on the encoder's config; our models refuse a decoding "
        "cache without is_decoder=True, with a ValueError naming the fix, where BERT ignores it."
    )
    def test_bc_cache_name_forward(self):
        pass


_REFORMER = dict(
    hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37, local_attn_chunk_length=4,
    lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16],
    max_position_embeddings=64, pad_token_id=1, eos_token_id=None, hash_seed=3,
)  # fmt: skip


class HfxReformerTests(HfxTextTests, GenerationTesterMixin):
    model_type = "hfx-reformer"
    # The causal LM last: it runs on a copy of the config with is_decoder=True, and test_attention_outputs goes on
    # with the previous model's config, which the bidirectional heads refuse.
    all_model_classes = tuple(sorted(classes(model_type), key=lambda cls: cls.__name__ == "HfxReformerForCausalLM"))

    @unittest.skip(
        reason="Reformer's positions count from the first slot, padding included (as in transformers' Reformer): "
        "position_ids counted over the mask are a different input."
    )
    def test_generate_with_and_without_position_ids(self):
        pass

    @unittest.skip(
        reason="Reformer's positions count from the first slot, padding included (as in transformers' Reformer), "
        "so a left-padded prompt is a different input."
    )
    def test_left_padding_compatibility(self):
        pass

    def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
        """Reformer's cache (as transformers' ``past_buckets_states``) holds per layer the normalised attention input
        ``(batch, len, hidden)`` and, for LSH layers, its buckets ``(batch, heads, rounds, len)``."""
        self.assertEqual(len(past_key_values), config.num_hidden_layers)
        for states, buckets in zip(past_key_values.states, past_key_values.buckets, strict=True):
            self.assertEqual(tuple(states.shape), (batch_size, seq_length, config.hidden_size))
            if buckets is not None:
                self.assertEqual((buckets.shape[0], buckets.shape[1], buckets.shape[-1]), (batch_size, 2, seq_length))


class HfxReformerLocalTest(HfxReformerTests, unittest.TestCase):
    config_kwargs = dict(_REFORMER, attn_layers=["local", "local"])


class HfxReformerLSHTest(HfxReformerTests, unittest.TestCase):
    config_kwargs = dict(_REFORMER, attn_layers=["lsh", "lsh"])


class HfxTransfoXLTest(HfxTextTests, GenerationTesterMixin, unittest.TestCase):
    model_type = "hfx-transfo-xl"
    # Cutoffs inside a vocabulary of 10 too: test_load_with_mismatched_shapes shrinks the vocabulary to 10, and the
    # config refuses cutoffs outside the vocabulary.
    config_kwargs = dict(cutoffs=[4, 8], d_model=32, n_head=4, d_inner=37, n_layer=2, div_val=2, mem_len=32)
    all_model_classes = classes(model_type)
    # The adaptive softmax's tail clusters get gradients only from labels that fall in them, and the common tests'
    # labels are all 0 (the head cluster).
    test_all_params_have_gradient = False
    # The adaptive input embedding is one table per vocabulary cluster (div_val > 1), not one nn.Embedding to resize.
    test_resize_embeddings = False

    @unittest.skip(reason="The adaptive input embedding is one table per vocabulary cluster, not an nn.Embedding.")
    def test_model_get_set_embeddings(self):
        pass


class HfxUniversalTest(HfxTextTests, GenerationTesterMixin, unittest.TestCase):
    model_type = "hfx-universal"
    config_kwargs = dict(_TEXT, act_max_steps=2)
    all_model_classes = tuple(c for c in classes(model_type) if c.__name__ != "HfxUniversalForSeq2SeqLM")


class HfxUniversalFixedStepsTest(HfxUniversalTest):
    """The same classes in fixed-step mode (no ACT): every position takes ``num_hidden_layers`` steps, a path of its own
    in the recurrent block and in the decoding cache."""

    config_kwargs = dict(_TEXT, use_act=False)


class HfxUniversalSeq2SeqTest(HfxTextTests, GenerationTesterMixin, unittest.TestCase):
    model_type = "hfx-universal"
    config_kwargs = dict(_TEXT, act_max_steps=2)
    model_tester_class = Seq2SeqModelTester
    is_encoder_decoder = True
    all_model_classes = classes(model_type, "AutoModelForSeq2SeqLM")

    @unittest.skip(
        reason="It counts the output's fields (5 for Seq2SeqLMOutput); ours carries three more, ACT's ponder_loss and "
        "the encoder's and decoder's ponder steps."
    )
    def test_attention_outputs(self):
        pass


class HfxUniversalSeq2SeqFixedStepsTest(HfxUniversalSeq2SeqTest):
    config_kwargs = dict(_TEXT, use_act=False)


class HfxSwinTest(ModelTesterMixin, unittest.TestCase):
    config_kwargs = dict(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, encoder_stride=4
    )
    all_model_classes = classes("hfx-swin")
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = SwinModelTester(self, self.config_kwargs)

    # transformers' Swin test file replaces the next three common tests with Swin's own: attention runs per window and
    # each stage has its own width, length and heads. tests/test_swin.py compares every stage's hidden states
    # (plain and reshaped) and attentions with transformers' Swin on the same weights.
    def _outputs(self, model_class, **flags):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        model = model_class(config).to(torch_device).eval()
        with torch.no_grad():
            return config, model(**self._prepare_for_class(inputs, model_class), **flags)

    def test_attention_outputs(self):
        for model_class in self.all_model_classes:
            config, out = self._outputs(model_class, output_attentions=True)
            window = config.window_size**2
            # One per stage (its last block's), as transformers' Swin returns them.
            self.assertEqual(len(out.attentions), len(config.depths))
            for stage, attentions in enumerate(out.attentions):
                self.assertListEqual(list(attentions.shape[-3:]), [config.num_heads[stage], window, window])

    def test_hidden_states_output(self):
        for model_class in self.all_model_classes:
            config, out = self._outputs(model_class, output_hidden_states=True)
            self.assertEqual(len(out.hidden_states), len(config.depths) + 1)
            if not hasattr(out, "reshaped_hidden_states"):
                continue  # the backbone's BackboneOutput: its feature maps are checked by the backbone tests
            side = config.image_size // config.patch_size
            for stage, (hidden, reshaped) in enumerate(zip(out.hidden_states, out.reshaped_hidden_states)):
                # Each stage but the last ends by merging 2 x 2 patches: half the side, twice the width.
                scale = 2 ** min(stage, len(config.depths) - 1)
                width = config.embed_dim * scale
                self.assertListEqual(list(hidden.shape[1:]), [(side // scale) ** 2, width])
                self.assertListEqual(list(reshaped.shape[1:]), [width, side // scale, side // scale])

    def test_model_get_set_embeddings(self):
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIsInstance(model.get_input_embeddings(), torch.nn.Module)
            output = model.get_output_embeddings()
            self.assertTrue(output is None or isinstance(output, torch.nn.Linear))
