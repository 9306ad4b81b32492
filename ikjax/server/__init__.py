"""`ikjax serve`'s HTTP layer: the aiohttp app (`app`), request parsing and OpenAI-style errors
(`openai`), the bridge from the scheduler's thread to the event loop (`jobs`), Prometheus metrics
(`metrics`). It sits beside ikjax.tools, under the CLI and over the runtime (its scheduler)."""
