"""Score jobs over HTTP: files scored by the serving engine at low priority, resumed after a restart."""
