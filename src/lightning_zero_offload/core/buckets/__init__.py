"""This rank's share of the model's state, bucket by bucket: the layout (flat aligned buffers,
buckets in backward order, rank partitions), one record per bucket (``buckets``: its pieces, its
gradient side for each gradient set, its state shard, its place, host or device), the host arrays
and their sizing and memory checks (``host``, ``host_plan``, ``preflight``), the device part of
partial offload and its budget (``placement``, ``device_budget``, ``resident``), whole-group views
of the shard for checkpoints (``shard_view``) and the master weights' first fill (``master_fill``).
Where a bucket lives is answered here and nowhere else.
"""
