"""The runtime below HTTP: the engine, the batcher that alone owns the queue, the worker and its model
processes behind the backend contract, and the process layout resolved once at start."""
