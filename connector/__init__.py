"""vLLM KV-transfer connector for glm-cache-server and the server's client."""
