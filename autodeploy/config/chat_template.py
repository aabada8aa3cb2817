"""``chat_template``: a Jinja chat template given in place of the tokenizer's own (vLLM's
``--chat-template``), as its text or as the path of a file holding it.

Checked when the configuration is made (a file that cannot be read, or text that is not a valid
template, is an error naming the setting, before minutes of building), and read again where the
tokenizer is loaded (``read_chat_template``).
"""

import os


def read_chat_template(value: str) -> str:
    """The template's text: the file ``value`` names, or ``value`` itself when it is template
    text. ``ValueError`` says what is wrong: a path that does not exist, a file that cannot be
    read, a template with a syntax error."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template file {value}: {exc}") from None
        where = f"the file {value}"
    elif "{{" in value or "{%" in value:
        text, where = value, "the template"
    else:
        raise ValueError(f"{value!r} is neither a file nor Jinja template text ('{{{{ ... }}}}' / '{{% ... %}}'); "
                         "give the path of a .jinja file or the template itself")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text
