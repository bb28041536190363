"""The tools that ride on the client and the runtime: the ``worldserve`` command (``cli``), its load
test (``loadtest``), scripted recording (``record``) and journal replay (``replay``).

Owns: nothing the layers below need; they never import from here.
Must not know: anything beyond the public faces of the client, the runtime and the server.
"""
