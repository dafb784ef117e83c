"""Schemas shared by the structured-output tests."""

# The acceptance schema: required string, integer, enum and array fields. Bounds keep a
# random model's answer finite (the grammar closes strings and arrays at their limits).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"type": "string", "enum": ["engineer", "artist", "doctor", "teacher"]},
        "skills": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 16},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def deep_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def many_tools(n: int, props: int = 8) -> list[dict]:
    """``n`` OpenAI function tools with rich parameter schemas (unions, patterns, nesting)."""
    out = []
    for i in range(n):
        params = {f"p{j}": {"type": ["string", "integer", "array"], "items": {"anyOf": [
            {"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{1,5}[0-9]+"}}},
            {"type": "number"}]}} for j in range(props)}
        out.append({"type": "function", "function": {"name": f"tool_{i}", "parameters": {
            "type": "object", "properties": params, "required": list(params)}}})
    return out
