"""The update rules: what a rule is (``rule``, the one seam between the engine and a step's
arithmetic: its state's names, bytes and zeros, its hyperparameter checks, its host and device
implementations), one module per rule (``adam``, ``lion``, ``sgd``) and the registry that picks one
for a user's optimizer (``rules``). A rule knows nothing of buckets or devices; it is handed flat
arrays.
"""
