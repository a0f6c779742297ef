"""Top-k sparse attention (DeepSeek's DSA): each query attends to the ``n`` keys its indices
name, in ``O(t * n * d)`` time and memory, never a ``(t, s)`` tensor. The selection's rules
([`visible`][attnkit.sparse.gather.visible]) and the PyTorch form that gathers the selected keys
a block of queries at a time ([`gather`][attnkit.sparse.gather]: any device, ``torch.compile``,
float64), and the C++ kernel's binding with its autograd function
([`native`][attnkit.sparse.native]). The sparse backend
([`attnkit.backends.sparse`][attnkit.backends.sparse]) runs them.
"""
