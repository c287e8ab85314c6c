"""The OpenAI API's request and response models (pydantic): parsing and /openapi.json both come from them."""
