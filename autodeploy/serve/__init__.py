"""OpenAI-compatible HTTP serving: ``autodeploy serve`` and ``create_app``."""
