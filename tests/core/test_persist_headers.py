"""Everything a cache file's header says is parsed strictly: a crafted header is refused
with a library error naming what is wrong, and the pool is left as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors")

from kvcache_core.contract.config import MAX_TOKEN_ID
from kvcache_core.errors import CorruptCacheFileError, IncompatibleCacheFileError, KvCacheError
from kvcache_core.offload.strict_json import json_depth, parse_json
from kvcache_core.paging.prefix import hash_block, namespace_root
from tests.core.cache_files import pool, read_file, saved, snapshot, write_file

RAW = "__raw__"  # a placeholder replaced by raw JSON text once the header is encoded


def refused(path: Path, error: type[KvCacheError], match: str) -> None:
    manager = pool()
    before = snapshot(manager)
    with pytest.raises(error, match=match):
        manager.load_prefix_cache(path)
    assert snapshot(manager) == before
    manager.check_invariants()


def crafted(tmp_path: Path, change: dict[str, Any], raw: str = "") -> Path:
    """A saved file whose header is updated with ``change`` (its first block's fields under
    ``"block"``), ``RAW`` then replaced by ``raw``."""
    path = saved(tmp_path)
    header, keys, values = read_file(path)
    header["blocks"][0].update(change.pop("block", {}))
    header.update(change)
    write_file(path, json.dumps(header).replace(json.dumps(RAW), raw), keys, values)
    return path


def with_token(tmp_path: Path, raw: str) -> Path:
    path = saved(tmp_path)
    header, keys, values = read_file(path)
    tokens = header["blocks"][0]["token_ids"]
    tokens[0] = RAW
    write_file(path, json.dumps(header).replace(json.dumps(RAW), raw), keys, values)
    return path


@pytest.mark.parametrize("raw", ["-1", str(2**64), str(2**63), "1.0", "true", '"7"', "null", "[1]"])
def test_a_token_id_that_is_not_an_int_in_range_is_refused(tmp_path: Path, raw: str) -> None:
    refused(with_token(tmp_path, raw), CorruptCacheFileError, rf"block 0's token id 0 is .*\[0, {MAX_TOKEN_ID}\]")


def test_a_token_id_out_of_the_range_of_a_float_is_refused(tmp_path: Path) -> None:
    refused(with_token(tmp_path, "1e400"), CorruptCacheFileError, "1e400 is out of the range of a float")


def test_a_token_id_past_the_largest_is_refused_even_with_a_recomputed_hash(tmp_path: Path) -> None:
    path = saved(tmp_path)
    header, keys, values = read_file(path)
    first = header["blocks"][0]
    first["token_ids"][-1] = MAX_TOKEN_ID + 1
    first["hash"] = hash_block(namespace_root(None), first["token_ids"], None).hex()
    header["blocks"] = [first]
    write_file(path, header, keys[:, :1].copy(), values[:, :1].copy())
    refused(path, CorruptCacheFileError, "token id 3 is 9223372036854775808")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests 100001 deep"),
        ("NaN", "NaN is not a number"),
        ("-Infinity", "-Infinity is not a number"),
        ("1e400", "out of the range of a float"),
        ("9" * 5000, "4300 digits"),
    ],
)
def test_a_header_value_json_does_not_allow_here_is_refused(tmp_path: Path, raw: str, match: str) -> None:
    refused(crafted(tmp_path, {"extra": RAW}, raw), CorruptCacheFileError, match)


def test_a_header_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    header, keys, values = read_file(path)
    write_file(path, '{"version": 1, ' + json.dumps(header)[1:], keys, values)
    refused(path, CorruptCacheFileError, "key 'version' twice")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hash", "AB" * 32, "hash is 'ABAB"),
        ("hash", "ab" * 31, "hash is 'abab"),
        ("hash", " " + "ab" * 31 + "a", "hash is ' abab"),
        ("hash", 7, "hash is 7"),
        ("parent", "zz" * 32, "parent is 'zzzz"),
        ("salt", "abc", "salt is 'abc'"),
        ("salt", ["ab"], r"salt is \['ab'\]"),
        ("checksum", 12, "checksum is 12"),
        ("token_ids", [1, 2, 3], "has 3 token ids; expected a list of 4"),
        ("token_ids", "1234", "has token ids '1234'"),
        ("group", True, "group True"),
        ("group", 1.0, "group 1.0"),
        ("group", -1, "group -1"),
        ("group", 1, "group 1; the groups are ints 0 to 0"),
    ],
)
def test_a_block_field_of_the_wrong_type_or_range_is_refused(
    tmp_path: Path, field: str, value: object, match: str
) -> None:
    refused(crafted(tmp_path, {"block": {field: value}}), CorruptCacheFileError, match)


def test_a_block_without_a_field_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    header, keys, values = read_file(path)
    del header["blocks"][1]["checksum"]
    write_file(path, header, keys, values)
    refused(path, CorruptCacheFileError, "block 1's header entry has no 'checksum'")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"version": True}, "format version True"),
        ({"version": 1.0}, "format version 1.0"),
        ({"geometry": {"num_layers": 2, "num_heads": 2, "head_dim": 4, "block_size": 4.0}}, "geometry"),
        ({"geometry": {"num_layers": 2, "num_heads": 2, "head_dim": 4, "block_size": True}}, "geometry"),
        ({"dtype": ["float32"]}, r"\['float32'\] blocks"),
    ],
)
def test_a_header_value_equal_only_across_json_types_is_incompatible(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    refused(crafted(tmp_path, change), IncompatibleCacheFileError, match)


def test_blocks_that_are_not_a_list_are_refused(tmp_path: Path) -> None:
    refused(crafted(tmp_path, {"blocks": {"0": 1}}), CorruptCacheFileError, "'blocks' is not a list")


# -- the safetensors header around it --------------------------------------------------------


def with_table(tmp_path: Path, text: bytes) -> Path:
    """A saved file whose safetensors header is replaced by ``text`` (data kept)."""
    path = saved(tmp_path)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    return path


def table_of(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    table: dict[str, Any] = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return table


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 50_000 + b"]" * 50_000, "nests 50000 deep"),
        (b"[]", "not a JSON object"),
        (b'{"keys": NaN}', "NaN"),
        (b"{", "not valid JSON"),
    ],
)
def test_a_safetensors_header_that_is_not_strict_json_is_refused(tmp_path: Path, text: bytes, match: str) -> None:
    refused(with_table(tmp_path, text), CorruptCacheFileError, match)


def edited_table(table: dict[str, Any], edit: str) -> None:
    """Apply the edit named ``edit`` to a safetensors header ``table``."""
    keys: dict[str, Any] = table["keys"]
    values: dict[str, Any] = table["values"]
    if edit == "no values":
        del table["values"]
    elif edit == "a third tensor":
        table["other"] = keys
    elif edit == "an unknown dtype":
        keys["dtype"] = "Q99"
    elif edit == "a bool in a shape":
        keys["shape"] = [2, True, 4, 2, 4]
    elif edit == "a negative offset":
        keys["data_offsets"] = [0, -1]
    elif edit == "a dtype of another size":
        keys["dtype"] = "F16"
    elif edit == "a gap between tensors":
        values["data_offsets"] = [8 + offset for offset in values["data_offsets"]]
    elif edit == "no metadata":
        del table["__metadata__"]
    else:
        raise AssertionError(edit)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("no values", r"holds the tensors \['keys'\]"),
        ("a third tensor", "holds the tensors"),
        ("an unknown dtype", "tensor 'keys' is declared"),
        ("a bool in a shape", "tensor 'keys' is declared"),
        ("a negative offset", "tensor 'keys' is declared"),
        ("a dtype of another size", "takes .* bytes; its data offsets"),
        ("a gap between tensors", "starts at byte 1032 of the data, expected 1024"),
        ("no metadata", "no 'kvcache' metadata"),
    ],
)
def test_a_safetensors_header_that_does_not_declare_keys_and_values_exactly_is_refused(
    tmp_path: Path, edit: str, match: str
) -> None:
    path = saved(tmp_path)
    table = table_of(path)
    edited_table(table, edit)
    refused(with_table(tmp_path, json.dumps(table).encode()), CorruptCacheFileError, match)


# -- strict JSON ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["]]]]", "[[[["]', 1),
        ('["\\"[[[", "\\\\", [[]]]', 3),
        ('"[[[' + "\\" * 3, 0),  # an unterminated string swallows the rest
    ],
)
def test_json_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_json_depth_of_a_document_too_deep_for_the_parser_is_counted_without_recursion() -> None:
    assert json_depth("[" * 1_000_000 + "]" * 1_000_000) == 1_000_000


def test_strict_json_accepts_plain_documents() -> None:
    assert parse_json(b'{"a": [1, 2.5, null, true, "x"]}', what="it", error=CorruptCacheFileError) == {
        "a": [1, 2.5, None, True, "x"]
    }
