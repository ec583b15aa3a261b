"""The whole stack composed: the picker, a real Envoy and simulated model servers under one nursery.

``gateway`` (``evergreen-trio gateway``) and ``demo`` (``make demo``: the stack, then the spec's
two-turn Evergreen example through it). The only modules that import several protocol packages.
"""
