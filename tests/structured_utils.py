"""Seeded random JSON schemas for the guided-decoding tests (nested objects, arrays, enums, bounded
numbers, required fields), and a check that an output text parses and validates."""

from __future__ import annotations

import json
import random

import jsonschema


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties; every property is required or not at random."""
    props = {}
    for i in range(rng.randint(1, 4)):
        props[f"{rng.choice(['id', 'name', 'kind', 'size', 'tags', 'meta', 'x'])}{i}"] = _value(rng, depth)
    required = [k for k in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "number", "enum", "string", "boolean", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = _value(rng, depth + 1) if depth < 2 else {"type": "integer", "minimum": 0, "maximum": 9}
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def random_schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
