"""The optimizer step: its decision (global norm, clip coefficient, loss scale and the dynamic
scaler, hyperparameters: ``step``, ``scaler``), the rule run over the host and device buckets
(``update``), the CPU step's threads (``threads``) and delayed parameter update, which runs step i's
CPU part while step i+1 computes (``delayed``).
"""
