"""Constants that depend on each other, defined once (the host-memory budget imports them).

The gradient streamer hands at most :data:`MAX_IN_FLIGHT` bucket buffers to the side stream; one
more is being filled by backward, so :data:`BUCKET_BUFFERS` are alive at once. The CPU device's
pool of released buffers keeps at most that many, and the budget counts that many on the CPU.
"""

MAX_IN_FLIGHT = 2  # bucket buffers handed to the side stream and not yet released
BUCKET_BUFFERS = MAX_IN_FLIGHT + 1  # alive at once: one filling, MAX_IN_FLIGHT in flight
