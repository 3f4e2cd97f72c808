"""Transformers models as the trainers see them (trainers/hf_models.py): the harness's cut computes what the
transformers model computes, stages chained give the whole model, and a config that cannot be used is refused in one
sentence before anything is built."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.trainers import hf_configs
from trainers.hf_models import HFDecoder, build, check_vocab, load_config
from trainers.models import count_parameters, get_model_config, with_vocab
from trainers.pipeline import StageModule, validate_pipeline

FAMILIES = ["opt", "qwen2", "llama", "gpt2"]


def _model(model_type: str, folder, seed: int = 0, **fields) -> HFDecoder:
    torch.manual_seed(seed)
    return build(load_config(str(hf_configs.small(model_type, folder, **fields))))


def _tokens(seed: int = 1, batch: int = 2, seq_len: int = 16) -> torch.Tensor:
    return torch.randint(0, hf_configs.VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_harness_cut_computes_the_transformers_logits(model_type, tmp_path):
    model = _model(model_type, tmp_path).eval()
    idx = _tokens()
    with torch.no_grad():
        ours = model(idx)
        theirs = model.transformers_model(input_ids=idx, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_loss_is_the_mean_next_token_cross_entropy(model_type, tmp_path):
    model = _model(model_type, tmp_path).eval()
    idx, targets = _tokens(seed=1), _tokens(seed=2)
    with torch.no_grad():
        logits = model(idx)
        loss = model(idx, targets)
    assert loss.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item(), rel=1e-6)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("untied", [False, True])
def test_count_parameters_matches_the_built_model(model_type, untied, tmp_path):
    cfg = load_config(str(hf_configs.small(model_type, tmp_path, tie_word_embeddings=not untied)))
    assert count_parameters(cfg) == sum(p.numel() for p in build(cfg).parameters())


def test_the_published_widths_have_their_parameter_counts(tmp_path):
    """OPT-125m's and Qwen2-0.5B's widths with 2 layers and a 512-token vocabulary, counted by hand: embeddings,
    then per layer attention + MLP + norms, then the final norm (and an untied head)."""
    d, ff, v = 768, 3072, hf_configs.VOCAB
    opt_layer = 4 * (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * 2 * d
    opt = v * d + (2048 + 2) * d + 2 * opt_layer + 2 * d
    assert count_parameters(load_config(str(hf_configs.opt_125m(tmp_path / "opt")))) == opt
    assert count_parameters(load_config(str(hf_configs.opt_125m(tmp_path / "opt-untied", untied=True)))) == opt + v * d
    d, ff, kv = 896, 4864, 2 * 64
    qwen_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * ff + 2 * d
    qwen = v * d + 2 * qwen_layer + d
    assert count_parameters(load_config(str(hf_configs.qwen2_05b(tmp_path / "qwen")))) == qwen


@pytest.mark.parametrize("model_type", ["opt", "qwen2"])
def test_two_stages_chained_compute_the_whole_model(model_type, tmp_path):
    model = _model(model_type, tmp_path, tie_word_embeddings=False).eval()
    validate_pipeline(model.cfg, 2, 2, 4)
    first = StageModule(model, 0, 1, first=True, last=False)
    last = StageModule(model, 1, 2, first=False, last=True)
    idx = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(last(first(idx)), model(idx), rtol=0, atol=0)
    names = {n for part in (first, last) for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_the_same_seed_builds_the_same_model(tmp_path):
    a, b = _model("qwen2", tmp_path / "a", seed=7), _model("qwen2", tmp_path / "b", seed=7)
    c = _model("qwen2", tmp_path / "c", seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))


def test_a_safetensors_checkpoint_beside_the_config_is_loaded(tmp_path):
    trained = _model("opt", tmp_path / "m", seed=3)
    trained.transformers_model.save_pretrained(tmp_path / "m")
    cfg = load_config(str(tmp_path / "m"))
    assert cfg.checkpoint == tmp_path / "m" / "model.safetensors"
    torch.manual_seed(99)  # a different seed: the weights must come from the file
    loaded = build(cfg)
    assert all(torch.equal(x, y) for x, y in zip(trained.parameters(), loaded.parameters(), strict=True))


def test_a_config_json_file_is_a_model_too(tmp_path):
    hf_configs.small("llama", tmp_path)
    cfg = get_model_config(str(tmp_path / "config.json"))
    assert (cfg.model_type, cfg.n_layers, cfg.vocab_size, cfg.checkpoint) == ("llama", 2, hf_configs.VOCAB, None)


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("facebook/opt-125m", ["is neither a built-in model nor a local path", "never downloads"]),
        ("{tmp}", ["has no config.json", "save the transformers config into it"]),
        ("{tmp}/bad.json", ["is not readable JSON", "fix or replace it"]),
        ("{tmp}/untyped.json", ["has no model_type", "config.save_pretrained"]),
        ("{tmp}/unknown.json", ["has model_type 'nosuch', which transformers", "such as llama, qwen2"]),
    ],
)
def test_an_unusable_config_is_refused_in_one_sentence(name, fragments, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "untyped.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "unknown.json").write_text(json.dumps({"model_type": "nosuch", "hidden_size": 64}))
    with pytest.raises(ValueError) as err:
        get_model_config(name.replace("{tmp}", str(tmp_path)))
    assert all(f in str(err.value) for f in fragments), str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_the_tokenizer_must_fit_the_models_vocabulary(tmp_path):
    cfg = load_config(str(hf_configs.small("qwen2", tmp_path)))
    assert with_vocab(cfg, hf_configs.VOCAB) is cfg  # a transformers model keeps its vocabulary
    with pytest.raises(ValueError, match=r"the tokenizer has 1024 tokens but model .* embeds 512"):
        check_vocab(cfg, 1024)


def test_stages_refuse_an_architecture_they_cannot_cut_and_a_tied_head(tmp_path):
    with pytest.raises(ValueError, match="is a gpt2 model, and pipeline stages cut only opt, llama"):
        validate_pipeline(load_config(str(hf_configs.small("gpt2", tmp_path / "g"))), 2, 2, 4)
    with pytest.raises(ValueError, match="ties its lm head to the token embedding"):
        validate_pipeline(load_config(str(hf_configs.small("opt", tmp_path / "o"))), 2, 2, 4)
    validate_pipeline(load_config(str(hf_configs.small("gpt2", tmp_path / "g"))), 1, 1, 4)
