"""HTTP: routes, schemas, dependencies and the one error map. It reaches the runtime only through the
engine (`service.runtime.engine`)."""
