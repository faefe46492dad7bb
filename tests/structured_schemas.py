"""Twenty JSON schemas of the shapes extraction and agent traffic sends: nested objects,
arrays, enums, bounded numbers, required and optional fields, $ref. Shared by the
SDK, embedded-server and cluster tests, each with a prompt that asks for it."""
from __future__ import annotations

from typing import Any

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}),
    ("a product", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"}}, "required": ["title", "price", "in_stock"]}),
    ("a color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                 "required": ["color"]}),
    ("a list of three fruits", {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 3, "maxItems": 3}},
        "required": ["fruits"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                                  "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a user with an address", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "address": _ADDRESS}, "required": ["name", "address"]}),
    ("an order using $ref", {"$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}, "type": "object", "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}},
        "required": ["items"]}),
    ("a yes/no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "unit": {"const": "C"}}, "required": ["celsius", "unit"]}),
    ("a book with optional fields", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "isbn": {"type": "string", "maxLength": 17}}, "required": ["title"]}),
    ("a weekday", {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("a matrix of two rows", {"type": "array", "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2},
        "minItems": 2, "maxItems": 2}),
    ("an event", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "integer", "minimum": 0, "maximum": 500}}, "required": ["name", "date", "attendees"]}),
    ("a status with a nullable note", {"type": "object", "properties": {
        "status": {"enum": ["ok", "error"]}, "note": {"type": ["string", "null"], "maxLength": 30}},
        "required": ["status", "note"]}),
    ("a trip using one $ref twice", {"$defs": {"place": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city"]}}, "type": "object", "properties": {
        "origin": {"$ref": "#/$defs/place"}, "destination": {"$ref": "#/$defs/place"}},
        "required": ["origin", "destination"]}),
    ("a shape, one of two kinds", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0,
                                                                                  "maximum": 100}},
         "required": ["kind", "radius"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0,
                                                                                "maximum": 100}},
         "required": ["kind", "side"]}]}),
    ("a map of scores", {"type": "object", "properties": {"scores": {
        "type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
        "maxProperties": 3}}, "required": ["scores"]}),
    ("a contact list", {"type": "object", "properties": {"contacts": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["name", "email"]}}}, "required": ["contacts"]}),
    ("a flight", {"type": "object", "properties": {
        "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "seats": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{1,2}[A-F]$"}, "maxItems": 3},
        "class": {"enum": ["economy", "business"]}}, "required": ["from", "to", "class"]}),
]


# vLLM's test grammar (its tests' sample_sql_statements), in Lark: the lark tests of the
# worker's converter and of the servers.
SQL_GRAMMAR = """
start: select_statement
select_statement: "SELECT " column " from " table " where " condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
