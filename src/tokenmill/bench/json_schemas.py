"""The JSON schemas of the structured-output workload, each with a task and a valid example.

Every schema is bounded, so that a grammar-constrained reply ends within a known number of tokens
even when the model's weights are random: strings have maxLength (or an enum / pattern of fixed
length), integers and numbers have minimum and maximum (xgrammar also caps a bounded number's
fraction digits), arrays have maxItems, objects have additionalProperties false and every property
required, and nothing is recursive. With random weights nothing steers the reply toward the end,
so an unbounded field (a bare string, an open array) could run to max_tokens and count as invalid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    task: str  # what the prompt asks for, before the schema
    schema: dict[str, Any]
    example: Any  # one instance that validates (checked by the unit tests)


def _string(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _number(minimum: float, maximum: float) -> dict[str, Any]:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """A closed object whose properties are all required (optional ones would make outputs vary more)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _array(items: dict[str, Any], max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def _enum(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "user_profile",
        "Create a user profile for a new member of a hiking club.",
        _object(
            {
                "name": _string(24),
                "age": _integer(13, 120),
                "email": _string(40, 5),
                "is_active": {"type": "boolean"},
            }
        ),
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "is_active": True},
    ),
    SchemaCase(
        "weather_report",
        "Report today's weather in a coastal city.",
        _object(
            {
                "city": _string(24),
                "temperature_c": _number(-80, 60),
                "condition": _enum("sunny", "cloudy", "rain", "snow", "fog", "storm"),
                "humidity_pct": _integer(0, 100),
            }
        ),
        {"city": "Lisbon", "temperature_c": 21.5, "condition": "sunny", "humidity_pct": 64},
    ),
    SchemaCase(
        "product_listing",
        "Describe a product for an online hardware store.",
        _object(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "title": _string(32),
                "price_usd": _number(0, 10000),
                "in_stock": {"type": "boolean"},
                "tags": _array(_enum("tools", "garden", "paint", "electrical", "plumbing"), 3),
            }
        ),
        {"sku": "HAM-0042", "title": "Claw hammer", "price_usd": 19.99, "in_stock": True, "tags": ["tools"]},
    ),
    SchemaCase(
        "postal_address",
        "Write the shipping address of a small bookshop.",
        _object(
            {
                "recipient": _string(24),
                "street": _string(32),
                "city": _string(20),
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": _enum("US", "CA", "GB", "FR", "DE", "JP"),
            }
        ),
        {
            "recipient": "Page & Co",
            "street": "12 Elm St",
            "city": "Salem",
            "postal_code": "01970",
            "country": "US",
        },
    ),
    SchemaCase(
        "calendar_event",
        "Schedule a team meeting next month.",
        _object(
            {
                "title": _string(32),
                "date": {
                    "type": "string",
                    "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
                },
                "start_hour": _integer(0, 23),
                "duration_min": _integer(5, 480),
                "attendees": _array(_string(16), 4, 1),
            }
        ),
        {
            "title": "Planning",
            "date": "2026-12-03",
            "start_hour": 10,
            "duration_min": 45,
            "attendees": ["Kim"],
        },
    ),
    SchemaCase(
        "book_record",
        "Catalogue a classic novel for a library.",
        _object(
            {
                "title": _string(40),
                "author": _string(32),
                "year": _integer(1450, 2030),
                "genres": _array(_enum("fiction", "mystery", "romance", "sci-fi", "history", "poetry"), 3, 1),
                "rating": _number(0, 5),
            }
        ),
        {
            "title": "Emma",
            "author": "Jane Austen",
            "year": 1815,
            "genres": ["fiction", "romance"],
            "rating": 4.2,
        },
    ),
    SchemaCase(
        "sentiment_analysis",
        "Classify the sentiment of the review 'The battery lasts forever but the screen is dim.'",
        _object(
            {
                "label": _enum("positive", "negative", "neutral", "mixed"),
                "confidence": _number(0, 1),
                "keywords": _array(_string(16), 4),
            }
        ),
        {"label": "mixed", "confidence": 0.8, "keywords": ["battery", "screen"]},
    ),
    SchemaCase(
        "server_config",
        "Write the configuration of a web server behind a load balancer.",
        _object(
            {
                "host": _string(32),
                "port": _integer(1, 65535),
                "tls": {"type": "boolean"},
                "log_level": _enum("debug", "info", "warning", "error"),
                "workers": _integer(1, 64),
                "timeout_s": _number(0.1, 600),
            }
        ),
        {"host": "0.0.0.0", "port": 8443, "tls": True, "log_level": "info", "workers": 8, "timeout_s": 30},
    ),
    SchemaCase(
        "recipe",
        "Give a simple recipe for pancakes.",
        _object(
            {
                "name": _string(32),
                "servings": _integer(1, 12),
                "ingredients": _array(_object({"item": _string(20), "grams": _integer(1, 2000)}), 4, 1),
                "vegetarian": {"type": "boolean"},
            }
        ),
        {
            "name": "Pancakes",
            "servings": 4,
            "ingredients": [{"item": "flour", "grams": 200}],
            "vegetarian": True,
        },
    ),
    SchemaCase(
        "purchase_order",
        "Write a purchase order for office supplies.",
        {
            "$defs": {
                "party": _object({"name": _string(24), "country": _enum("US", "GB", "DE", "JP")}),
                "line": _object(
                    {"sku": _string(12), "quantity": _integer(1, 99), "unit_price": _number(0, 1000)}
                ),
            },
            **_object(
                {
                    "order_id": _integer(1, 999999),
                    "buyer": {"$ref": "#/$defs/party"},
                    "seller": {"$ref": "#/$defs/party"},
                    "lines": _array({"$ref": "#/$defs/line"}, 3, 1),
                }
            ),
        },
        {
            "order_id": 1042,
            "buyer": {"name": "Acme", "country": "US"},
            "seller": {"name": "Paperworks", "country": "GB"},
            "lines": [{"sku": "PEN-01", "quantity": 20, "unit_price": 0.5}],
        },
    ),
    SchemaCase(
        "bank_transaction",
        "Record a card payment at a café.",
        _object(
            {
                "transaction_id": {"type": "string", "pattern": "^tx_[a-f0-9]{8}$"},
                "amount": _number(0.01, 5000),
                "currency": _enum("USD", "EUR", "GBP", "JPY"),
                "status": _enum("pending", "settled", "declined"),
                "note": {"anyOf": [_string(24), {"type": "null"}]},
            }
        ),
        {
            "transaction_id": "tx_00c0ffee",
            "amount": 4.5,
            "currency": "EUR",
            "status": "settled",
            "note": None,
        },
    ),
    SchemaCase(
        "employee_directory_entry",
        "Add an engineer to the company directory.",
        _object(
            {
                "employee": _object(
                    {"first_name": _string(16), "last_name": _string(16), "level": _integer(1, 10)}
                ),
                "team": _object(
                    {
                        "name": _string(20),
                        "location": _object({"city": _string(20), "floor": _integer(0, 80)}),
                    }
                ),
                "skills": _array(_string(16), 5),
            }
        ),
        {
            "employee": {"first_name": "Grace", "last_name": "Hopper", "level": 7},
            "team": {"name": "Compilers", "location": {"city": "Arlington", "floor": 3}},
            "skills": ["COBOL"],
        },
    ),
    SchemaCase(
        "geo_point",
        "Give the location of a lighthouse.",
        _object(
            {
                "name": _string(32),
                "coordinates": _array(_number(-180, 180), 2, 2),
                "elevation_m": _integer(-430, 8849),
            }
        ),
        {"name": "Fastnet", "coordinates": [51.39, -9.6], "elevation_m": 49},
    ),
    SchemaCase(
        "quiz_question",
        "Write a multiple-choice question about astronomy.",
        _object(
            {
                "question": _string(64),
                "choices": _array(_string(24), 4, 2),
                "answer_index": _integer(0, 3),
                "difficulty": _enum(1, 2, 3),
            }
        ),
        {
            "question": "Which planet is largest?",
            "choices": ["Mars", "Jupiter"],
            "answer_index": 1,
            "difficulty": 1,
        },
    ),
)
