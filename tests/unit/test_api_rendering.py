"""sluice.api.rendering: the direct writer gives byte for byte what the email package gives.

Both draw the Message-ID's and the boundary's random numbers from the
random module in the same order, so with the same seed the outputs must
be equal but for the Message-ID's time stamp; a case either refuses, the
other refuses with the same exception type.
"""

from __future__ import annotations

import random
import re
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.api import rendering
from sluice.api.inject import TemplateContent
from sluice.api.rendering import render, render_with_email_package

pytestmark = pytest.mark.unit

_MSGID = re.compile(rb"Message-ID: <\d+\.")

SENDOUT = {"from": "Shop <news@shop.example>",
           "subject": "Hello {{ first }}, your code {{ code }}",
           "text_body": "Dear {{ first }}, your code is {{ code }}.\nSee you soon.\n",
           "html_body": "<html><body><p>Dear {{ first }},</p><p>your code is <b>{{ code }}</b>.</p>"
                        "</body></html>\n",  # 79 octets a line: quoted-printable
           "headers": {"List-Unsubscribe": "<mailto:unsub@shop.example?subject={{ email }}>"}}


def both(content: dict[str, Any], values: dict[str, Any], recipient: str = "u1@d5.example",
         name: str = "", hostname: str = "mx.example") -> tuple[object, object]:
    template = TemplateContent.model_validate(content)
    out: list[object] = []
    for fn in (render, render_with_email_package):
        random.seed(17)
        try:
            data = fn(template, values, recipient, name, hostname, 1.7e9)
            out.append(_MSGID.sub(b"Message-ID: <T.", data))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            out.append(type(exc))
    return out[0], out[1]


def test_the_sendout_message_is_written_directly_and_equal() -> None:
    values = {"first": "U12345", "code": "112345", "email": "u12345@d1999.example"}
    fast, reference = both(SENDOUT, values, "u12345@d1999.example")
    assert fast == reference
    assert isinstance(fast, bytes) and b"boundary=" in fast
    assert b"Content-Transfer-Encoding: quoted-printable" in fast
    # ... and it was written here, not by the email package
    assert rendering._write("Shop <news@shop.example>", "Hello", [("List-Unsubscribe", "<x>")],
                            "Dear", "<p>" + "é" * 100, "<1.2.3@mx.example>", "Tue, 14 Nov 2023",
                            "u1@d5.example", "") is not None


@pytest.mark.parametrize(("content", "values", "recipient", "name"), [
    ({"from": "Shop <s@x.example>", "subject": "{{ s }}", "text_body": "t"},
     {"s": "Grüße"}, "u@x.example", ""),  # non-ASCII subject: encoded word
    ({"from": "Shop <s@x.example>", "subject": "x" * 90, "text_body": "t"},
     {}, "u@x.example", ""),  # folded
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "{{ t }}"},
     {"t": "Grüße"}, "u@x.example", ""),  # a part to encode
    ({"from": "Shop <s@x.example>", "subject": "s", "html_body": "{{ t }}"},
     {"t": "y" * 200}, "u@x.example", ""),  # a long line
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "t"},
     {}, "jörg@x.example", ""),  # SMTPUTF8
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "t"},
     {}, "u@x.example", "Jörg, Sr."),  # a display name
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "t",
      "headers": {"Reply-To": "a@x.example", "reply-to": "b@x.example"}},
     {}, "u@x.example", ""),  # a unique header twice: refused
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "t",
      "headers": {"Content-Language": "de"}}, {}, "u@x.example", ""),
    ({"from": "Shop <s@x.example>", "subject": "{{ s }}", "text_body": "t"},
     {"s": "a\r\nBcc: x@y.example"}, "u@x.example", ""),  # header injection: refused
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "t",
      "headers": {"X-Tag": "{{ s }}"}}, {"s": "=?utf-8?q?x?= two  spaces "}, "u@x.example", ""),
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "t",
      "headers": {"Subject": "again"}}, {}, "u@x.example", ""),  # reserved: refused
    ({"from": "Shop <s@x.example>", "subject": "s", "text_body": "{{ missing }}"},
     {}, "u@x.example", ""),  # a missing substitution: refused
])
def test_outside_the_common_case_the_email_package_decides(
        content: dict[str, Any], values: dict[str, Any], recipient: str, name: str) -> None:
    fast, reference = both(content, values, recipient, name)
    assert fast == reference


_TEXT = st.one_of(
    st.text(st.sampled_from("aZ09 <>@.,;:\"'=?-_()\t\r\nüé€\x0b\x85"), max_size=120),
    st.integers(min_value=70, max_value=85).map(lambda n: "w" * n),  # about the line limit
    st.integers(min_value=60, max_value=80).map(lambda n: "w " * (n // 2)),
    st.lists(st.text(st.sampled_from("ab <>=.é\n"), min_size=70, max_size=200),
             max_size=14).map("\n".join))  # long lines, more than 10 of them


@settings(max_examples=300, deadline=None)
@given(subject=_TEXT, header=_TEXT, text=_TEXT, html=_TEXT, name=st.sampled_from(["", "Jo Do"]),
       parts=st.sampled_from(["text", "html", "both"]))
def test_any_values_give_what_the_email_package_gives(
        subject: str, header: str, text: str, html: str, name: str, parts: str) -> None:
    content: dict[str, Any] = {"from": "Shop <s@x.example>", "subject": "{{ subject }}",
                               "headers": {"X-Note": "{{ header }}"}}
    if parts in ("text", "both"):
        content["text_body"] = "{{ text }}"
    if parts in ("html", "both"):
        content["html_body"] = "{{ html }}"
    values = {"subject": subject, "header": header, "text": text, "html": html}
    fast, reference = both(content, values, name=name)
    assert fast == reference

