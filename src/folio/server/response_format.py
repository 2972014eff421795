"""OpenAI's `response_format`, as the structured outputs it asks for."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema, as the openai client sends it."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs its json_schema")
        if self.type == "json_schema" and self.json_schema.json_schema is None:
            # as OpenAI answers it; {"type": "json_object"} asks for any JSON object
            raise ValueError("response_format json_schema needs a schema "
                             "(json_schema.schema); for any JSON object give "
                             '{"type": "json_object"}')
        return self

    def structured_outputs(self) -> Optional[dict[str, Any]]:
        """The StructuredOutputsParams fields it means (None: plain text)."""
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        return {"json_object": True} if self.type == "json_object" else None
