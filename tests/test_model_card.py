"""Model cards (hf_xformers.card): templates for all eight architectures, metadata and model-index that parse with
``huggingface_hub.ModelCard`` offline, ``base_model`` of converted models, and the card every example script leaves in
its ``--output_dir`` (with ``--self_contained`` and ``--push_to_hub``, the upload mocked). Nothing reaches the network.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import LongformerConfig, LongformerForMaskedLM, RobertaConfig, RobertaForMaskedLM, TrainingArguments

import hf_xformers
from examples import run_clm, run_glue, run_image_classification, run_mlm, run_wikihop, utils_examples
from hf_xformers import card
from hf_xformers.card import CARD_DATA_FILE, build_model_card, save_card_data, template_path, write_model_card
from hf_xformers.conversion.convert_from_transformers import convert_from_transformers
from hf_xformers.conversion.convert_roberta_to_long import convert_roberta_to_long
from hf_xformers.export import export_for_hub, exported_modules
from hf_xformers.registration import REGISTRY
from tests.tiny_tokenizers import SENTENCES, roberta_tokenizer

WIKIHOP = Path(__file__).resolve().parent / "fixtures" / "wikihop"

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=130, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
TRAIN = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
         "--logging_steps", "1", "--save_strategy", "no", "--seed", "0", "--use_cpu", "--report_to", "none",
         "--disable_tqdm", "true"]  # fmt: skip


def parse(folder: Path) -> ModelCard:
    """The folder's README.md, parsed as the Hub does (bad YAML or a broken model-index raise here)."""
    return ModelCard((folder / "README.md").read_text(encoding="utf-8"))


def index_entries(model_card: ModelCard) -> list[tuple]:
    return [(r.task_type, r.dataset_split, r.metric_type, r.metric_value) for r in model_card.data.eval_results or []]


def headings_outside_code(text: str) -> list[str]:
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            found.append(line)
    return found


# ----- templates --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_every_architecture_has_a_template_with_metadata(model_type):
    template = ModelCard(template_path(model_type).read_text(encoding="utf-8"))
    assert template.data.library_name == "transformers"
    assert {"hf-xformers", model_type} <= set(template.data.tags)
    assert template.data.license and template.data.pipeline_tag
    assert len(template.text) > 1000 and f"# {model_type}" in template.text


def test_unknown_model_types_and_folders_without_config_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not an hf_xformers architecture"):
        template_path("roberta")
    with pytest.raises(ValueError, match="no config.json"):
        write_model_card(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="'bert' is not an hf_xformers architecture"):
        write_model_card(tmp_path)
    with pytest.raises(SystemExit):
        card.main(["--source", str(tmp_path / "missing")])


# ----- a checkpoint folder ----------------------------------------------------------------------------------------


def test_card_metadata_model_index_and_sections(tmp_path):
    torch.manual_seed(0)
    config = hf_xformers.HfxLongformerConfig(vocab_size=50, attention_window=4, num_labels=3, **TINY_TEXT)
    hf_xformers.HfxLongformerForSequenceClassification(config).save_pretrained(tmp_path / "mnli")
    folder = tmp_path / "mnli"
    results = {"eval_accuracy": 0.75, "eval_loss": 0.61234567, "eval_runtime": 1.2, "eval_samples": 8,
               "eval_samples_per_second": 6.6, "epoch": 1.0, "eval_mismatched_accuracy": 0.7,
               "eval_mismatched_samples": 5}  # fmt: skip
    (folder / "eval_results.json").write_text(json.dumps(results))
    (folder / "train_results.json").write_text('{"train_loss": 1.0986}')
    save_card_data(folder, base_model="FacebookAI/roberta-base", datasets=["nyu-mll/glue"], dataset_name="GLUE MNLI",
                   dataset_type="nyu-mll/glue", dataset_config="mnli", task_type="text-classification",
                   eval_splits={"eval": "validation_matched", "eval_mismatched": "validation_mismatched"},
                   hyperparameters={"learning_rate": 3e-5, "seed": 0}, license=None)  # fmt: skip
    assert "license" not in json.loads((folder / CARD_DATA_FILE).read_text())  # None values are not recorded

    assert write_model_card(folder) == folder / "README.md"
    parsed = parse(folder)
    data = parsed.data
    assert data.library_name == "transformers" and data.license == "apache-2.0"
    assert data.tags[:2] == ["hf-xformers", "hfx-longformer"] and "custom_code" not in data.tags
    assert data.pipeline_tag == "text-classification"
    assert data.base_model == "FacebookAI/roberta-base" and data.datasets == ["nyu-mll/glue"]
    assert data.metrics == ["accuracy", "loss"]
    assert data.model_name == "mnli"
    # The model-index round-trips: one result per quality metric of eval_results.json, with its split.
    assert sorted(index_entries(parsed)) == [
        ("text-classification", "validation_matched", "accuracy", 0.75),
        ("text-classification", "validation_matched", "loss", 0.6123),
        ("text-classification", "validation_mismatched", "accuracy", 0.7),
    ]
    assert ModelCard(str(parsed)).data.eval_results == data.eval_results
    # Sections: loading, the architecture's text (headings one level down, code blocks untouched), training, results.
    text = parsed.text
    assert text.index("## How to load") < text.index("## hfx-longformer") < text.index("## Training procedure")
    assert text.index("## Training procedure") < text.index("## Evaluation results")
    assert "Longformer architecture (Beltagy" in text and "trust_remote_code" not in text
    assert [h for h in headings_outside_code(text) if h.startswith("# ")] == ["# mnli"]
    template_code = re.findall(r"```.*?```", template_path("hfx-longformer").read_text(), flags=re.S)
    assert all(block in text for block in template_code)
    assert "| learning_rate | 3e-05 |" in text and "Final training loss: 1.0986" in text
    assert "| eval_mismatched_accuracy | validation_mismatched | 0.7 |" in text
    assert "eval_runtime" not in text and "`eval_samples`: 8" in text

    # Self-contained: the card says so (tag and the trust_remote_code snippet).
    export_for_hub(folder, folder)
    write_model_card(folder)
    assert "custom_code" in parse(folder).data.tags
    assert 'AutoModelForSequenceClassification.from_pretrained("mnli", trust_remote_code=True)' in parse(folder).text


def test_card_without_results_or_training_and_the_command_line(tmp_path, capsys):
    swin = hf_xformers.HfxSwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                     window_size=4)  # fmt: skip
    hf_xformers.HfxSwinBackbone(swin).save_pretrained(tmp_path / "backbone")
    card.main(["--source", str(tmp_path / "backbone"), "--base_model", "microsoft/swin-tiny-patch4-window7-224",
               "--dataset", "imagenet-1k", "--license", "mit", "--model_name", "tiny-swin"])  # fmt: skip
    assert "Wrote" in capsys.readouterr().out
    parsed = parse(tmp_path / "backbone")
    assert parsed.data.pipeline_tag == "image-feature-extraction"
    assert parsed.data.base_model == "microsoft/swin-tiny-patch4-window7-224"
    assert parsed.data.license == "mit" and parsed.data.datasets == ["imagenet-1k"]
    assert parsed.data.eval_results is None and parsed.data.model_name == "tiny-swin"
    assert "No training run is recorded" in parsed.text and "No evaluation results" in parsed.text
    assert "AutoBackbone" in parsed.text


def test_hub_model_id():
    assert card.hub_model_id("FacebookAI/roberta-base") == "FacebookAI/roberta-base"
    assert card.hub_model_id("roberta-base") == "roberta-base"
    assert card.hub_model_id(None) is None
    assert card.hub_model_id("not a/valid/id") is None


# ----- converted checkpoints name their base model ----------------------------------------------------------------


def test_converted_model_card_names_its_base_model(tmp_path):
    """A RoBERTa from the Hub cache converts into a long model whose card names the Hub id; an explicit base_model
    wins; a plain local folder gives no base_model (its name is no Hub id) but is named in the text."""
    tokenizer = roberta_tokenizer()
    roberta = RobertaForMaskedLM(RobertaConfig(vocab_size=len(tokenizer), type_vocab_size=1, **TINY_TEXT))
    cached = tmp_path / "hub" / "models--FacebookAI--roberta-base" / "snapshots" / "0123abcd"
    for folder in (cached, tmp_path / "my-roberta"):
        roberta.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    convert_roberta_to_long(cached, "longformer", max_length=256, attention_window=4, output_dir=tmp_path / "long")
    parsed = parse(tmp_path / "long")
    assert parsed.data.base_model == "FacebookAI/roberta-base"
    assert parsed.data.tags[:2] == ["hf-xformers", "hfx-longformer"] and parsed.data.pipeline_tag == "fill-mask"
    assert "Converted from [`FacebookAI/roberta-base`]" in parsed.text and "`hfx-convert`" in parsed.text

    convert_roberta_to_long(cached, "linformer", max_length=256, output_dir=tmp_path / "lin", base_model="me/roberta")
    assert parse(tmp_path / "lin").data.base_model == "me/roberta"

    convert_roberta_to_long(tmp_path / "my-roberta", "longformer", max_length=256, attention_window=4,
                            output_dir=tmp_path / "local")  # fmt: skip
    local = parse(tmp_path / "local")
    assert local.data.base_model is None and "the local checkpoint `my-roberta`" in local.text

    reference = LongformerForMaskedLM(LongformerConfig(vocab_size=60, attention_window=4, **TINY_TEXT))
    reference.save_pretrained(tmp_path / "allenai")
    convert_from_transformers(tmp_path / "allenai", tmp_path / "imported", base_model="allenai/longformer-base-4096")
    assert parse(tmp_path / "imported").data.base_model == "allenai/longformer-base-4096"
    # A run fine-tuned from the converted folder inherits the Hub id it recorded.
    assert card.hub_model_id(tmp_path / "long") == "FacebookAI/roberta-base"


# ----- every example script leaves an upload-ready output_dir -----------------------------------------------------


def check_example_card(out: Path, pipeline_tag: str, model_type: str) -> ModelCard:
    """The card parses, its model-index holds exactly the quality metrics of eval_results.json, and the training
    hyperparameters are stated."""
    parsed = parse(out)
    assert parsed.data.library_name == "transformers" and parsed.data.pipeline_tag == pipeline_tag
    assert {"hf-xformers", model_type} <= set(parsed.data.tags)
    results = json.loads((out / "eval_results.json").read_text())
    expected = {key.removeprefix("eval_") for key in results if not key.endswith(card.BOOKKEEPING_SUFFIXES)}
    assert {r.metric_type for r in parsed.data.eval_results} == expected
    for entry in parsed.data.eval_results:
        assert entry.metric_value == round(results[f"eval_{entry.metric_type}"], 4)
    assert "| learning_rate |" in parsed.text and "## Evaluation results" in parsed.text
    return parsed


def test_run_glue_card_self_contained(longformer_dir, tmp_path):
    rows = [{"sentence": SENTENCES[i % len(SENTENCES)], "label": i % 2} for i in range(8)]
    data = tmp_path / "train.csv"
    with open(data, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sentence", "label"])
        writer.writeheader()
        writer.writerows(rows)
    out = tmp_path / "sst2"
    run_glue.main(["--model_name_or_path", str(longformer_dir), "--output_dir", str(out), "--task_name", "sst2",
                   "--train_file", str(data), "--validation_file", str(data), "--do_train", "--do_eval",
                   "--max_seq_length", "32", "--cache_dir", str(tmp_path / "cache"), "--self_contained", *TRAIN])  # fmt: skip
    parsed = check_example_card(out, "text-classification", "hfx-longformer")
    assert parsed.data.base_model is None  # fine-tuned from a local folder with no Hub id recorded
    assert "custom_code" in parsed.data.tags and "GLUE SST2" in parsed.text
    assert {e.dataset_name for e in parsed.data.eval_results} == {"GLUE SST2"}
    assert "modeling_longformer.py" in exported_modules(out)
    assert "AutoModelForSequenceClassification" in json.loads((out / "config.json").read_text())["auto_map"]


def test_run_wikihop_card(longformer_dir, tmp_path):
    out = tmp_path / "wikihop"
    run_wikihop.main(["--model_name_or_path", str(longformer_dir), "--output_dir", str(out), "--do_train",
                      "--do_eval", "--train_file", str(WIKIHOP / "train.json"), "--validation_file",
                      str(WIKIHOP / "dev.json"), "--cache_dir", str(tmp_path / "cache"), *TRAIN])  # fmt: skip
    parsed = check_example_card(out, "feature-extraction", "hfx-longformer")
    assert {e.task_type for e in parsed.data.eval_results} == {"multiple-choice"}
    assert run_wikihop.HEAD_FILE in parsed.text and "| max_seq_length |" in parsed.text
    assert exported_modules(out) == []  # without --self_contained, no code


def test_run_image_classification_card(tmp_path):
    out = tmp_path / "digits"
    tiny = {"embed_dim": 16, "depths": [2, 2], "num_heads": [2, 4], "window_size": 4, "drop_path_rate": 0.0}
    run_image_classification.main(["--output_dir", str(out), "--max_train_samples", "16", "--max_eval_samples", "8",
                                   "--image_size", "32", "--config_overrides", json.dumps(tiny), "--do_train",
                                   "--do_eval", "--self_contained", *TRAIN])  # fmt: skip
    parsed = check_example_card(out, "image-classification", "hfx-swin")
    assert "load_digits" in parsed.text and "| crop_scale_min |" in parsed.text and "custom_code" in parsed.data.tags
    assert "image_processing_swin.py" in exported_modules(out)


def test_run_clm_card(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("\n".join(SENTENCES * 4), encoding="utf-8")
    out = tmp_path / "clm"
    run_clm.main(["--train_file", str(text), "--output_dir", str(out), "--d_model", "16", "--n_layer", "2",
                  "--n_head", "2", "--d_inner", "32", "--mem_len", "8", "--segment_length", "8", "--self_contained",
                  *TRAIN])  # fmt: skip
    parsed = check_example_card(out, "text-generation", "hfx-transfo-xl")
    assert {e.metric_type for e in parsed.data.eval_results} == {"bpc", "loss"}
    assert "vocab.json" in parsed.text and "| segment_length | 8 |" in parsed.text
    assert "modeling_transfo_xl.py" in exported_modules(out)


def test_run_mlm_card(longformer_dir, tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("\n".join(" ".join(SENTENCES * 3) for _ in range(12)), encoding="utf-8")
    out = tmp_path / "mlm"
    run_mlm.main(["--model_name_or_path", str(longformer_dir), "--train_file", str(text), "--output_dir", str(out),
                  "--max_seq_length", "64", "--eval_bucket_size", "32", "--self_contained", *TRAIN])  # fmt: skip
    parsed = check_example_card(out, "fill-mask", "hfx-longformer")
    metrics = {e.metric_type for e in parsed.data.eval_results}
    assert {"mlm_loss", "bits_per_token", "bpc", "loss_0_31", "loss_32_63"} <= metrics
    assert "| block_size | 64 |" in parsed.text and "| mlm_probability | 0.15 |" in parsed.text
    assert "modeling_longformer.py" in exported_modules(out)
    assert "AutoModelForMaskedLM" in json.loads((out / "config.json").read_text())["auto_map"]


def test_push_to_hub_uploads_the_finished_folder(longformer_dir, tmp_path, monkeypatch):
    """With --push_to_hub the folder is uploaded after the card and the code are written (upload mocked)."""
    out = tmp_path / "run"
    model = hf_xformers.HfxLongformerForSequenceClassification.from_pretrained(longformer_dir, num_labels=2)
    model.save_pretrained(out)
    (out / "eval_results.json").write_text('{"eval_accuracy": 0.5}')
    uploads = []

    def upload_folder(**kwargs):
        uploads.append({**kwargs, "files": sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())})

    monkeypatch.setattr(utils_examples, "upload_folder", upload_folder)
    args = TrainingArguments(output_dir=str(out), push_to_hub=True, hub_model_id="me/tiny-longformer", use_cpu=True)
    trainer = SimpleNamespace(args=args, hub_model_id="me/tiny-longformer", is_world_process_zero=lambda: True)
    hub = utils_examples.HubArguments(self_contained=True)
    utils_examples.finish_output_dir(trainer, hub, trained=True, task_type="text-classification")
    assert len(uploads) == 1 and uploads[0]["repo_id"] == "me/tiny-longformer"
    assert Path(uploads[0]["folder_path"]) == out and "checkpoint-*" in uploads[0]["ignore_patterns"]
    assert {"README.md", "config.json", "model.safetensors", "modeling_longformer.py"} <= set(uploads[0]["files"])
    assert parse(out).data.eval_results[0].metric_value == 0.5

    # Not the main process: nothing written, nothing uploaded.
    (out / "README.md").unlink()
    trainer.is_world_process_zero = lambda: False
    utils_examples.finish_output_dir(trainer, hub, trained=True)
    assert not (out / "README.md").exists() and len(uploads) == 1


def test_build_model_card_overrides(tmp_path):
    hf_xformers.HfxPerformerForCausalLM(hf_xformers.HfxPerformerConfig(vocab_size=40, **TINY_TEXT)).save_pretrained(
        tmp_path / "perf"
    )
    built = build_model_card(tmp_path / "perf", {"pipeline_tag": "text-generation", "tags": ["demo"], "language": "de"})
    assert built.data.pipeline_tag == "text-generation" and "demo" in built.data.tags and built.data.language == "de"
    assert not (tmp_path / "perf" / "README.md").exists()  # build only; write_model_card saves
