"""Attacks on the store, the loader, the node agent and the CLI, one test per attack (issue 31):
a hostile tenant and a careless operator, each named in its test's name."""
