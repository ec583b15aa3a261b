"""Request parsers: llm-d-router's ``requestHandler.parsers`` plugin types (one module each,
sans-IO)."""
