"""Everything that compiles, in one place: attnkit's C++ kernels (``*.cpp``, ``*.h``), their
build ([`build`][attnkit.kernels.build]) and loader ([`loader`][attnkit.kernels.loader]), the
CPU probe that picks a build ([`cpu`][attnkit.kernels.cpu]), and the Python faces of the small
kernels other layers call: the finite-values check ([`finite`][attnkit.kernels.finite]) and the
projections' matrix-vector product ([`gemv`][attnkit.kernels.gemv]).

Nothing here decides which backend runs; the backends and the tiled algorithm load a kernel at the
first call that runs it.
"""
