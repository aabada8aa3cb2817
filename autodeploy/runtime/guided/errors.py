"""The error of a guided-decoding request the engine cannot serve (a bad regex, an unsupported JSON
Schema keyword, a tokenizer whose tokens cannot be mapped to bytes): a 400 at the server."""

from ..errors import InvalidRequestError


class GuidedDecodingError(InvalidRequestError):
    """Raised with a message naming what is wrong (the pattern position, the schema keyword) and how
    to fix it."""
