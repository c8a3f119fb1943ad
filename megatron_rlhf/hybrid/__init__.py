"""Hybrid engine: the actor trains in one layout and generates in another, in the same ranks; the
reference follows the actor (in its own layout) when ``reference.update`` says so.

Import the submodules directly; this package imports nothing, so that ``hybrid.config`` (read by a
config's checks) does not import the engine and megatron-core with it.
"""
