"""Guided (structured) decoding: output constrained to a regular expression, a JSON Schema, a JSON object
or one of a list of strings."""
