"""The tiled algorithm (FlashAttention-2's online softmax, block by block, with a recomputing
backward in O(N) memory): its plan ([`plans`][attnkit.tiled.plans]), its autograd function
([`autograd`][attnkit.tiled.autograd]), the readable PyTorch loop ([`loop`][attnkit.tiled.loop])
and the binding of its C++ kernel ([`native`][attnkit.tiled.native]). The tiled backend
([`attnkit.backends.tiled`][attnkit.backends.tiled]) and ring attention's passes run it.
"""
