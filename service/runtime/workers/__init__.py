"""The model processes: the worker that alone owns them, a replica thread per model instance, the backend
contract (thread or child process) with its typed messages, the template they are forked from, and the
model's side that answers them. Used by the engine only."""
