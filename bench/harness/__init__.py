"""What the maintained benchmarks share: publishing (`publish`), the machine (`machine`), inputs and
checkpoints (`data`), the offline anchor systems (`systems`), servers on loopback (`server`, `live`), load
clients (`clients`), the offline reference (`offline`), and the serving anchors (`infinity`,
`naive_server`).

The benchmarks run as scripts (`python bench/NAME.py`), so this package is found beside them; nothing here
edits sys.path. It imports only public model and service modules.
"""
