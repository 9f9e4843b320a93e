import os

# Nothing may reach the Hub in tests: fail at once instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Generative tests (tests/test_packing_fuzz.py): "ci" for make test, the same draws on every run and a budget that
# keeps the file well under a minute on 2 cores; "fuzz" for make fuzz, fresh draws and twenty times the examples
# (FUZZ_EXAMPLES sets another number). HYPOTHESIS_PROFILE picks one. No example database: a failure prints its case
# (and, under the fuzz profile, the blob that replays it).
settings.register_profile("ci", max_examples=30, derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile(
    "fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "800")), deadline=None, database=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist (make test runs one worker per core) each worker gets its share of the cores: more threads would
# only oversubscribe them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _workers)))


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device for the conformance suites and the parity tests that take the `device` fixture "
        "(cpu, cuda, cuda:1, ...); CPU is the default and what CI runs",
    )


def pytest_configure(config):
    """Check ``--device`` once, before anything runs."""
    device = torch.device(config.getoption("--device"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch.cuda.is_available() is False on this machine")
        # Compare float32 against float32: no TF32 in matmuls or convolutions (cuDNN allows it by default).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is None or not getattr(module, "is_available", lambda: False)():
            raise pytest.UsageError(f"--device {device}: no available {device.type} backend in this torch build")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The ``--device`` of this run (``cpu`` by default)."""
    return torch.device(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def device_atol(device) -> float:
    """Absolute tolerance of float32 comparisons on ``device``: 1e-5 on the CPU; accelerators reorder reductions and
    pick other kernels (flash / memory-efficient attention), so 1e-4 there."""
    return 1e-5 if device.type == "cpu" else 1e-4


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
