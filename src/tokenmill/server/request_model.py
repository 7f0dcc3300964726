"""The base classes of request and response bodies: how unknown and null fields are treated."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from tokenmill.errors import InvalidRequestError

logger = logging.getLogger("tokenmill.server")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


_logged_unknown_fields: set[str] = set()


def log_unknown_field(model: str, name: str) -> None:
    """Warns once per field name: a field tokenmill does not know changes nothing, and the operator
    should hear of it (a client may expect it to), without a log line per request."""
    key = f"{model}.{name}"
    if key in _logged_unknown_fields:
        return
    _logged_unknown_fields.add(key)
    logger.warning("requests carry the field %r (in %s), which tokenmill does not know; it is ignored", name, model)


class RequestModel(BaseModel):
    # Unknown fields are accepted (OpenAI clients send extras freely) but logged once per name,
    # never dropped silently; the fields tokenmill knows and cannot honour are declared and refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's schema marks most fields nullable and clients do send `"n": null`: null = unset.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> RequestModel:
        extra = self.__pydantic_extra__
        if extra:
            for name in extra:
                log_unknown_field(type(self).__name__, name)
            extra.clear()
        return self


def refuse(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} is not supported: {why}", param=name)
