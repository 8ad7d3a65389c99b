"""What crosses between the device and the host: gradients from backward to the host shard, bucket
by bucket through a fixed ring of device buffers (``streaming``, ``ring``), handed to the step as
one step's gradients (``grads``), and the device weights the parameters view, with the push that
copies new weights up and all-gathers them (``weights``).
"""
