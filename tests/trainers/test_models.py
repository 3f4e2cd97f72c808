import math
import subprocess
import sys

import pytest
import torch

from trainers.models import (
    MODEL_CONFIGS,
    DecoderLM,
    count_parameters,
    get_model_config,
)

SMALL_STYLES = ["tiny", "tiny-qwen"]


def build_model(name: str) -> DecoderLM:
    return DecoderLM(get_model_config(name))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_published_opt_parameter_counts():
    assert count_parameters(get_model_config("opt-125m")) == 125_239_296
    assert count_parameters(get_model_config("opt-1.3b")) == 1_315_758_080


@pytest.mark.parametrize("name", ["tiny", "small", "tiny-qwen"])
def test_count_parameters_matches_built_model(name):
    assert count_parameters(get_model_config(name)) == n_params(build_model(name))


def test_count_parameters_matches_meta_model_for_large_configs():
    for name in ("opt-125m", "opt-1.3b"):
        cfg = get_model_config(name)
        with torch.device("meta"):
            assert n_params(DecoderLM(cfg)) == count_parameters(cfg)


def test_qwen_107b_shape_is_about_107b():
    assert 100e9 < count_parameters(get_model_config("qwen1.5-107b")) < 115e9


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'gpt-5'") as err:
        get_model_config("gpt-5")
    assert all(name in str(err.value) for name in MODEL_CONFIGS)


def test_same_seed_same_weights_different_seed_different():
    def weights(seed):
        torch.manual_seed(seed)
        return build_model("tiny").state_dict()

    a, b, c = weights(0), weights(0), weights(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.tokens.weight"], c["embed.tokens.weight"])


@pytest.mark.parametrize("name", SMALL_STYLES)
def test_forward_shapes_and_initial_loss(name):
    torch.manual_seed(0)
    model = build_model(name)
    idx = torch.randint(0, 256, (2, 32))
    assert model(idx).shape == (2, 32, 256)
    loss = model(idx, torch.randint(0, 256, (2, 32)))
    assert loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.3


@pytest.mark.parametrize("name", SMALL_STYLES)
def test_embed_blocks_head_compose_to_the_model(name):
    torch.manual_seed(0)
    model = build_model(name).eval()
    idx = torch.randint(0, 256, (2, 16))
    # Cut as a two-stage pipeline would: [embed, blocks[:2]] then [blocks[2:], head].
    hidden = model.embed(idx)
    for block in model.blocks[:2]:
        hidden = block(hidden)
    for block in model.blocks[2:]:
        hidden = block(hidden)
    assert torch.equal(model.head(hidden), model(idx))


@pytest.mark.parametrize("name", SMALL_STYLES)
def test_causal(name):
    torch.manual_seed(0)
    model = build_model(name).eval()
    idx = torch.randint(0, 256, (1, 24))
    changed = idx.clone()
    changed[0, 15] = (idx[0, 15] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model("tiny")(torch.zeros(1, 129, dtype=torch.long))


def test_opt_125m_ties_head_to_token_embedding():
    with torch.device("meta"):
        model = DecoderLM(get_model_config("opt-125m"))
    assert model.head.proj.weight is model.embed.tokens.weight
    untied = build_model("tiny")
    assert untied.head.proj.weight is not untied.embed.tokens.weight


@pytest.mark.parametrize("name", SMALL_STYLES)
def test_a_few_adamw_steps_reduce_the_loss(name):
    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (4, 33))
    x, y = idx[:, :-1], idx[:, 1:]
    first = model(x, y).item()
    for _ in range(10):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(x, y).item() < first - 0.5


def test_a_worker_and_the_shapes_of_every_model_start_without_torch_dynamo():
    # torch._dynamo takes seconds to import; a one-stage worker never uses it, and neither do the meta-device shapes
    # the harness validates every run with (torch's meta normal_ would import it: models._NoNormalInit).
    code = (
        "import sys, harness.run.worker\n"
        "from trainers.models import MODEL_CONFIGS, parameter_shapes\n"
        "for cfg in MODEL_CONFIGS.values(): parameter_shapes(cfg)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr


def test_a_transformers_config_without_transformers_is_refused_naming_the_extra(tmp_path, monkeypatch):
    """It ended in an ImportError traceback."""
    from trainers.hf_models import load_config

    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets where it is absent
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_positions": 128}')
    with pytest.raises(ValueError, match=r"transformers is not installed; install the harness's hf extra"):
        load_config(str(tmp_path))
