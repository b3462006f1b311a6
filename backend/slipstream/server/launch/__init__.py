"""Starting a server from outside it: locating and running ``tritonserver``, checking a model
repository before it starts, and the ``slipstream`` command line."""
