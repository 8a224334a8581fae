"""The OpenAI-compatible HTTP server: protocol (parsing, errors), the completion and chat
endpoints, metrics, and the app and its process (``api_server``)."""
