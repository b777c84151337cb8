"""Kernels for jaxgdn, each with a pure-JAX/numpy reference beside it. Never imports the model."""
