"""Chapter 08's OpenAI-compatible server (`python -m minillm serve`): the app and `serve`
(`api_server`), the routes (`routes`), request bodies and error JSON (`protocol`), every
check before the engine (`validation`, `calls`), answers whole or streamed (`responses`,
`formatting`), OpenAI-shaped errors and the body limit (`errors`), metrics (`metrics`), the
engine on its own thread (`async_engine`). Needs fastapi and uvicorn."""
