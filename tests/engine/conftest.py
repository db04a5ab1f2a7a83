"""tests/engine: every module with a test marked ``engine`` (a vLLM engine in process,
``vllm serve``, the notebooks, the demo), and only those: tests/conftest.py checks it, and
runs the ones that use the external cache in one xdist lane, one module after another, the
model plugin's alone (``PLUGIN_ENGINE_MODULES``) in the other lane after the engine-free
tests (docs/testing.md, "Two lanes" and "Folders by cost").

Fixtures every folder uses (``server`` with the module's ``SERVER_ARGS``, ``ckpt``, ``sides``,
``cluster``) are in tests/conftest.py; engines start through ``testing.engines``. None is
used by these modules alone yet."""
