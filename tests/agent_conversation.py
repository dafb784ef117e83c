"""A ten-turn agent conversation and an independent oracle for its checkpoints.

The system prompt carries tool definitions as text; turns alternate user
requests, assistant tool calls and appended tool results, as an agent loop
sends them. Request ``i`` (1-based) carries ``MESSAGES[: 2 * i]``: each turn
appends the assistant's tool call (scripted, as the agent decided it) and the
tool's result (or an assistant answer and the next user message).

Oracle (not the product's mapping): a message endpoint is the token length of
the conversation rendered up to that message *tokenized on its own*, when that
is a prefix of the prompt's tokens; a prompt endpoint is the whole prompt; a
terminal endpoint is the prompt plus every sampled token but the last (which
is pending, never consumed).
"""

from __future__ import annotations

import json

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"city": "string", "unit": "celsius|fahrenheit"}},
    {"name": "search_restaurants", "description": "Restaurants near a place, filtered by cuisine.",
     "parameters": {"near": "string", "cuisine": "string", "max_results": "integer"}},
    {"name": "book_table", "description": "Book a table at a restaurant.",
     "parameters": {"restaurant_id": "string", "time": "HH:MM", "people": "integer"}},
    {"name": "send_message", "description": "Send a text message to a contact.",
     "parameters": {"to": "string", "text": "string"}},
]

SYSTEM = ("You are a careful assistant that completes tasks with tools. Call a tool by writing "
          "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> and wait for its result.\n"
          "Available tools:\n" + "\n".join(json.dumps(t) for t in TOOLS))


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "I'm in Lyon tonight. Is it warm enough to eat outside?"},
    {"role": "assistant", "content": _call("get_weather", city="Lyon", unit="celsius")},
    {"role": "tool", "content": json.dumps({"city": "Lyon", "temp_c": 22, "sky": "clear", "wind_kmh": 8})},
    {"role": "assistant", "content": _call("search_restaurants", near="Lyon Presqu'île", cuisine="bouchon",
                                           max_results=3)},
    {"role": "tool", "content": json.dumps({"results": [
        {"id": "r-101", "name": "Le Garet", "terrace": True},
        {"id": "r-102", "name": "Daniel et Denise", "terrace": False},
        {"id": "r-103", "name": "Café Comptoir Abel", "terrace": True}]})},
    {"role": "assistant", "content": "It is 22 °C and clear, so a terrace works. Le Garet and Café Comptoir Abel "
                                     "have terraces. Which one should I book, and for what time?"},
    {"role": "user", "content": "Le Garet at 20:30 for three people, please."},
    {"role": "assistant", "content": _call("book_table", restaurant_id="r-101", time="20:30", people=3)},
    {"role": "tool", "content": json.dumps({"status": "confirmed", "reference": "LG-7731"})},
    {"role": "assistant", "content": _call("send_message", to="Camille",
                                           text="Table for 3 at Le Garet, 20:30 (ref LG-7731).")},
    {"role": "tool", "content": json.dumps({"status": "sent"})},
    {"role": "assistant", "content": "Booked: Le Garet, 20:30, three people, reference LG-7731. I told Camille."},
    {"role": "user", "content": "Will it still be dry at 23:00? Also, how far is it from Part-Dieu?"},
    {"role": "assistant", "content": _call("get_weather", city="Lyon", unit="celsius")},
    {"role": "tool", "content": json.dumps({"city": "Lyon", "forecast_23h": {"temp_c": 17, "rain_mm": 0}})},
    {"role": "assistant", "content": _call("search_restaurants", near="Part-Dieu", cuisine="any", max_results=1)},
    {"role": "tool", "content": json.dumps({"results": [{"id": "r-200", "distance_km": 2.1}]})},
    {"role": "assistant", "content": "Dry at 23:00 (17 °C), and about 2 km from Part-Dieu."},
    {"role": "user", "content": "Great, thanks! 🍷"},
]
TURNS = 10
assert len(MESSAGES) == 2 * TURNS


def turn_messages(i: int) -> list[dict]:
    """The messages of request ``i`` (1-based)."""
    return MESSAGES[: 2 * i]


def oracle_message_endpoints(template, codec, messages: list[dict], prompt: list[int]) -> list[int]:
    out = []
    for j in range(1, len(messages) + 1):
        ids = codec.encode(template.render(messages[:j], add_generation_prompt=False), add_special_tokens=False)
        if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids:
            out.append(len(ids))
    return out


def complete_messages_length(template, codec, messages: list[dict]) -> int:
    return len(codec.encode(template.render(messages, add_generation_prompt=False), add_special_tokens=False))


def deepest_published(published: set[tuple[int, ...]], prompt: list[int]) -> int:
    """The deepest published endpoint whose tokens prefix ``prompt`` (0 if none)."""
    return max((len(e) for e in published if len(e) <= len(prompt) and tuple(prompt[: len(e)]) == e), default=0)
