"""Checks of local data files before ``datasets`` reads them: one clear error naming the file.

``datasets`` reports an empty file, bytes that are not UTF-8 or a malformed JSON line or
CSV row with a long traceback that names neither the file nor the line. These checks
stream each file once and raise :class:`merak.config.ConfigError` naming the file and the
line (or the byte offset of the first byte that is not UTF-8) and what is wrong.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterator
from typing import NoReturn

from merak.config import ConfigError

# csv's default field limit (128 kB) is smaller than many documents; pandas, which datasets'
# csv builder uses, has no such limit, so the check must not have one either.
_CSV_FIELD_LIMIT = 2**31 - 1


def _file_error(path: str, what: str) -> ConfigError:
    return ConfigError(f"invalid configuration:\n  - data.files: {path}: {what}")


def _utf8_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line with its end) of each line of ``path``, decoded as UTF-8.

    Lines are split on the byte ``\\n``, which never occurs inside a multi-byte UTF-8 sequence, so
    decoding line by line finds exactly the bytes a whole-file decode rejects, in constant memory
    (one line at a time), and knows the file offset of the first bad byte.

    Raises:
        ConfigError: at the first byte that is not UTF-8 (its offset from the start of the file).
    """
    offset = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                bad = raw[error.start:error.start + 1].hex()
                raise _file_error(path, f"not UTF-8 at byte {offset + error.start} (line {number}): cannot "
                                        f"decode 0x{bad} ({error.reason}); save the file as UTF-8") from None
            offset += len(raw)
            # pandas and pyarrow skip a UTF-8 byte order mark; so do the checks below.
            yield number, line.removeprefix("\ufeff") if number == 1 else line


def _no_text(path: str, column: str | None, count: int, unit: str) -> ConfigError:
    where = "" if column is None else f" in the column {column!r}"
    return _file_error(path, f"no text{where} ({count} {unit}, all blank or empty)")


def _check_text_file(path: str, column: str) -> None:
    """A .txt file (one document per line; ``column`` is unused) must be UTF-8 with a non-blank line."""
    count, has_text = 0, False
    for count, line in _utf8_lines(path):  # noqa: B007 (after the loop, count is the number of lines)
        has_text = has_text or bool(line.strip())
    if not has_text:
        raise _no_text(path, None, count, "lines")


def _missing_column(path: str, column: str, columns) -> ConfigError:
    return _file_error(path, f"data.text_column={column!r} is not a column; columns: "
                             f"{', '.join(map(str, columns)) or '(none)'}")


def _json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _reject_constant(name: str) -> NoReturn:
    # Python's json accepts NaN and Infinity; pyarrow (datasets' JSON reader) does not.
    raise ValueError(f"{name} is not valid JSON")


def _json_value(path: str, text: str, line: int, hint: str = ""):
    """``text`` (starting on ``line``) parsed as JSON, or ConfigError naming the line and what is wrong."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise _file_error(path, f"line {line + error.lineno - 1} is not valid JSON: {error.msg} "
                                f"(column {error.colno}){hint}") from None
    except ValueError as error:
        raise _file_error(path, f"line {line} is not valid JSON: {error}") from None


def _check_text_value(path: str, where: str, record: dict, column: str) -> bool:
    """Whether ``record`` has non-blank text in ``column``; ConfigError if it holds something else."""
    value = record.get(column)
    if value is not None and not isinstance(value, str):
        raise _file_error(path, f"{where}: the text column {column!r} holds {_json_kind(value)}, not a string")
    return bool(value and value.strip())


def _check_json_array(path: str, column: str) -> None:
    """A file holding one JSON array, of objects or of strings (datasets names the latter's column text)."""
    with open(path, encoding="utf-8-sig") as handle:  # whole: datasets reads such a file whole too
        items = _json_value(path, handle.read(), 1)
    if not items:
        raise _file_error(path, "the JSON array is empty")
    if all(isinstance(item, str) for item in items):
        if column != "text":
            raise _missing_column(path, column, ["text"])
        if not any(item.strip() for item in items):
            raise _no_text(path, column, len(items), "strings")
        return
    columns: dict[str, None] = {}
    has_text = False
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise _file_error(path, f"item {index} of the JSON array is {_json_kind(item)}, not an object "
                                    "(use objects with a text field, or only strings)")
        columns.update(dict.fromkeys(item))
        has_text = _check_text_value(path, f"item {index}", item, column) or has_text
    if column not in columns:
        raise _missing_column(path, column, columns)
    if not has_text:
        raise _no_text(path, column, len(items), "objects")


def _check_json_file(path: str, column: str) -> None:
    """A .json/.jsonl file: JSON lines of objects (or one JSON array), with text in ``column``.

    JSON lines are parsed one at a time (constant memory), so the error names the line.
    """
    lines = _utf8_lines(path)
    columns: dict[str, None] = {}
    has_text, count = False, 0
    for number, line in lines:
        if not line.strip():
            continue
        if count == 0 and line.lstrip().startswith("["):
            for _ in lines:  # the rest must be UTF-8 too; this check says where it is not
                pass
            _check_json_array(path, column)
            return
        record = _json_value(path, line, number, "; JSON lines hold one object per line")
        if not isinstance(record, dict):
            raise _file_error(path, f"line {number} is {_json_kind(record)}, not a JSON object "
                                    f"(each line must be an object such as {{\"{column}\": \"...\"}})")
        count += 1
        columns.update(dict.fromkeys(record))
        has_text = _check_text_value(path, f"line {number}", record, column) or has_text
    if count == 0:
        raise _file_error(path, "has no JSON objects (only blank lines)")
    if column not in columns:
        raise _missing_column(path, column, columns)
    if not has_text:
        raise _no_text(path, column, count, "objects")


@contextlib.contextmanager
def _csv_field_limit(limit: int):
    previous = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(previous)  # the limit is process-wide: leave it as it was


def _csv_rows(path: str) -> Iterator[tuple[int, list[str]]]:
    """(first line, fields) of each non-blank record of a CSV file (a quoted field may span lines)."""
    record: list[str] = []  # the lines the reader took for the record it is reading

    def lines() -> Iterator[str]:
        for _, line in _utf8_lines(path):
            record.append(line)
            yield line

    reader = csv.reader(lines())
    start, held = 1, None  # held back until the next record shows it does not end the file
    while True:
        record.clear()
        try:
            row = next(reader)
        except csv.Error as error:
            raise _file_error(path, f"line {reader.line_num} is not valid CSV: {error}") from None
        except StopIteration:
            break
        if row and not (len(row) == 1 and not row[0].strip()):  # pandas skips blank lines; so does this
            if held is not None:
                yield held[:2]
            held = (start, row, list(record))
        start = reader.line_num + 1
    if held is not None:
        if _ends_inside_quotes(held[2]):
            raise _file_error(path, f"line {held[0]}: a quoted field is not closed before the end of the file")
        yield held[:2]


def _ends_inside_quotes(record: list[str]) -> bool:
    """Whether the lenient reader took the rest of the file into one quoted field (pandas rejects that).

    Only the last record can; strict mode (which also rejects things pandas accepts) re-reads just it.
    """
    try:
        for _ in csv.reader(record, strict=True):
            pass
    except csv.Error as error:
        return "unexpected end of data" in str(error)
    return False


def _check_csv_file(path: str, column: str) -> None:
    """A .csv file: a header naming ``column``, and every record with as many fields as the header."""
    with _csv_field_limit(_CSV_FIELD_LIMIT):
        _check_csv_records(path, column)


def _check_csv_records(path: str, column: str) -> None:
    """The checks of :func:`_check_csv_file`, under its field-size limit."""
    rows = _csv_rows(path)
    header = next(rows, None)
    if header is None:
        raise _file_error(path, "is empty (no header line)")
    header_line, names = header
    if column not in names:
        raise _missing_column(path, column, names)
    index, count, has_text = names.index(column), 0, False
    for line, row in rows:
        if len(row) != len(names):
            raise _file_error(path, f"line {line} has {len(row)} field{'s' * (len(row) != 1)}, the header "
                                    f"(line {header_line}) has {len(names)}; quote fields that hold commas")
        count += 1
        has_text = has_text or bool(row[index].strip())
    if not has_text:
        raise _no_text(path, column, count, "rows")


_CHECKS = {"text": _check_text_file, "json": _check_json_file, "csv": _check_csv_file}


def check_data_file(path: str, reader: str, text_column: str) -> None:
    """Check that ``datasets``' ``reader`` ("text", "json" or "csv") can read ``path`` and finds text.

    Cheaper than ``datasets`` and precise where it is not: the file is streamed once, and the
    error names the file and what is wrong (the line, or the byte offset of the first byte that
    is not UTF-8).

    Raises:
        ConfigError: empty, unreadable, not UTF-8, malformed (JSON or CSV), without the text
            column, or without any text.
    """
    if os.path.isdir(path):
        raise _file_error(path, "is a directory, not a file")
    try:
        if os.path.getsize(path) == 0:
            raise _file_error(path, "is empty (0 bytes)")
        _CHECKS[reader](path, text_column)
    except OSError as error:
        raise _file_error(path, f"cannot be read: {error.strerror or error}") from None
