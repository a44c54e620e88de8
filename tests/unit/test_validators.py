"""RFC 9110's validators (``server.api.validators``) and the S3 error text filter
(``server.api.s3_xml.xml_safe``) called directly: the rules the server tests check over HTTP
(tests/server/test_s3_conformance.py), case by case and without a server."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from server.api.s3_xml import xml_safe
from server.api.validators import applicable_range, etag_matches, if_range_holds
from server.store.meta import ObjectMeta

META = ObjectMeta("b", "k", 10, "26c7827d889f6da3", 2, 1_700_000_000_123_456_789, 0, "t", ())
E = META.etag


@pytest.mark.parametrize("header,strong,weak", [
    ("*", True, True),
    (f'"{E}"', True, True),
    (E, True, True),  # unquoted, as some clients send it: taken as the quoted tag
    (f'W/"{E}"', False, True),
    (f'"x", W/"{E}"', False, True),
    (f'"x",  "{E}" ', True, True),
    ('"x"', False, False),
    ('W/"x"', False, False),
    ('"*"', False, False),  # a tag whose value is '*' is not the wildcard
    (f'"{E}-2"', False, False),
    ("", False, False),
])
def test_etag_matches(header, strong, weak):
    assert etag_matches(header, META, weak=False) is strong
    assert etag_matches(header, META, weak=True) is weak


@pytest.mark.parametrize("value,holds", [
    (f'"{E}"', True),
    (f' "{E}" ', True),
    (f'W/"{E}"', False),  # strong comparison only
    (E, False),  # not an entity tag
    ('"nope"', False),
    (META.last_modified, False),  # a date: Last-Modified is a weak validator here
    ("", False),
    (f'"{E}", "x"', False),  # one tag, not a list
])
def test_if_range(value, holds):
    assert if_range_holds(value, META) is holds
    rng = applicable_range({"Range": "bytes=0-1", "If-Range": value}, META)
    assert rng == ("bytes=0-1" if holds else None)


def test_range_without_if_range_applies_and_if_range_without_range_is_ignored():
    assert applicable_range({"Range": "bytes=0-1"}, META) == "bytes=0-1"
    assert applicable_range({"If-Range": '"nope"'}, META) is None
    assert applicable_range({}, META) is None


def test_xml_safe_makes_any_text_well_formed_xml():
    weird = "".join(map(chr, range(0x20))) + "\x7f\ud800\udfff\ufffe\uffff é<&>\U0001f600"
    safe = xml_safe("/b/" + weird)
    root = ET.Element("Resource")
    root.text = safe
    assert ET.fromstring(ET.tostring(root, encoding="utf-8")).text == safe
    assert safe.startswith("/b/%00%01%02") and "%7F%ED%A0%80%ED%BF%BF%EF%BF%BE%EF%BF%BF é<&>\U0001f600" in safe
    assert xml_safe("plain/key é") == "plain/key é"
