"""tests/unit: what a developer runs while editing (``pytest tests/unit``, about a minute
with vLLM's import): pure functions and in-process objects, no server process, no Redis, no
engine, no subprocess. A test that needs any of those goes to tests/server or tests/engine
(docs/testing.md, "Folders by cost").

Fixtures every folder uses (``ckpt``, the tiny checkpoint) are in tests/conftest.py; none is
used by these modules alone yet."""
