"""Chapter 08's OpenAI-compatible server (`python -m minillm serve`): request bodies and
errors (`protocol`), the engine on its own thread (`async_engine`), the routes
(`api_server`). Needs fastapi and uvicorn."""
