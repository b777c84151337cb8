"""The asynchronous engine front and the OpenAI-compatible server (`python -m jaxgdn.serve`)."""
