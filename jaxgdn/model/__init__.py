"""The Qwen3.5 text model and MTP head as pure functions over parameter pytrees, and their checkpoint I/O."""
