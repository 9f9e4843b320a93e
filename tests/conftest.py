import os

# Nothing may reach the Hub in tests: fail at once instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def longformer_dir(tmp_path_factory):
    """A tiny hfx-longformer base model (128 tokens, window 8, no dropout) and its byte-level BPE tokenizer: the model
    the example-script and model-card tests fine-tune."""
    import hf_xformers
    from tests.tiny_tokenizers import roberta_tokenizer

    path = tmp_path_factory.mktemp("hfx_longformer")
    tokenizer = roberta_tokenizer()
    torch.manual_seed(0)
    config = hf_xformers.HfxLongformerConfig(
        vocab_size=len(tokenizer), attention_window=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=130, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf_xformers.HfxLongformerModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
