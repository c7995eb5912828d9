"""The torch side of memfit: the one real training step (step.py) that `measure` runs on real tensors and the tracer
runs on fake ones, the bf16 master-weights optimizer (master.py) and the memory bookkeeping of measured steps.

Importing this package imports torch; the core package imports it only inside functions.
"""
