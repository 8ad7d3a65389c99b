"""Device asynchrony: side streams, copies queued on them, events and waits (``device``, the only
module that touches ``torch.cuda`` streams and events, with its CUDA and synchronous CPU kinds),
which kind an engine gets (``device_factory``; the emulated one lives in ``testing``), and the
step's timing spans over host time and device events (``profile``).
"""
