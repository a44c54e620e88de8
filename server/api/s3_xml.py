"""S3 wire format: XML documents (namespace 2006-03-01), timestamps, and S3 error codes.

Documents are built with ElementTree, never by string formatting, so keys holding ``&``,
``<`` or non-ASCII characters are escaped correctly. Keys are valid XML 1.0 text because
object names never contain control characters (``batchfs.wire.names.check_objname``). An
error document also names what the client sent (its path, in ``<Resource>``), which may hold
anything: there each character XML 1.0 cannot carry (controls, lone surrogates) is written
percent-encoded (``xml_safe``), so every error body parses and SDKs read its code.

Errors: S3 handlers raise ``S3Error`` (or any ``server.errors`` exception); the S3 route
wrapper records the S3 code in the request under ``CODE_KEY`` and the app's one error
boundary calls ``error_response``, which renders ``<Error><Code>…</Code><Message>…``
(no body for HEAD, as S3 does).
"""

from __future__ import annotations

import re
import secrets
import time
import xml.etree.ElementTree as ET
from urllib.parse import quote

from aiohttp import web

from server.errors import StoreError
from batchfs.wire.units import is_decimal

NS = "http://s3.amazonaws.com/doc/2006-03-01/"
CODE_KEY = "batchfs.s3.code"  # request key: the S3 error code of a failed request
REGION = "us-east-1"  # what GetBucketLocation and HeadBucket report; any region signs
OWNER_ID = "batchfs"


class S3Error(StoreError):
    """An error with its S3 code (``NoSuchKey``, ``SignatureDoesNotMatch`` …) and status."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code


# Codes for errors that did not name one (router errors, server.errors exceptions).
_DEFAULT_CODES = {400: "InvalidArgument", 403: "AccessDenied", 404: "NoSuchKey", 405: "MethodNotAllowed",
                  409: "BucketAlreadyOwnedByYou", 411: "MissingContentLength", 413: "EntityTooLarge",
                  416: "InvalidRange", 429: "SlowDown", 501: "NotImplemented", 503: "SlowDown"}


def default_code(status: int) -> str:
    return _DEFAULT_CODES.get(status, "InternalError" if status >= 500 else "InvalidRequest")


def iso8601(ns: int) -> str:
    """S3's timestamp format in listings: 2024-01-31T12:00:00.000Z."""
    secs, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{frac // 1_000_000:03d}Z"


def url_encode(text: str) -> str:
    """``encoding-type=url``: what botocore undoes with unquote_plus ('+' must be %2B)."""
    return quote(text, safe="/")


def element(tag: str, *children: ET.Element, text: str | None = None) -> ET.Element:
    e = ET.Element(tag)
    e.extend(children)
    e.text = text
    return e


def leaf(parent: ET.Element, tag: str, text: str | int | bool) -> None:
    if isinstance(text, bool):
        text = "true" if text else "false"
    ET.SubElement(parent, tag).text = str(text)


def xml_response(root: ET.Element, status: int = 200, headers: dict | None = None) -> web.Response:
    root.set("xmlns", NS)
    body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return web.Response(status=status, body=body, headers=headers,
                        content_type="application/xml", charset="utf-8")


# what XML 1.0 cannot carry (its Char production), and C0/DEL controls it could but a parser
# would change (CR) or a reader would not see: written percent-encoded in error documents
_NOT_XML_TEXT = re.compile("[\x00-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """``text`` with each character ``_NOT_XML_TEXT`` matches percent-encoded (``%01``)."""
    return _NOT_XML_TEXT.sub(lambda m: quote(m.group(), safe="", errors="surrogatepass"), text)


def error_response(request: web.Request, status: int, message: str, headers: dict) -> web.Response:
    """The S3 error document for a failed request (called by ``server.api.app``'s boundary)."""
    code = request.get(CODE_KEY) or default_code(status)
    request_id = secrets.token_hex(8)
    headers = {**headers, "x-amz-request-id": request_id}
    if request.method == "HEAD":  # no body; the code travels in a header for debugging
        headers["x-amz-error-code"] = code
        return web.Response(status=status, headers=headers)
    root = element("Error")
    leaf(root, "Code", code)
    leaf(root, "Message", xml_safe(message))
    leaf(root, "Resource", xml_safe(request.path))
    leaf(root, "RequestId", request_id)
    body = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return web.Response(status=status, body=body, headers=headers,
                        content_type="application/xml", charset="utf-8")


def list_buckets_doc(buckets: dict[str, int]) -> ET.Element:
    root = element("ListAllMyBucketsResult")
    owner = ET.SubElement(root, "Owner")
    leaf(owner, "ID", OWNER_ID)
    leaf(owner, "DisplayName", OWNER_ID)
    node = ET.SubElement(root, "Buckets")
    for name in sorted(buckets):
        b = ET.SubElement(node, "Bucket")
        leaf(b, "Name", name)
        leaf(b, "CreationDate", iso8601(buckets[name]))
    return root


def location_doc() -> ET.Element:
    # us-east-1 is reported as an empty constraint, as AWS does.
    return element("LocationConstraint", text="" if REGION == "us-east-1" else REGION)


def contents_entry(meta, encode, owner: bool) -> ET.Element:
    c = element("Contents")
    leaf(c, "Key", encode(meta.name))
    leaf(c, "LastModified", iso8601(meta.atime_ns))
    leaf(c, "ETag", f'"{meta.etag}"')
    leaf(c, "Size", meta.size)
    if owner:
        o = ET.SubElement(c, "Owner")
        leaf(o, "ID", OWNER_ID)
        leaf(o, "DisplayName", OWNER_ID)
    leaf(c, "StorageClass", "STANDARD")
    return c


def list_objects_doc(*, v2: bool, bucket: str, prefix: str, delimiter: str, marker: str, max_keys: int,
                     url_encoded: bool, page, next_token: str = "", continuation_token: str | None = None,
                     fetch_owner: bool = False) -> ET.Element:
    """ListObjects (V1) or ListObjectsV2 result for one ``server.api.s3_listing.ListPage``.

    V1 gives NextMarker only with a delimiter (without one, clients resume after the last
    key, as S3 specifies); V2 gives KeyCount and an opaque NextContinuationToken, and an
    Owner per key only with fetch-owner=true (V1 always has it)."""
    enc = url_encode if url_encoded else (lambda s: s)
    root = element("ListBucketResult")
    leaf(root, "Name", bucket)
    leaf(root, "Prefix", enc(prefix))
    if v2:
        if marker:
            leaf(root, "StartAfter", enc(marker))
        if continuation_token is not None:
            leaf(root, "ContinuationToken", continuation_token)
        leaf(root, "KeyCount", len(page.contents) + len(page.prefixes))
    else:
        leaf(root, "Marker", enc(marker))
    leaf(root, "MaxKeys", max_keys)
    if delimiter:
        leaf(root, "Delimiter", enc(delimiter))
    if url_encoded:
        leaf(root, "EncodingType", "url")
    leaf(root, "IsTruncated", page.truncated)
    if page.truncated and v2:
        leaf(root, "NextContinuationToken", next_token)
    elif page.truncated and delimiter:
        leaf(root, "NextMarker", enc(page.last))
    root.extend(contents_entry(m, enc, owner=fetch_owner or not v2) for m in page.contents)
    for p in page.prefixes:
        cp = ET.SubElement(root, "CommonPrefixes")
        leaf(cp, "Prefix", enc(p))
    return root


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # with or without the S3 namespace


def _malformed(why: str) -> S3Error:
    return S3Error(400, "MalformedXML", f"The XML you provided was not well-formed: {why}")


def _parse_root(body: bytes, name: str) -> ET.Element:
    """A request document whose root element must be ``name`` (namespaced or not)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as e:
        raise _malformed(str(e)) from None
    if _local(root.tag) != name:
        raise _malformed(f"the root element is not {name}")
    return root


def parse_delete_doc(body: bytes, max_keys: int) -> tuple[bool, list[tuple[str, str | None, str | None]]]:
    """A DeleteObjects ``<Delete>`` document: (quiet, [(key, ETag or None, VersionId or None)])."""
    malformed = _malformed
    root = _parse_root(body, "Delete")
    quiet, objects = False, []
    for child in root:
        tag = _local(child.tag)
        if tag == "Quiet":
            quiet = (child.text or "").strip().lower() == "true"
        elif tag == "Object":
            fields = {_local(c.tag): c.text or "" for c in child}
            if "Key" not in fields:
                raise malformed("an Object without a Key")
            for name in fields.keys() - {"Key", "ETag", "VersionId"}:  # LastModifiedTime, Size: conditions
                raise S3Error(501, "NotImplemented", f"the {name} condition of DeleteObjects is not "
                              "implemented; nothing was deleted")
            objects.append((fields["Key"], fields.get("ETag"), fields.get("VersionId")))
        else:
            raise malformed(f"unexpected element {tag!r}")
    if not objects:
        raise malformed("no Object to delete")
    if len(objects) > max_keys:
        raise malformed(f"more than {max_keys} objects in one request")
    return quiet, objects


def delete_result_doc(deleted: list[str], errors: list[tuple[str, str, str]]) -> ET.Element:
    root = element("DeleteResult")
    for key in deleted:
        d = ET.SubElement(root, "Deleted")
        leaf(d, "Key", key)
    for key, code, message in errors:
        e = ET.SubElement(root, "Error")
        leaf(e, "Key", key)
        leaf(e, "Code", code)
        leaf(e, "Message", message)
    return root


def copy_result_doc(etag: str, modified_ns: int) -> ET.Element:
    root = element("CopyObjectResult")
    leaf(root, "ETag", f'"{etag}"')
    leaf(root, "LastModified", iso8601(modified_ns))
    return root


def upload_doc(tag: str, bucket: str, key: str, **fields: str) -> ET.Element:
    """InitiateMultipartUploadResult / CompleteMultipartUploadResult."""
    root = element(tag)
    if "Location" in fields:
        leaf(root, "Location", fields.pop("Location"))
    leaf(root, "Bucket", bucket)
    leaf(root, "Key", key)
    for name, value in fields.items():
        leaf(root, name, value)
    return root


def parse_complete_doc(body: bytes, max_parts: int) -> list[tuple[int, str]]:
    """A CompleteMultipartUpload document: [(PartNumber, ETag)] in the order given."""
    malformed = _malformed
    root = _parse_root(body, "CompleteMultipartUpload")
    parts = []
    for child in root:
        if _local(child.tag) != "Part":
            raise malformed(f"unexpected element {_local(child.tag)!r}")
        fields = {_local(c.tag): (c.text or "").strip() for c in child}
        if not is_decimal(fields.get("PartNumber", "")) or "ETag" not in fields:
            raise malformed("a Part needs a PartNumber and an ETag")
        parts.append((int(fields["PartNumber"]), fields["ETag"]))
        if len(parts) > max_parts:
            raise malformed(f"more than {max_parts} parts")
    return parts
