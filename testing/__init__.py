"""Harness for tests, validation scripts and the demo: server and Redis processes, tied
children, vLLM requests built outside an engine. Not shipped with the packages."""
